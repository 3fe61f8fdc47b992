"""One ``%%distributed`` cell, from sending it to its outcome.

:class:`CellRun` sends the cell, then :meth:`CellRun.steps` waits for the ranks: it owns the
timeout, the grace after a rank raised, the stop button, the ranks' ``breakpoint()`` prompts and
the inspection of ranks still running. It is a generator of plain records: a :class:`Tick` now
and then (the outputs so far), a :class:`Prompt` when a rank stops in pdb (the line typed is sent
back in), and its return value, one :class:`CellOutcome`. Nothing here calls back up: time at a
prompt is the time between yielding it and being resumed, and does not count towards the timeout
or the error grace. The stop button, wherever it is pressed, reaches the generator (thrown in at
its ``yield`` if pressed while the caller holds a record).
"""

from __future__ import annotations

import time
from collections.abc import Generator
from dataclasses import dataclass, field

from ddp_magics.cluster.rank_cluster import RankCluster
from ddp_magics.cluster.records import ClusterError, RankFailure, RankOutput, Recovery
from ddp_magics.diagrams import Trace
from ddp_magics.errors import RankDeath
from ddp_magics.profile import Profile
from ddp_magics.protocol import PROFILE_KEY, SKIP_BREAKPOINTS, TRACE_KEY
from ddp_magics.stacks import BlockedRank

POLL_SECONDS = 0.1
LIVE_REFRESH_SECONDS = 0.5
# A rank's last output can arrive after its reply.
OUTPUT_ARRIVAL_SECONDS = 5.0
# A finished rank's trace is sent as its cell ends; its reply can overtake it by milliseconds.
TRACE_ARRIVAL_SECONDS = 2.0
# As a rank first stops in pdb, how long the others get to say where they are.
PROMPT_INSPECT_SECONDS = 1.0
# Why the wait for the ranks ended.
DONE, TIMEOUT, AFTER_ERROR, INTERRUPTED = "done", "timeout", "error", "interrupt"


@dataclass(frozen=True)
class Waits:
    """How long a cell may run, and the graces after a rank raised or after the stop button."""

    timeout: float
    error_grace: float
    interrupt_grace: float
    live_view_after: float  # no ticks before this


@dataclass(frozen=True)
class Tick:
    """The cell is running: what the ranks have shown so far."""

    outputs: list[RankOutput]
    pending: list[int]
    elapsed: float


@dataclass(frozen=True)
class Prompt:
    """A rank waits at its pdb prompt. Send back the line typed, or None where no input can be
    read (the rank then skips this cell's breakpoints)."""

    rank: int
    output: str  # what pdb printed before its prompt
    console: bool  # pdb's ``interact``: a Python prompt
    can_answer: bool  # False once the front end gave no input, or if it takes none
    others: dict[str, list[int]] = field(default_factory=dict)  # at a rank's first prompt: place -> ranks


@dataclass(frozen=True)
class CellOutcome:
    """How the cell ended on every rank it ran on."""

    ranks: list[int]
    ended: str  # DONE, TIMEOUT, AFTER_ERROR or INTERRUPTED
    timeout: float  # the cell's timeout
    outputs: list[RankOutput]
    failures: list[RankFailure]  # ranks that raised (not those that died)
    dead: list[int]  # ranks whose engine process ended
    deaths: list[RankDeath]
    blocked: list[BlockedRank]  # ranks still running, and where
    trace: Trace | None  # when traced
    profile: Profile | None = None  # when profiled
    # A rank raised, exited or quit its debugger, or the stop button was pressed: the cell is over.
    ended_on_a_rank: bool = False
    # Then ranks still waiting in communication are released: the process groups are cut and
    # formed anew (a recovery, every rank's state kept).
    released: list[BlockedRank] = field(default_factory=list)
    recovery: Recovery | None = None
    release_problem: str | None = None  # why releasing them failed

    @property
    def clean(self) -> bool:
        """Every rank finished by itself: nothing raised, died, waits, or was released, and the
        stop button was not pressed (a stopped cell is an error, so a front end's queue stops)."""
        return not (self.failures or self.dead or self.blocked or self.released or self.ended == INTERRUPTED)

    @property
    def finished(self) -> list[int]:
        ended_badly = {failure.rank for failure in self.failures} | set(self.dead)
        ended_badly |= {blocked.rank for blocked in [*self.blocked, *self.released]}
        return [rank for rank in self.ranks if rank not in ended_badly]


