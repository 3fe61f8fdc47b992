"""One ipyparallel cluster whose engines are the ranks of a torch.distributed process group.

The notebook side reaches the ranks only through :class:`RankCluster`. Nothing here prints or
knows about IPython: progress goes to a callback, answers come back as plain records
(:mod:`ddp_magics.cluster.records`), problems are raised as :class:`ClusterError`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import signal
import time

import psutil

from ddp_magics import protocol
from ddp_magics.cluster import process_group, recovery
from ddp_magics.cluster.engines import (
    INSPECT_PATIENCE_SECONDS,
    INSPECT_SECONDS,
    SIGNAL_SECONDS,
    Answers,
    CellAnswers,
    Engines,
)
from ddp_magics.cluster.lifecycle import ClusterProcesses
from ddp_magics.cluster.parking import Parking
from ddp_magics.cluster.records import (
    ENGINE_TIMEOUT_SECONDS,
    LOCAL_HOST,
    ClusterConfig,
    ClusterError,
    DeadRanks,
    Progress,
    RankInfo,
    RankStatus,
    Recovery,
)
from ddp_magics.cluster.strays import this_host
from ddp_magics.engine import debugging, profiling, recorder
from ddp_magics.lifetime import HEART_MONITOR_PID_FILE, process_alive

DEATH_RECORD_SECONDS = 0.5


def _no_progress(message: str) -> None:
    pass


# What a parked cluster is woken for: every use of the ranks. Not for what reads only this side's
# records and the ranks' PIDs (status, dead_ranks, busy_ranks; memory, unless it asks ranks).
WAKING_METHODS = (
    "restart", "recover", "replace_engines", "run_cell", "wait_for_cell", "cell_answers",
    "cell_failed", "cell_quit_debugging", "next_debugger_prompt", "published", "clock_offsets",
    "push", "pull", "signal", "inspect", "debugger_input", "start_post_mortem",
    "post_mortem_commands", "end_post_mortem", "snapshots",
)


def _waking(cls):
    """Every method in WAKING_METHODS runs with the cluster awake (continued first if parked)."""
    for name in WAKING_METHODS:
        method = getattr(cls, name)

        def awake(self, *args, _method=method, **kwargs):
            with self._awake():
                return _method(self, *args, **kwargs)

        awake.__name__, awake.__doc__, awake.__wrapped__ = name, method.__doc__, method
        setattr(cls, name, awake)
    return cls


@_waking
class RankCluster:
    """Start, run on, inspect, recover and stop a cluster as ``config`` describes it."""

    def __init__(self, config: ClusterConfig) -> None:
        self.config = config
        self.n = config.n
        self.backend: str | None = None  # "auto" resolved once the engines are probed
        self.engines = Engines()
        self._processes = ClusterProcesses(config, self.engines)
        # Why the ranks are not one working process group (a recovery that failed part way, after
        # cutting the old groups): every cell is refused until a recovery or restart succeeds.
        self.broken: str | None = None
        self._cell: CellAnswers | None = None  # what the ranks answered to the last cell sent
        self._cell_answered = True  # every rank of the last cell sent has answered
        self._parking: Parking | None = None  # once started

    @property
    def ranks(self) -> list[RankInfo]:
        return self.engines.ranks

    @property
    def running(self) -> bool:
        return self._processes.running

    @property
    def workdir(self):
        return self._processes.workdir

    @property
    def all_engines_here(self) -> bool:
        return self._processes.all_engines_here

    @property
    def restartable_in_place(self) -> bool:
        return self._processes.restartable_in_place

    # ------------------------------------------------------------------ lifecycle
    def start(self, progress: Progress = _no_progress) -> None:
        if self.running:
            raise ClusterError("this cluster is already running")
        try:
            self._processes.start(progress)
            self._form_process_group(progress)
        except BaseException:
            self.stop()
            raise
        after = self.config.park_after if self.all_engines_here else None
        self._parking = Parking(after, self._parked_pids, lambda: self._cell_answered)

    # --------------------------------------------------------------------- parking
    @property
    def parked(self) -> bool:
        """Whether the ranks are stopped now, the cluster unused (see :mod:`.parking`)."""
        return self._parking is not None and self._parking.parked

    def park(self) -> bool:
        """Park the cluster now if no cell runs (benchmarks, tests); whether it is parked."""
        return self._parking is not None and self._parking.park_now()

    def park_after(self, seconds: float | None) -> None:
        """Park once unused for ``seconds`` from now on (None: never)."""
        if self._parking is not None:
            self._parking.set_after(seconds)

    def _awake(self):
        return self._parking.in_use() if self._parking is not None else contextlib.nullcontext()

    def _parked_pids(self) -> list[int]:
        """The heart monitor first (it must never count a parked rank's silence), then the ranks
        on this machine."""
        pids = []
        with contextlib.suppress(OSError, ValueError, TypeError):
            pids.append(int((self.workdir / HEART_MONITOR_PID_FILE).read_text()))
        here = this_host()
        return pids + [info.pid for info in self.ranks if info.host == here]

    def _form_process_group(self, progress: Progress) -> None:
        self.backend = process_group.form(
            self.engines,
            self.n,
            self.config.hosts,
            self.config.backend,
            self.config.process_group_timeout,
            self._processes.controller_address,
            progress,
            one_host=self._processes.all_engines_here,
        )

    def restart(self, progress: Progress = _no_progress) -> None:
        """New engines forming a new process group (the controller and zygotes stay)."""
        try:
            self._processes.replace_all_engines(self.n, progress)
            self._form_process_group(progress)
        except BaseException:
            self.stop()
            raise
        self.broken = None
        self._cell = None
        self._cell_answered = True

    def recover(
        self, interrupt_grace: float, shrink: bool = False, progress: Progress = _no_progress
    ) -> Recovery:
        """Bring every rank back to a working default process group, keeping what each living
        rank has defined: cut the old groups' connections (which ends a blocked collective),
        interrupt ranks still running the last cell, then re-form the group. A dead rank is
        replaced by a new engine under its number, or, with ``shrink``, left out and the others
        renumbered. A ClusterError if a rank does not stop or no rank lives; once the old groups
        were cut, the cluster is then :attr:`broken`."""
        running = self._cell if self.busy_ranks() else None
        done = recovery.recover(self, running, shrink, interrupt_grace, progress)
        self.n = done.world_size
        return done

    def replace_engines(self, dead: list[int]) -> None:
        """New engines for the ``dead`` ranks, on their hosts, assigned their rank numbers."""
        known = {info.engine_id for info in self.ranks}
        by_address = {host.address: host.location for host in self.config.hosts}
        self._processes.start_engines_on([by_address.get(self.ranks[rank].address) for rank in dead])
        fresh = self.engines.wait_for_new(known, len(dead), ENGINE_TIMEOUT_SECONDS)
        probes = process_group.probe(self.engines, fresh, self._processes.controller_address)
        waiting = {rank: self.ranks[rank] for rank in dead}
        ranks = list(self.ranks)
        for engine_id, probe in zip(fresh, probes):
            rank = next((r for r, info in waiting.items() if info.address == probe.address), None)
            if rank is None:
                raise ClusterError(f"a new engine started on {probe.host}, where no dead rank was")
            info = waiting.pop(rank)
            ranks[rank] = dataclasses.replace(info, engine_id=engine_id, pid=probe.pid, host=probe.host)
        self.engines.set_ranks(ranks)

    def stop(self) -> None:
        """Stop controller and engines and remove the cluster's files. Safe to call twice."""
        if self._parking is not None:
            self._parking.close()  # continued: stopped processes do not end on SIGTERM
            self._parking = None
        self._processes.stop()

    def processes(self) -> list[psutil.Process]:
        """Controller, engines and their helper processes (nannies, schedulers) now running."""
        return self._processes.processes()

    # ---------------------------------------------------------------------- health
    def dead_ranks(self) -> list[int]:
        connected = self.engines.ids
        return [
            info.rank
            for info in self.ranks
            if info.engine_id not in connected or not (info.host != this_host() or process_alive(info.pid))
        ]

    def death_record(self, rank: int, wait: float = DEATH_RECORD_SECONDS) -> tuple[str | None, str | None]:
        """How a dead rank's engine ended and the stack Python wrote as it crashed, as far as this
        machine can tell (see :meth:`ClusterProcesses.death_record`)."""
        return self._processes.death_record(self.ranks[rank].pid, wait)

    def status(self) -> list[RankStatus]:
        dead = set(self.dead_ranks())
        return [RankStatus(info=info, alive=info.rank not in dead) for info in self.ranks]

    def memory(self, busy: list[int]) -> dict[int, protocol.RankMemory | None]:
        """Each live rank's memory. On this machine a CPU rank's memory (resident, unique,
        proportional) is read by its PID (busy or not); ranks on GPUs or on other hosts are
        asked, if idle (``busy`` ranks run a cell), for theirs and their CUDA memory, and so are
        idle CPU ranks on a machine with NVIDIA's driver (a gloo rank may hold CUDA tensors).
        None where it cannot be known."""
        dead = set(self.dead_ranks())
        found: dict[int, protocol.RankMemory | None] = {info.rank: None for info in self.ranks}
        to_ask = []
        cuda_possible = process_group.nvidia_driver_here()
        for info in self.ranks:
            if info.rank in dead:
                continue
            local_cpu = info.address == LOCAL_HOST and info.device == "cpu"
            if local_cpu and (info.rank in busy or not cuda_possible):
                with contextlib.suppress(psutil.Error):
                    full = psutil.Process(info.pid).memory_full_info()  # /proc/PID/smaps
                    pss = getattr(full, "pss", None)
                    found[info.rank] = protocol.RankMemory(full.rss, unique=full.uss, proportional=pss)
            elif info.rank not in busy:
                to_ask.append(info.rank)
        if to_ask:
            with self._awake(), contextlib.suppress(ClusterError):  # an engine busy after all: unknown
                found.update(self.engines.call(to_ask, profiling.memory))
        return found

    # --------------------------------------------------------------------- running
    def run_cell(
        self,
        code: str,
        ranks: list[int],
        cell_number: int,
        trace_values_limit: int | None = None,
        profiled: bool = False,
    ) -> None:
        """Start running ``code`` on ``ranks`` as the notebook's cell ``cell_number`` (traced,
        keeping the values of tensors of up to ``trace_values_limit`` elements, unless that is
        None; under ``torch.profiler`` if ``profiled``); returns at once, and the methods below
        answer for it. DeadRanks if a rank has died, a ClusterError if tracing or profiling
        could not start or the cluster is :attr:`broken`."""
        if self.broken:
            raise ClusterError(f"the ranks are not one process group since {self.broken}")
        dead = self.dead_ranks()
        if dead:
            raise DeadRanks(dead)
        if trace_values_limit is not None:
            self.engines.call_everywhere(
                ranks, recorder.start_trace, trace_values_limit, failing="tracing could not start"
            )
        if profiled:
            self.engines.call_everywhere(ranks, profiling.start_profile, failing="profiling could not start")
        self._cell_answered = False
        self._cell = self.engines.execute(protocol.numbered_cell(code, cell_number), ranks)

    # The last cell sent: what its ranks have answered so far (see CellAnswers).
    def wait_for_cell(self, timeout: float) -> bool:
        """Whether every rank of the last cell has replied within ``timeout`` seconds."""
        self._cell_answered = self._cell.wait(timeout)
        return self._cell_answered

    def cell_answers(self, output_wait: float = 0.0) -> Answers:
        return self._cell.collect(output_wait)

    def busy_ranks(self) -> list[int]:
        """The ranks still running the last cell sent."""
        return self._cell.pending_ranks() if self._cell is not None else []

    def cell_failed(self) -> bool:
        return self._cell.any_failed()

    def cell_quit_debugging(self) -> bool:
        return self._cell.any_quit_debugging()

    def next_debugger_prompt(self) -> tuple[int, protocol.DebuggerPrompt] | None:
        return self._cell.next_debugger_prompt()

    def published(self, rank: int, key: str, wait: float = 0.0):
        """What ``rank`` last published under ``key`` in the last cell (None if nothing yet)."""
        return self._cell.published(rank, key, wait)

    def clock_offsets(self, ranks: list[int], tries: int = 5) -> dict[int, tuple[float, float] | None]:
        """Each rank's clock minus this process's, in seconds, with how far off that can be (half
        the round trip with the least delay): None for ranks on this machine (one clock). An
        offset within that bound is taken as 0: the clocks agree as far as can be measured."""
        elsewhere = [rank for rank in ranks if self.ranks[rank].address != LOCAL_HOST]
        offsets: dict[int, tuple[float, float] | None] = {rank: None for rank in ranks}
        for _ in range(tries if elsewhere else 0):
            sent = time.time()
            clocks = self.engines.call(elsewhere, profiling.clock)
            bound = (time.time() - sent) / 2
            for rank, clock in clocks.items():
                if offsets[rank] is None or bound < offsets[rank][1]:
                    offset = clock - (sent + bound)
                    offsets[rank] = (0.0 if abs(offset) <= bound else offset, bound)
        return offsets

    def push(self, namespace: dict) -> None:
        self.engines.push(namespace)

    def pull(self, name: str) -> dict[int, object]:
        return self.engines.pull(name)

    def interrupt(self, ranks: list[int]) -> list[int]:
        """SIGINT to ``ranks``; those whose engine did not confirm it (see :meth:`signal`)."""
        return self.signal(signal.SIGINT, ranks)

    def signal(self, signum: int, ranks: list[int], **timeout) -> list[int]:
        """Send ``signum`` to ``ranks`` through their nannies; the ranks that did not confirm."""
        return self.engines.signal(signum, ranks, **timeout)

    def inspect(
        self, ranks: list[int], wait: float = INSPECT_SECONDS, patience: float = INSPECT_PATIENCE_SECONDS
    ) -> dict[int, protocol.Inspection]:
        """Where ``ranks``, still running the last cell, are: every thread's stack and the calls
        traced so far, even while blocked in C code (see :mod:`ddp_magics.engine.inspector`).
        Ranks that do not answer within ``wait`` seconds are left out, except that ranks the
        request reached (the signal was confirmed) are waited for up to ``patience`` seconds."""
        run = self._cell
        before = {rank: run.published(rank, protocol.INSPECTION_KEY) for rank in ranks}
        unreached = set(self.signal(protocol.STACK_DUMP_SIGNAL, ranks, timeout=wait))
        answers: dict[int, protocol.Inspection] = {}
        start = time.monotonic()
        while len(answers) < len(ranks):
            elapsed = time.monotonic() - start
            awaited = [rank for rank in ranks if rank not in answers and rank not in unreached]
            if elapsed >= wait and (elapsed >= max(wait, patience) or not awaited):
                break
            for rank in ranks:
                answer = run.published(rank, protocol.INSPECTION_KEY)
                if answer is not None and answer is not before[rank]:
                    answers[rank] = answer
            time.sleep(0.01)
        return answers

    # ------------------------------------------------------------------- debugging
    def debugger_input(self, rank: int, line: str) -> None:
        """Hand ``line`` to ``rank``'s pdb, waiting at a prompt in ``breakpoint()``."""
        if not self.engines.control(rank, protocol.DEBUGGER_INPUT_REQUEST, {"line": line}):
            raise ClusterError(f"rank {rank} took no debugger line within {SIGNAL_SECONDS:g} s")

    def start_post_mortem(self, rank: int) -> str:
        """Open pdb where ``rank``'s last cell raised; what pdb shows first (a ClusterError if no
        cell raised there)."""
        opened, shown = self.engines.call([rank], debugging.start_post_mortem)[rank]
        if not opened:
            raise ClusterError(f"rank {rank}: {shown}")
        return shown

    def post_mortem_commands(self, rank: int, commands: list[str]) -> tuple[str, bool]:
        """Run pdb commands in ``rank``'s open post-mortem: what they printed, whether it is still open."""
        return self.engines.call([rank], debugging.post_mortem_commands, commands)[rank]

    def end_post_mortem(self, rank: int) -> None:
        self.engines.call([rank], debugging.end_post_mortem)

    def snapshots(self, ranks: list[int], expression: str) -> dict[int, protocol.ValueSnapshot]:
        """``expression`` evaluated on each of ``ranks``, as values to compare (``%dist_diff``); a
        ClusterError naming the first rank where it raised."""
        answers = self.engines.call(ranks, debugging.snapshot, expression)
        for rank, answer in answers.items():
            if isinstance(answer, str):
                raise ClusterError(f"rank {rank}: {answer}")
        return answers
