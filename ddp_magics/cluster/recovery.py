"""Getting every rank back to a working default process group, keeping what each living rank has
defined: the old groups' connections are cut (which ends a blocked collective), ranks still
running are interrupted, dead ranks replaced (or left out), and a new group forms."""

from __future__ import annotations

import dataclasses
import os
import time
from typing import Protocol

from ddp_magics import protocol
from ddp_magics.cluster import process_group
from ddp_magics.cluster.engines import SIGNAL_SECONDS, CellAnswers, Engines
from ddp_magics.cluster.records import (
    RECOVER_AGAIN,
    RESTART,
    ClusterConfig,
    ClusterError,
    GroupBroken,
    Progress,
    RankInfo,
    Recovery,
)
from ddp_magics.engine import rank as rank_code
from ddp_magics.stack_dumps import Frame, cell_frames, formatting_an_error, in_a_collective, parse_stack_dump


class Recoverable(Protocol):
    """What a recovery needs of the cluster (:class:`~ddp_magics.cluster.rank_cluster.RankCluster`)."""

    n: int
    backend: str | None
    broken: str | None  # set here: why the ranks are not one group, from the cut until re-formed
    config: ClusterConfig
    engines: Engines

    @property
    def ranks(self) -> list[RankInfo]: ...

    @property
    def all_engines_here(self) -> bool: ...

    def dead_ranks(self) -> list[int]: ...

    def signal(self, signum: int, ranks: list[int], **timeout) -> list[int]: ...

    def interrupt(self, ranks: list[int]) -> list[int]: ...

    def inspect(self, ranks: list[int], wait: float = ...) -> dict[int, protocol.Inspection]: ...

    def replace_engines(self, dead: list[int]) -> None: ...


# After their connections are cut, ranks blocked in a collective end within milliseconds each
# (their error is not formatted: see engine.recovery), one after another on a loaded machine; once
# none has ended for this long, a rank still running is running Python (or C code) of its own.
CUT_WAIT_SECONDS = 1.0
# How long, at least, ranks that show they are ending (unwinding, showing an error) or that give no
# sign (a stack dump that does not come on a loaded machine) are waited for; a second more for each
# rank per core of this machine, which all of them share.
ENDING_LIMIT_SECONDS = 30.0
ENDING_SECONDS_PER_RANK_PER_CORE = 1.0
# A rank interrupted, still in the cell's code after the interrupt grace, is looked at again after
# this long: in the same place, it is not stopping (a busy rank merely waiting for a core moves on).
PROGRESS_CHECK_SECONDS = 1.0


def recover(
    cluster: Recoverable,
    unfinished: CellAnswers | None,
    shrink: bool,
    interrupt_grace: float,
    progress: Progress,
) -> Recovery:
    """See :meth:`RankCluster.recover`. From the cut on, the cluster is marked broken until the
    new group has formed: a recovery that fails part way leaves no half-formed group in use."""
    dead = cluster.dead_ranks()
    alive = [rank for rank in range(cluster.n) if rank not in dead]
    if not alive:
        raise ClusterError("every rank is dead")
    cluster.broken = "a recovery stopped part way"
    try:
        done = _cut_and_reform(cluster, unfinished, shrink, interrupt_grace, progress, dead, alive)
    except ClusterError as error:
        cluster.broken = f"a recovery failed: {error}"
        raise GroupBroken(str(error), *error.ways_out, RESTART, RECOVER_AGAIN) from None
    cluster.broken = None
    return done


def _cut_and_reform(
    cluster: Recoverable,
    unfinished: CellAnswers | None,
    shrink: bool,
    interrupt_grace: float,
    progress: Progress,
    dead: list[int],
    alive: list[int],
) -> Recovery:
    progress("cutting the process groups' connections")
    # Just after a network outage, TCP resends only when its back-off timer fires (up to as
    # long as the outage was): ranks on other hosts get as long as a link may be lost.
    answer_seconds = SIGNAL_SECONDS if cluster.all_engines_here else cluster.config.link_loss_tolerance
    unreachable = cluster.signal(protocol.CUT_CONNECTIONS_SIGNAL, alive, timeout=answer_seconds)
    if unreachable:
        hosts = sorted({cluster.ranks[rank].host for rank in unreachable})
        raise ClusterError(
            f"{protocol.rank_label(unreachable)} on {', '.join(hosts)} did not answer within "
            f"{answer_seconds:g} s (host unreachable?); try again once the network is back"
        )
    interrupted = []
    if unfinished is not None:
        interrupted = _stop_the_cell(cluster, unfinished, alive, answer_seconds, interrupt_grace, progress)
    renumbered: dict[int, int] = {}
    if dead and shrink:
        renumbered = {old: new for new, old in enumerate(alive)}
        cluster.engines.set_ranks(
            [dataclasses.replace(cluster.ranks[old], rank=new) for old, new in renumbered.items()]
        )
        renumbered = {old: new for old, new in renumbered.items() if old != new}
    elif dead:
        progress(f"starting {len(dead)} engines for {protocol.rank_label(dead)}")
        cluster.replace_engines(dead)
    progress(f"re-forming the {cluster.backend} process group")
    new = set() if shrink else set(dead)
    answers = process_group.join(
        cluster.engines,
        cluster.backend,
        cluster.config.process_group_timeout,
        lambda info: rank_code.setup_rank if info.rank in new else rank_code.rejoin_process_group,
    )
    rejoined = {rank: answer for rank, answer in answers.items() if isinstance(answer, protocol.Rejoined)}
    return Recovery(
        world_size=len(cluster.ranks),
        replaced=[] if shrink else dead,
        dropped=dead if shrink else [],
        renumbered=renumbered,
        interrupted=interrupted,
        stale={rank: answer.stale for rank, answer in rejoined.items() if answer.stale},
        cut_peers={rank: answer.cut_peers for rank, answer in rejoined.items()},
    )


