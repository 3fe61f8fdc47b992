"""What the magics tell the user in words: the start summary, the recovery report, and a cell's
failure (:class:`~ddp_magics.errors.DistributedCellError`) built from its outcome."""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field

from IPython.core.error import UsageError

from ddp_magics.cell_run import INTERRUPTED, TIMEOUT, CellOutcome
from ddp_magics.cluster.rank_cluster import RankCluster
from ddp_magics.cluster.records import RankFailure, Recovery
from ddp_magics.cluster.strays import stop_stray_clusters
from ddp_magics.errors import BROKEN_ADVICE, RESTART_ADVICE, DistributedCellError, usage_error
from ddp_magics.protocol import DEBUGGER_QUIT, rank_label


@dataclass(frozen=True)
class LastOutcome:
    """What the magics keep of earlier cells, as ipyparallel keeps ``last_result``: the ranks that
    raised in the last cell that failed (``%dist_debug``'s default), and what the last recovery
    left: per rank, names holding a destroyed group, and the ends of the connections it cut."""

    raised: tuple[int, ...] = ()
    stale: dict[int, tuple[tuple[str, str], ...]] = field(default_factory=dict)
    cut_peers: frozenset[str] = frozenset()

    def after_recovery(self, done: Recovery) -> LastOutcome:
        return dataclasses.replace(
            self, stale=done.stale, cut_peers=frozenset().union(*done.cut_peers.values())
        )

    def after_failed_cell(self, outcome: CellOutcome) -> LastOutcome:
        """A failed cell's raising ranks; its release, if the ranks that waited were released."""
        last = dataclasses.replace(self, raised=tuple(sorted(failure.rank for failure in outcome.failures)))
        return last.after_recovery(outcome.recovery) if outcome.recovery is not None else last


def no_cluster_error(restart_failed: bool) -> UsageError:
    if restart_failed:
        return usage_error(
            "No cluster is running: the last %dist_restart failed and stopped it (nothing of it is "
            "left); %dist_restart starts it again as it was"
        )
    return usage_error("No cluster is running: start one with %dist_start")


def dead_ranks_error(ranks: list[int]) -> UsageError:
    return usage_error(f"{rank_label(ranks)} died (engine process gone). {RESTART_ADVICE}")


def busy_error(ranks: list[int]) -> UsageError:
    return usage_error(f"{rank_label(ranks)} still running an earlier cell. {RESTART_ADVICE}")


def broken_error(why: str) -> UsageError:
    return usage_error(f"The ranks are not one process group since {why}. {BROKEN_ADVICE}")


def stray_clusters_stopped() -> None:
    """Stop this user's clusters whose kernel is gone, saying so."""
    for report in stop_stray_clusters():
        print(f"ddp_magics: {report}.")


def already_running(cluster: RankCluster) -> str:
    return (
        f"A cluster of {cluster.n} ranks ({cluster.backend}) is already running; use %dist_restart "
        "for new engines or %dist_stop first."
    )


def start_summary(cluster: RankCluster) -> str:
    devices = [info.device for info in cluster.ranks]
    same = len(set(devices)) == 1
    device_text = f"{devices[0]} x{len(devices)}" if same else ", ".join(devices)
    return (
        f"{cluster.n} ranks ready: backend {cluster.backend}, world size {cluster.n}, devices {device_text}"
    )


def recovery_report(recovery: Recovery, backend: str) -> str:
    """What %dist_recover did and what the user must redo, in a few lines."""
    lines = [
        f"Recovered: a new {backend} process group of "
        f"{recovery.world_size} ranks; every living rank kept its variables."
    ]
    if recovery.interrupted:
        lines.append(f"{rank_label(recovery.interrupted)}: still running after the cut, so interrupted.")
    if recovery.replaced:
        label = rank_label(recovery.replaced)
        lines.append(
            f"{label} died and {'was' if len(recovery.replaced) == 1 else 'were'} replaced by a new "
            f"engine with nothing defined: run your set-up cells again on it "
            f"(%%distributed --ranks {','.join(map(str, recovery.replaced))}), then copy the state from "
            "a healthy rank, e.g. `for t in model.state_dict().values(): dist.broadcast(t, src=0)`."
        )
    if recovery.dropped:
        moved = ", ".join(f"{old} is now {new}" for old, new in recovery.renumbered.items())
        lines.append(
            f"Went on without {rank_label(recovery.dropped)}"
            + (f"; rank {moved}" if moved else "")
            + ": `rank` and `world_size` are updated on every rank."
        )
    return "\n".join([*lines, *stale_lines(recovery.stale)])