class CellRun:
    """One cell sent to ``ranks``; see the module's docstring."""

    def __init__(
        self,
        cluster: RankCluster,
        cell: str,
        ranks: list[int],
        cell_number: int,
        waits: Waits,
        trace_values_limit: int | None = None,
        input_allowed: bool = True,
        profiled: bool = False,
    ) -> None:
        """Send the cell (see :meth:`RankCluster.run_cell` for tracing, profiling and their
        errors). A profiled cell is traced too (without values unless ``trace_values_limit``):
        its communication is named as the trace names it."""
        self.cluster = cluster
        self.cell = cell
        self.ranks = ranks
        self.waits = waits
        self.profiled = profiled
        if profiled and trace_values_limit is None:
            trace_values_limit = 0
        self.traced = trace_values_limit is not None
        self._offsets = cluster.clock_offsets(ranks) if profiled else {}
        self._no_input = not input_allowed
        self._quitting: set[int] = set()  # ranks sent q by the stop button at their prompt
        cluster.run_cell(cell, ranks, cell_number, trace_values_limit, profiled)

    def steps(self) -> Generator[Tick | Prompt, str | None, CellOutcome]:
        ended = yield from self._wait()
        return self._outcome(ended)

    def _wait(self) -> Generator[Tick | Prompt, str | None, str]:
        cluster, waits = self.cluster, self.waits
        started = time.monotonic()
        failed_since = None
        last_tick = 0.0
        try:
            while not cluster.wait_for_cell(POLL_SECONDS):
                prompt = cluster.next_debugger_prompt()
                if prompt is not None:
                    paused = time.monotonic()
                    yield from self._serve(*prompt)
                    paused = time.monotonic() - paused
                    started += paused
                    failed_since = None if failed_since is None else failed_since + paused
                    continue
                now = time.monotonic()
                if failed_since is None and cluster.cell_failed():
                    failed_since = now
                if failed_since is not None and (
                    now - failed_since > waits.error_grace or cluster.cell_quit_debugging()
                ):
                    return AFTER_ERROR  # after the grace; at once if a rank quit its debugger
                if now - started > waits.timeout:
                    return TIMEOUT
                if now - started > waits.live_view_after and now - last_tick > LIVE_REFRESH_SECONDS:
                    so_far = cluster.cell_answers()
                    yield Tick(so_far.outputs, so_far.pending, now - started)
                    last_tick = now
            return DONE
        except KeyboardInterrupt:
            # A rank whose pdb was just quit ends by itself: an interrupt would cut its error short.
            pending = [rank for rank in cluster.busy_ranks() if rank not in self._quitting]
            if pending:
                cluster.interrupt(pending)
            cluster.wait_for_cell(waits.interrupt_grace)
            return INTERRUPTED

    def _serve(self, rank: int, prompt) -> Generator[Prompt, str | None, None]:
        """Hand the line typed for ``rank``'s prompt to its pdb; ranks stopped together are
        served in rank order. Without input its breakpoints are skipped for this cell."""
        others = {} if self._no_input or prompt.number != 1 else self._where_the_others_are(rank)
        try:
            line = yield Prompt(rank, prompt.output, prompt.console, not self._no_input, others)
        except KeyboardInterrupt:  # the stop button at the prompt: end debugging and the cell
            self.cluster.debugger_input(rank, "q")
            self._quitting.add(rank)
            raise
        if line is None:
            self._no_input = True
            line = SKIP_BREAKPOINTS
        self.cluster.debugger_input(rank, line)

    def _where_the_others_are(self, stopped: int) -> dict[str, list[int]]:
        """As a rank first stops in pdb: where the ranks still running are, by place."""
        others = [rank for rank in self.cluster.busy_ranks() if rank != stopped]
        prompt_wait = {"wait": PROMPT_INSPECT_SECONDS, "patience": PROMPT_INSPECT_SECONDS}
        dumps = self.cluster.inspect(others, **prompt_wait) if others else {}
        places: dict[str, list[int]] = {}
        for rank in others:
            blocked = BlockedRank.from_dump(rank, dumps[rank].stack if rank in dumps else None, self.cell)
            places.setdefault(blocked.where(), []).append(rank)
        return places

    def _outcome(self, ended: str) -> CellOutcome:
        cluster = self.cluster
        final = cluster.cell_answers(output_wait=OUTPUT_ARRIVAL_SECONDS)
        pending, failures = final.pending, final.failures
        # A rank that died mid-cell answers with an EngineError; it is reported as dead, not as raising.
        dead = [rank for rank in cluster.dead_ranks() if rank in self.ranks] if pending or failures else []
        alive_pending = [rank for rank in pending if rank not in dead]
        inspections = cluster.inspect(alive_pending) if alive_pending else {}
        trace = self._trace(pending, dead, inspections) if self.traced else None
        blocked = [
            BlockedRank.from_dump(
                rank,
                inspections[rank].stack if rank in inspections else None,
                self.cell,
                traced_call=_traced_call(trace, rank),
            )
            for rank in alive_pending
        ]
        ended_on_a_rank = bool(failures) or ended == INTERRUPTED
        released, recovery, release_problem = [], None, None
        if blocked and ended_on_a_rank and not dead and all(rank.in_communication for rank in blocked):
            try:
                recovery = cluster.recover(self.waits.interrupt_grace)
                released, blocked = blocked, []
            except ClusterError as error:
                release_problem = str(error)
        return CellOutcome(
            ranks=self.ranks,
            ended=ended,
            timeout=self.waits.timeout,
            outputs=final.outputs,
            failures=[failure for rank, failure in failures.items() if rank not in dead],
            dead=dead,
            deaths=[self._death(rank) for rank in dead],
            blocked=blocked,
            trace=trace,
            profile=self._profile(pending, dead, trace) if self.profiled else None,
            ended_on_a_rank=ended_on_a_rank,
            released=released,
            recovery=recovery,
            release_problem=release_problem,
        )

    def _death(self, rank: int) -> RankDeath:
        how, crash_dump = self.cluster.death_record(rank)
        crashed_at = BlockedRank.from_dump(rank, crash_dump, self.cell) if crash_dump else None
        return RankDeath(rank, how, crashed_at)

    def _trace(self, pending: list[int], dead: list[int], inspections: dict) -> Trace:
        """The cell's trace: what finished ranks published as the cell ended, and what ranks
        still running had recorded when inspected."""
        events = {}
        for rank in self.ranks:
            if rank in inspections:
                events[rank] = inspections[rank].events or []
            elif rank in pending or rank in dead:
                events[rank] = []
            else:
                events[rank] = self.cluster.published(rank, TRACE_KEY, wait=TRACE_ARRIVAL_SECONDS) or []
        return Trace(events, complete=not (pending or dead), lost=frozenset(dead))

    def _profile(self, pending: list[int], dead: list[int], trace: Trace | None) -> Profile:
        """What the ranks that ended the cell (finished or raised) recorded; ranks still running
        or dead have none."""
        profiles, missing = {}, []
        for rank in self.ranks:
            answer = None
            if rank not in pending and rank not in dead:
                answer = self.cluster.published(rank, PROFILE_KEY, wait=TRACE_ARRIVAL_SECONDS)
            if answer is None:
                missing.append(rank)
            else:
                profiles[rank] = answer
        return Profile(profiles, self._offsets, trace.events if trace else None, missing)


def _traced_call(trace: Trace | None, rank: int) -> str | None:
    """``recv from rank 1`` for a rank blocked in a traced call."""
    event = trace.in_progress(rank) if trace else None
    return event.call() if event else None
