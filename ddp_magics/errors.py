"""The error vocabulary: one-line usage errors, per-rank failures, hang and interrupt reports."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from IPython.core.error import UsageError

from ddp_magics.protocol import rank_label
from ddp_magics.stacks import BlockedRank

RESTART_ADVICE = (
    "Run %dist_recover to get every rank back with its state (a new process group), "
    "or %dist_restart for new engines."
)


def usage_error(message: str) -> UsageError:
    """A user mistake: IPython shows it as one line, without a traceback."""
    return UsageError(message)




# ------------------------------------------------------------------ cell failures
@dataclass(frozen=True)
class RankFailure:
    rank: int
    ename: str
    evalue: str
    traceback: str


@dataclass(frozen=True)
class DeadRank:
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
    deaths: list[DeadRank] = field(default_factory=list)  # of the dead ranks, as far as known
    timeout: float | None = None
    interrupted: bool = False
    usable: bool = True
    mismatches: list[str] = field(default_factory=list)  # from the cell's trace, in plain words

    def __post_init__(self) -> None:
        super().__init__(self.summary())

    def summary(self) -> str:
        parts = []
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
        if self.blocked:
            still = "did not stop" if self.interrupted else "still running"
            after = f" after {self.timeout:g} s" if self.timeout is not None else ""
            by_place: dict[str, list[int]] = {}
            for blocked in self.blocked:
                by_place.setdefault(blocked.where(), []).append(blocked.rank)
            places = ", ".join(f"{rank_label(ranks)} {where}" for where, ranks in by_place.items())
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
            lines.extend(known.get(rank, DeadRank(rank)).lines())
        # Ranks stuck at the same place with the same stack share one report (32 ranks in one barrier).
        same_place: dict[tuple[str, tuple[str, ...]], list[int]] = {}
        for blocked in self.blocked:
            same_place.setdefault((blocked.where(), tuple(blocked.report_lines())), []).append(blocked.rank)
        for (where, report), ranks in same_place.items():
            lines.append(f"[{rank_label(ranks)}] still running, {where}")
            lines.extend(report)
        if self.finished:
            lines.append(f"[{rank_label(self.finished)}] finished")
        lines.extend(f"Mismatch: {message}" for message in self.mismatches)
        if not self.usable:
            lines.append(RESTART_ADVICE)
        return lines


_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def _without_rule(lines: list[str]) -> list[str]:
    """Drop the ``-----`` line IPython puts above a traceback."""
    if lines and set(_ANSI.sub("", lines[0]).strip()) == {"-"}:
        return lines[1:]
    return lines


# torch 2.13 (distributed_c10d.get_backend, which collectives call) for a group destroyed by
# %dist_recover: "Process group <...ProcessGroup object at 0x...> is not initialized in the
# world group map. Please initialize the group first."
_DESTROYED_GROUP = re.compile(r"Process group <.*?> is not initialized in the world group map")
# gloo (pair.cc), when C++ that holds an old group (DDP's reducer) uses a connection recovery cut.
_CLOSED_CONNECTION = re.compile(r"Connection closed by peer (\[[^\]]*\]:\d+)")


def stale_group_failure(
    failure: RankFailure, stale: tuple[tuple[str, str], ...], cut_peers: frozenset[str]
) -> RankFailure:
    """A rank's use of a process group that %dist_recover destroyed, as one line naming what
    holds old groups on that rank; any other failure unchanged."""
    closed = _CLOSED_CONNECTION.search(failure.evalue)
    if not (_DESTROYED_GROUP.search(failure.evalue) or (closed and closed[1] in cut_peers)):
        return failure
    names = ", ".join(name for name, _ in stale)
    return RankFailure(
        rank=failure.rank,
        ename="StaleProcessGroup",
        evalue="this uses a process group from before %dist_recover"
        + (f" (stale here: {names})" if names else "")
        + "; make it again (dist.new_group, DDP(...), ...)",
        traceback="",
    )


def failure_from_remote_error(rank: int, error: BaseException) -> RankFailure:
    """An ipyparallel RemoteError (or any exception) as plain per-rank data."""
    ename = getattr(error, "ename", type(error).__name__)
    evalue = getattr(error, "evalue", str(error))
    traceback = getattr(error, "traceback", "") or ""
    if ename == "DebuggerQuit":  # q at a breakpoint()'s prompt: the user ended the cell there
        return RankFailure(rank=rank, ename=ename, evalue=evalue, traceback="")
    return RankFailure(rank=rank, ename=ename, evalue=evalue, traceback=traceback)