def stale_lines(stale: dict[int, tuple[tuple[str, str], ...]]) -> list[str]:
    """Per set of names, the ranks where they hold a process group a recovery destroyed."""
    by_names: dict[tuple[tuple[str, str], ...], list[int]] = {}
    for rank, names in stale.items():
        by_names.setdefault(names, []).append(rank)
    lines = []
    for names, ranks in by_names.items():
        listed = ", ".join(f"{name} ({kind})" for name, kind in names)
        verb, them = ("holds", "it") if len(names) == 1 else ("hold", "them")
        lines.append(
            f"Stale on {rank_label(ranks)}: {listed} {verb} the old process group; make {them} again "
            f"(dist.new_group, DDP(...), ...) before using {them}."
        )
    return lines


def no_calls_message(outcome: CellOutcome) -> str:
    """Why ``--diagram`` has nothing to draw."""
    if outcome.failures or outcome.dead:
        return "--diagram: nothing to draw: the cell raised before any torch.distributed call"
    return "--diagram: the cell made no torch.distributed calls"


def cell_error(outcome: CellOutcome, last: LastOutcome) -> DistributedCellError:
    """The failure of a cell that did not end cleanly on every rank; ``last`` says what the last
    recovery left (names holding old groups, the connections it cut)."""
    return DistributedCellError(
        failures=[
            _shown(failure, last.stale.get(failure.rank, ()), last.cut_peers) for failure in outcome.failures
        ],
        blocked=outcome.blocked,
        finished=outcome.finished,
        dead=outcome.dead,
        deaths=outcome.deaths,
        timeout=outcome.timeout if outcome.ended == TIMEOUT else None,
        interrupted=outcome.ended == INTERRUPTED,
        usable=not (outcome.blocked or outcome.dead),
        mismatches=[mismatch.message for mismatch in outcome.trace.mismatches] if outcome.trace else [],
        released=outcome.released,
        notes=_release_notes(outcome),
    )


def _release_notes(outcome: CellOutcome) -> list[str]:
    """What the user should know of releasing the ranks that waited (or of not releasing them)."""
    if outcome.recovery is not None:
        return stale_lines(outcome.recovery.stale)
    if outcome.release_problem:
        return [
            f"The ranks still waiting could not be released: {outcome.release_problem}. "
            "The ranks are left without a process group: " + BROKEN_ADVICE
        ]
    computing = [blocked.rank for blocked in outcome.blocked if not blocked.in_communication]
    waiting = [blocked.rank for blocked in outcome.blocked if blocked.in_communication]
    if not (outcome.ended_on_a_rank and computing) or outcome.dead or outcome.ended == INTERRUPTED:
        return []
    one = len(computing) == 1
    also = (
        f"; {rank_label(waiting)}, waiting in communication, {'is' if len(waiting) == 1 else 'are'} left "
        "as well (a new process group needs every rank)"
        if waiting
        else ""
    )
    return [
        f"{rank_label(computing)} {'is' if one else 'are'} running Python, not waiting in communication, "
        f"so {'it was' if one else 'they were'} not interrupted (a slow step may still finish){also}. "
        f"The stop button interrupts {'it' if one else 'them'}; %dist_recover gets every rank back with "
        "its state."
    ]


# torch 2.13 (distributed_c10d.get_backend, which collectives call) for a group destroyed by
# %dist_recover: "Process group <...ProcessGroup object at 0x...> is not initialized in the
# world group map. Please initialize the group first."
_DESTROYED_GROUP = re.compile(r"Process group <.*?> is not initialized in the world group map")
# gloo (pair.cc), when C++ that holds an old group (DDP's reducer) uses a connection recovery cut.
_CLOSED_CONNECTION = re.compile(r"Connection closed by peer (\[[^\]]*\]:\d+)")


def _shown(
    failure: RankFailure, stale: tuple[tuple[str, str], ...], cut_peers: frozenset[str]
) -> RankFailure:
    """A failure as the report shows it: ``q`` at a prompt without a traceback (the user ended
    the cell there), a use of a process group that %dist_recover destroyed as one line naming
    what holds old groups on that rank, any other failure unchanged."""
    if failure.ename == DEBUGGER_QUIT:
        return RankFailure(rank=failure.rank, ename=failure.ename, evalue=failure.evalue, traceback="")
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
