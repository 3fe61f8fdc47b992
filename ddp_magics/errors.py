"""The error vocabulary: one-line usage errors, per-rank failures, hang and interrupt reports."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from IPython.core.error import UsageError

from ddp_magics.cluster.records import RECOVER_AGAIN, RESTART, SHRINK, RankFailure
from ddp_magics.protocol import DEBUGGER_QUIT, rank_label
from ddp_magics.stacks import BlockedRank

RESTART_ADVICE = (
    "Run %dist_recover to get every rank back with its state (a new process group), "
    "or %dist_restart for new engines."
)
# How the magics say each way out of a ClusterError (cluster.records' words).
WAYS_OUT = {
    SHRINK: "%dist_recover --shrink goes on without the dead ranks",
    RESTART: "%dist_restart starts new engines (every rank's state is lost)",
    RECOVER_AGAIN: "%dist_recover tries again",
}


def ways_out(words: tuple[str, ...]) -> str:
    """``%dist_restart starts new engines (...); %dist_recover tries again``, each way once."""
    return "; ".join(WAYS_OUT[word] for word in dict.fromkeys(words))


# After a recovery failed part way, when the ranks are no longer one process group.
BROKEN_ADVICE = ways_out((RESTART, RECOVER_AGAIN)) + "."


def usage_error(message: str) -> UsageError:
    """A user mistake: IPython shows it as one line, without a traceback."""
    return UsageError(message)


@dataclass(frozen=True)
class RankDeath:
    """A rank whose engine process ended during the cell: how, and where its Python was if it
    crashed (as far as the notebook's machine can tell: for engines forked there)."""

    rank: int
    how: str | None = None  # "killed by SIGSEGV (Segmentation fault)", "exited with status 3"
    crashed_at: BlockedRank | None = None

    def lines(self) -> list[str]:
        headline = f"[rank {self.rank}] its engine process died" + (f": {self.how}" if self.how else "")
        if self.crashed_at is None:
            return [headline]
        return [f"{headline}, {self.crashed_at.where()}", *self.crashed_at.report_lines()]


@dataclass(eq=False)
class DistributedCellError(Exception):
    """A %%distributed cell did not finish cleanly on every rank.

    IPython shows ``_render_traceback_`` instead of a Python traceback; the summary
    (the exception's value) is deterministic so nbval can compare it.
    """

    failures: list[RankFailure] = field(default_factory=list)
    blocked: list[BlockedRank] = field(default_factory=list)
    finished: list[int] = field(default_factory=list)
    dead: list[int] = field(default_factory=list)
    deaths: list[RankDeath] = field(default_factory=list)  # of the dead ranks, as far as known
    timeout: float | None = None
    interrupted: bool = False
    usable: bool = True
    mismatches: list[str] = field(default_factory=list)  # from the cell's trace, in plain words
    # Ranks that waited in communication after another rank ended the cell, released with their
    # state (the process groups cut and formed anew), and what the user should know of it.
    released: list[BlockedRank] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        super().__init__(self.summary())

    def summary(self) -> str:
        parts = []
        if self.interrupted and not any(failure.ename in _STOPPED_ON_A_RANK for failure in self.failures):
            parts.append("the cell was stopped")  # no rank says so itself
        by_error: dict[tuple[str, str], list[int]] = {}
        for failure in self.failures:
            by_error.setdefault((failure.ename, failure.evalue), []).append(failure.rank)
        for (ename, evalue), ranks in by_error.items():
            if ename == "KeyboardInterrupt":
                verb = "was interrupted" if len(ranks) == 1 else "were interrupted"
            else:
                verb = f"raised {ename}"
            parts.append(f"{rank_label(ranks)} {verb}" + (f": {evalue}" if evalue else ""))
        if self.dead:
            parts.append(f"{rank_label(self.dead)} died")
        if self.released:
            parts.append(_released_summary(self.released))
        if self.blocked:
            still = "did not stop" if self.interrupted else "still running"
            after = f" after {self.timeout:g} s" if self.timeout is not None else ""
            places = ", ".join(
                f"{rank_label(ranks)} {where}" for where, ranks in _by_place(self.blocked).items()
            )
            parts.append(f"{rank_label([b.rank for b in self.blocked])} {still}{after} ({places})")
        return "; ".join(parts)

    def _render_traceback_(self) -> list[str]:
        lines = [f"{type(self).__name__}: {self.summary()}"]
        # Ranks that failed the same way (an interrupt, the same bad line) share one traceback.
        same_failure: dict[tuple[str, str, str], list[int]] = {}
        for failure in self.failures:
            key = (failure.ename, failure.evalue, failure.traceback)
            same_failure.setdefault(key, []).append(failure.rank)
        for (ename, evalue, traceback_text), ranks in same_failure.items():
            traceback = _without_rule(traceback_text.rstrip().splitlines())
            label = f"[{rank_label(ranks)}]"
            lines.append(label if traceback else f"{label} {ename}: {evalue}")
            lines.extend("    " + line for line in traceback)
        known = {death.rank: death for death in self.deaths}
        for rank in self.dead:
            lines.extend(known.get(rank, RankDeath(rank)).lines())
        # Ranks stuck at the same place with the same stack share one report (32 ranks in one barrier).
        same_place: dict[tuple[str, tuple[str, ...]], list[int]] = {}
        for blocked in self.blocked:
            same_place.setdefault((blocked.where(), tuple(blocked.report_lines())), []).append(blocked.rank)
        for (where, report), ranks in same_place.items():
            lines.append(f"[{rank_label(ranks)}] still running, {where}")
            lines.extend(report)
        for where, ranks in _by_place(self.released).items():
            lines.append(
                f"[{rank_label(ranks)}] released: {'it was' if len(ranks) == 1 else 'they were'} waiting "
                f"{where}, which no rank will join now; the process groups were cut and formed anew, "
                "and every rank kept its variables."
            )
        if self.finished:
            lines.append(f"[{rank_label(self.finished)}] finished")
        lines.extend(f"Mismatch: {message}" for message in self.mismatches)
        lines.extend(self.notes)
        if not self.usable:
            lines.append(RESTART_ADVICE)
        return lines


# What a rank answers when the stop button ended its part of the cell.
_STOPPED_ON_A_RANK = ("KeyboardInterrupt", DEBUGGER_QUIT)


def _by_place(ranks: list[BlockedRank]) -> dict[str, list[int]]:
    places: dict[str, list[int]] = {}
    for blocked in ranks:
        places.setdefault(blocked.where(), []).append(blocked.rank)
    return places


def _released_summary(released: list[BlockedRank]) -> str:
    """``ranks 0,1,3 were waiting in all_reduce at cell line 4 and were released (...)``."""
    places = _by_place(released)
    label = rank_label([blocked.rank for blocked in released])
    were = "was" if len(released) == 1 else "were"
    if len(places) == 1:
        waiting = f"waiting {next(iter(places))}"
    else:
        waiting = (
            "waiting (" + ", ".join(f"{rank_label(ranks)} {where}" for where, ranks in places.items()) + ")"
        )
    return f"{label} {were} {waiting} and {were} released (state kept, new process group)"


_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def _without_rule(lines: list[str]) -> list[str]:
    """Drop the ``-----`` line IPython puts above a traceback."""
    if lines and set(_ANSI.sub("", lines[0]).strip()) == {"-"}:
        return lines[1:]
    return lines