def _stop_the_cell(
    cluster: Recoverable,
    unfinished: CellAnswers,
    alive: list[int],
    answer_seconds: float,
    interrupt_grace: float,
    progress: Progress,
) -> list[int]:
    """After the cut: the ranks still running the ``unfinished`` cell are cut again (if still in
    a collective) or interrupted (if running the cell's code), then waited for while they show
    they are ending; the ranks interrupted."""
    busy = _pending_once_none_ends(unfinished, alive, CUT_WAIT_SECONDS)
    if not busy:
        return []
    stacks = {rank: parse_stack_dump(dump.stack) for rank, dump in cluster.inspect(busy).items()}
    # faulthandler answers the cut as it answers a stack dump, and drops a signal that comes
    # while it is writing a dump (a stack-dump request held up by a network outage reaches a
    # rank together with the cut): a rank its dump shows still in a collective gets the cut
    # again, now that its dump is written.
    blocked = [rank for rank in busy if rank in stacks and in_a_collective(stacks[rank])]
    if blocked:
        cluster.signal(protocol.CUT_CONNECTIONS_SIGNAL, blocked, timeout=answer_seconds)
        still = _pending_once_none_ends(unfinished, blocked, CUT_WAIT_SECONDS)
        busy = [rank for rank in busy if rank not in blocked or rank in still]
    # A rank whose collective the cut ended may be unwinding or showing its error (slow on a
    # loaded machine): its stack says so, and it is left to finish.
    interrupted = [rank for rank in busy if rank not in stacks or not _ending(stacks[rank])]
    if interrupted:
        progress(f"interrupting {protocol.rank_label(interrupted)}")
        cluster.interrupt(interrupted)
    started = time.monotonic()
    stuck = _wait_while_ending(cluster, unfinished, busy, interrupt_grace)
    if stuck:
        _wait_for_far_answers(cluster, unfinished, stuck, time.monotonic() - started, progress)
    return interrupted


def _pending_once_none_ends(run: CellAnswers, ranks: list[int], quiet: float) -> list[int]:
    """Those of ``ranks`` still running ``run`` once none of them has ended for ``quiet``
    seconds (at once if all have)."""
    busy = run.pending_among(ranks, 0.0)
    while busy:
        still = run.pending_among(busy, quiet)
        if len(still) == len(busy):
            return still
        busy = still
    return busy


def _ending(threads: list[list[Frame]]) -> bool:
    """Whether a rank's stack shows its cell ending: out of the cell's code (unwinding, or
    answering), or showing the cell's error."""
    return not cell_frames(threads) or formatting_an_error(threads)


def _wait_while_ending(
    cluster: Recoverable, run: CellAnswers, ranks: list[int], interrupt_grace: float
) -> list[int]:
    """Those of ``ranks`` still running ``run`` once none of them shows progress: each gets
    ``interrupt_grace``, then more while its stack dumps show it ending, or in another place of
    the cell's code than the last dump, or do not come (a loaded machine), up to a limit that
    grows with the ranks per core. A rank twice in the same place of the cell's code after an
    interrupt is not stopping."""
    per_core = len(cluster.ranks) / (os.cpu_count() or 1) if cluster.all_engines_here else 1.0
    deadline = time.monotonic() + ENDING_LIMIT_SECONDS + ENDING_SECONDS_PER_RANK_PER_CORE * per_core
    stuck = run.pending_among(ranks, interrupt_grace)
    last: dict[int, list[Frame]] = {}
    while stuck and time.monotonic() < deadline:
        stacks = {rank: parse_stack_dump(dump.stack) for rank, dump in cluster.inspect(stuck).items()}
        moving = [
            rank
            for rank in stuck
            if rank not in stacks or _ending(stacks[rank]) or cell_frames(stacks[rank]) != last.get(rank)
        ]
        if not moving:
            break
        last = {rank: cell_frames(threads) for rank, threads in stacks.items()}
        stuck = run.pending_among(stuck, PROGRESS_CHECK_SECONDS)
    return stuck


def _wait_for_far_answers(
    cluster: Recoverable, run: CellAnswers, stuck: list[int], waited: float, progress: Progress
) -> None:
    """Ranks still running ``run`` ``waited`` seconds after an interrupt: a ClusterError at
    once if every engine is on this machine. Ranks on other hosts may have stopped while their
    answer waits for a connection to come back after a network outage (TCP resends only after a
    back-off, up to as long as the outage): they get up to ``link_loss_tolerance``. (Their stacks
    cannot tell: a stack dump asked for during the outage may arrive only now, taken before the
    cut.)"""
    if cluster.all_engines_here:
        raise ClusterError(
            f"{protocol.rank_label(stuck)} did not stop within {waited:.0f} s of an interrupt "
            "(stuck in C code that ignores signals?)"
        )
    link_loss = cluster.config.link_loss_tolerance
    hosts = ", ".join(sorted({cluster.ranks[rank].host for rank in stuck}))
    progress(f"waiting for {protocol.rank_label(stuck)} on {hosts} to answer (a link coming back?)")
    silent = run.pending_among(stuck, link_loss)
    if silent:
        raise ClusterError(
            f"{protocol.rank_label(silent)} on {hosts} did not stop within "
            f"{waited + link_loss:.0f} s of an interrupt (stuck in C code that ignores signals, or "
            "still cut off?); try again once the network is back"
        )
