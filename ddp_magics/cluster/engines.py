"""The engines, through ipyparallel's client: the only notebook-side code that calls it.

:class:`Engines` knows which engine is which rank and sends them code, functions, signals and
control messages; :class:`CellAnswers` reads what each rank has answered to one cell. Both hand
back plain records (:mod:`ddp_magics.cluster.records`), never ipyparallel's objects.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass

import ipyparallel as ipp
import zmq
from ipyparallel.error import CompositeError

from ddp_magics import protocol
from ddp_magics.cluster.records import (
    ENGINE_TIMEOUT_SECONDS,
    ClusterError,
    Progress,
    RankFailure,
    RankInfo,
    RankOutput,
)

# How long a signal to the ranks (an interrupt, a stack dump, a cut) may take to be confirmed.
SIGNAL_SECONDS = 5.0
# How long ranks get to answer a stack-dump request.
INSPECT_SECONDS = 3.0
# How long a rank the request reached (its nanny confirmed the signal) is waited for beyond that: on a
# loaded machine its answer can take longer than INSPECT_SECONDS, and it is on its way.
INSPECT_PATIENCE_SECONDS = 12.0
CONNECT_POLL_SECONDS = 0.005  # how often the engines connected are counted while waiting for them
FORGET_SEND_MS = 1000  # how long the news of engines gone may take to reach the controller
# ipyparallel logs engines' output when they exit non-zero, as they do on SIGTERM at every stop;
# their logs stay in the cluster's log folder while it runs. Only its errors reach the user.
CLUSTER_LOG = logging.getLogger("ddp_magics.ipyparallel")
CLUSTER_LOG.setLevel(logging.ERROR)


@dataclass(frozen=True)
class Answers:
    """What the ranks of a cell have answered at one moment."""

    pending: list[int]  # ranks still running it
    failures: dict[int, RankFailure]  # ranks that raised (or died: RankFailure.engine_died)
    outputs: list[RankOutput]  # every rank's, in rank order


class CellAnswers:
    """What each rank has answered so far to one cell sent to it."""

    def __init__(self, result: ipp.AsyncResult, ranks: list[int]) -> None:
        self._result = result
        # The AsyncResult's per-message metadata dicts, which the client updates as replies and
        # output arrive: read once here (each read of AsyncResult.metadata parses timestamps),
        # then looked at directly. Not the client's own table, which forgets a message as soon
        # as its output is complete (possibly before this line runs).
        self._answers = dict(zip(ranks, result.metadata))
        self._prompts_seen: dict[int, int] = {}  # per rank, the last debugger prompt handed out

    def wait(self, timeout: float) -> bool:
        """Whether every rank has replied within ``timeout`` seconds."""
        return self._result.wait(timeout)

    def collect(self, output_wait: float = 0.0) -> Answers:
        """Everything answered so far, in one record. Replies can come before the last output of
        a rank: once every rank has replied, up to ``output_wait`` seconds go to that output."""
        if output_wait and not self.pending_ranks():
            self._result.wait_for_output(timeout=output_wait)
        return Answers(self.pending_ranks(), self.failures(), self.outputs())

    def pending_ranks(self) -> list[int]:
        return [rank for rank, answer in self._answers.items() if answer["status"] is None]

    def pending_among(self, ranks: list[int], seconds: float) -> list[int]:
        """Those of ``ranks`` still running the cell after waiting up to ``seconds`` for them."""
        deadline = time.monotonic() + seconds
        while True:
            busy = [rank for rank in self.pending_ranks() if rank in ranks]
            if not busy or time.monotonic() > deadline:
                return busy
            time.sleep(0.01)

    def failures(self) -> dict[int, RankFailure]:
        """The exception each failed rank answered with."""
        return {
            rank: _failure(rank, answer["error"])
            for rank, answer in self._answers.items()
            if answer["status"] == "error"
        }

    def any_failed(self) -> bool:
        return any(answer["status"] == "error" for answer in self._answers.values())

    def any_quit_debugging(self) -> bool:
        """Whether a rank ended the cell on purpose, by ``q`` at its debugger's prompt."""
        return any(
            answer["status"] == "error" and getattr(answer["error"], "ename", None) == protocol.DEBUGGER_QUIT
            for answer in self._answers.values()
        )

    def next_debugger_prompt(self) -> tuple[int, protocol.DebuggerPrompt] | None:
        """The lowest rank stopped in ``breakpoint()`` at a prompt not handed out before, with
        the prompt (handed out now); None if there is none."""
        for rank in self.pending_ranks():
            prompt = self.published(rank, protocol.DEBUGGER_KEY)
            if prompt is not None and prompt.number > self._prompts_seen.get(rank, 0):
                self._prompts_seen[rank] = prompt.number
                return rank, prompt
        return None

    def published(self, rank: int, key: str, wait: float = 0.0):
        """What ``rank`` last published under ``key`` in this cell (a data message); None if
        nothing arrived, after waiting up to ``wait`` seconds for it."""
        deadline = time.monotonic() + wait
        while (value := self._answers[rank].get("data", {}).get(key)) is None and time.monotonic() < deadline:
            time.sleep(0.01)
        return value

    def outputs(self) -> list[RankOutput]:
        """What each rank printed, displayed and returned so far, in rank order."""
        outputs = []
        for rank, answer in self._answers.items():
            result = answer.get("execute_result")
            outputs.append(
                RankOutput(
                    rank=rank,
                    stdout=answer.get("stdout", ""),
                    stderr=answer.get("stderr", ""),
                    result=result["data"] if result else None,
                    displays=[
                        {"data": out["data"], "metadata": out.get("metadata", {})}
                        for out in answer.get("outputs", [])
                    ],
                )
            )
        return outputs


def _failure(rank: int, error: BaseException) -> RankFailure:
    """An ipyparallel RemoteError (EngineError if the engine died) as plain per-rank data."""
    ename = getattr(error, "ename", type(error).__name__)
    return RankFailure(
        rank=rank,
        ename=ename,
        evalue=getattr(error, "evalue", str(error)),
        traceback=getattr(error, "traceback", "") or "",
        engine_died=ename == "EngineError",
    )


class Engines:
    """The cluster's engines and which rank each one is."""

    def __init__(self) -> None:
        self._client: ipp.Client | None = None
        self.ranks: list[RankInfo] = []  # in rank order
        self._views: dict[tuple[int, ...], ipp.DirectView] = {}
        self._forgotten: set[int] = set()  # killed, and registered until the controller hears so

    # ------------------------------------------------------------------ connection
    def connect(self, cluster: ipp.Cluster) -> None:
        if self._client is None:
            self._client = cluster.connect_client_sync()

    @property
    def ids(self) -> set[int]:
        """The ids of the engines connected now (not those :meth:`forget` was told of)."""
        registered = set(self._client.ids) if self._client is not None else set()
        self._forgotten &= registered
        return registered - self._forgotten

    def set_ranks(self, ranks: list[RankInfo]) -> None:
        self.ranks = ranks
        self._views = {}

    def wait_until_connected(
        self,
        count: int,
        timeout: float,
        progress: Progress,
        ended: Callable[[], str | None] = lambda: None,
    ) -> None:
        """Until ``count`` engines are connected, reporting each; a ClusterError after ``timeout``,
        or as soon as ``ended()`` says why the engines will not come (their launcher ended)."""
        deadline = time.monotonic() + timeout
        shown = None
        while (connected := len(self.ids)) < count:
            if connected != shown:
                progress(f"engines connected: {connected}/{count}")
                shown = connected
            if time.monotonic() > deadline:
                raise ClusterError(f"only {connected} of {count} engines connected within {timeout:g} s")
            if (why := ended()) is not None:
                raise ClusterError(f"only {len(self.ids)} of {count} engines connected: {why}")
            time.sleep(CONNECT_POLL_SECONDS)
        progress(f"engines connected: {count}/{count}")

    def wait_for_new(self, known: set[int], count: int, timeout: float) -> list[int]:
        """The ids of ``count`` engines connected besides ``known``; a ClusterError after ``timeout``."""
        deadline = time.monotonic() + timeout
        while len(fresh := sorted(self.ids - known)) < count:
            if time.monotonic() > deadline:
                raise ClusterError(f"the new engines did not connect within {timeout:g} s")
            time.sleep(0.02)
        return fresh

    def kill_all(self, grace: float) -> None:
        """SIGKILL every engine. Engines hold nothing to save, and one blocked in gloo ignores
        SIGTERM. Killed (through its nanny) while the controller runs, each engine's nanny tells
        the controller and exits at once; with the controller gone it would linger seconds trying."""
        client = self._client
        if client is None or not client.ids:
            return
        client.send_signal(signal.SIGKILL, targets=client.ids, block=False)
        deadline = time.monotonic() + grace
        while client.ids and time.monotonic() < deadline:
            time.sleep(0.01)

    def forget(self, engine_ids: set[int]) -> None:
        """Tell the controller that these engines are gone (killed by PID, with their nannies,
        which would have told it), as a nanny does; from now on they are not among :attr:`ids`,
        whenever the controller takes note."""
        client = self._client
        if client is None or not engine_ids:
            return
        self._forgotten |= engine_ids
        with client._context.socket(zmq.DEALER) as hub:
            hub.linger = FORGET_SEND_MS  # sent as the socket closes
            if client.curve_serverkey:
                hub.curve_serverkey = client.curve_serverkey
                hub.curve_secretkey = client.curve_secretkey
                hub.curve_publickey = client.curve_publickey
            hub.connect(client._config["registration"])
            for engine_id in sorted(engine_ids):
                client.session.send(hub, "unregistration_request", content={"id": engine_id})

    def close(self) -> None:
        if self._client is not None:
            self._client.close()
        self._client = None
        self.set_ranks([])

    # --------------------------------------------------------------------- running
    def engine_ids(self, ranks: list[int] | None = None) -> list[int]:
        chosen = range(len(self.ranks)) if ranks is None else ranks
        return [self.ranks[rank].engine_id for rank in chosen]

    def _view(self, ranks: list[int]) -> ipp.DirectView:
        key = tuple(ranks)
        if key not in self._views:
            self._views[key] = self._client[self.engine_ids(ranks)]
        return self._views[key]

    def execute(self, code: str, ranks: list[int]) -> CellAnswers:
        """Start running ``code`` on ``ranks``; returns at once."""
        return CellAnswers(self._view(ranks).execute(code, silent=False, block=False), ranks)

    def apply(self, engine_ids: list[int], function: Callable, *args, doing: str) -> list:
        """``function(*args)`` on each engine, its results; a ClusterError if they take longer
        than the engines' timeout or one dies."""
        return self._within_timeout(self._client[engine_ids].apply_async(function, *args), doing)

    def apply_each(self, calls: list[tuple[int, Callable, tuple]], doing: Callable[[int], str]) -> list:
        """``function(*arguments)`` on each engine of ``calls`` (its own function and arguments),
        all sent before any is waited for; the results in order."""
        sent = [self._client[engine_id].apply_async(function, *args) for engine_id, function, args in calls]
        return [self._within_timeout(result, doing(index)) for index, result in enumerate(sent)]

    def call(self, ranks: list[int], function: Callable, *args) -> dict[int, object]:
        """``function(*args)`` on each of ``ranks`` (idle ones), ``{rank: result}``; a ClusterError
        naming the first rank that raised, with its exception in one line."""
        results = self._view(ranks).apply_async(function, *args)
        try:
            values = self._within_timeout(results, f"running {function.__name__}")
        except CompositeError as error:
            raise ClusterError(self._raised(error)[0]) from None
        return dict(zip(ranks, values))

    def call_everywhere(self, ranks: list[int], function: Callable, *args, failing: str) -> None:
        """``function(*args)`` on each of ``ranks``; a ClusterError ``failing (rank R: E: V; ...)``
        naming every rank that raised."""
        try:
            self._within_timeout(self._view(ranks).apply_async(function, *args), failing)
        except CompositeError as error:
            raise ClusterError(f"{failing} (" + "; ".join(self._raised(error)) + ")") from None

    def _raised(self, error: CompositeError) -> list[str]:
        """``rank R: ename: evalue`` for each engine in ``error``."""
        engine_ranks = {info.engine_id: info.rank for info in self.ranks}
        return [
            f"rank {engine_ranks.get(engine_info.get('engine_id'), '?')}: {ename}: {evalue}"
            for ename, evalue, _, engine_info in error.elist
        ]

    def push(self, namespace: dict) -> None:
        self._client[self.engine_ids()].push(namespace, block=True)

    def pull(self, name: str) -> dict[int, object]:
        """``{rank: value of name}``; a ClusterError if ``name`` is defined on no rank or only some."""
        try:
            values = self._client[self.engine_ids()].pull(name, block=True)
        except CompositeError as error:
            if {ename for ename, *_ in error.elist} == {"NameError"}:
                raise ClusterError(f"{name!r} is not defined on every rank") from None
            raise
        return dict(enumerate(values))

    def signal(self, signum: int, ranks: list[int], timeout: float = SIGNAL_SECONDS) -> list[int]:
        """Send ``signum`` to the engines of ``ranks`` through their nannies (on any host); the
        ranks whose nanny did not confirm within ``timeout`` (its host unreachable)."""
        sent = {
            rank: self._client.send_signal(signum, targets=[self.ranks[rank].engine_id], block=False)
            for rank in ranks
        }
        deadline = time.monotonic() + timeout
        for future in sent.values():
            with contextlib.suppress(TimeoutError):
                future.result(timeout=max(deadline - time.monotonic(), 0))
        return [rank for rank, future in sent.items() if not future.done()]

    def control(self, rank: int, msg_type: str, content: dict, timeout: float = SIGNAL_SECONDS) -> bool:
        """A control message to ``rank`` (answered while its main thread runs a cell), which
        ipyparallel's client sends only through its own method for its control requests; there
        is no public one for others. Whether the rank confirmed it within ``timeout``."""
        sent = self._client._send_control_request(
            targets=[self.ranks[rank].engine_id], msg_type=msg_type, content=content, block=False
        )
        try:
            sent.result(timeout=timeout)
        except TimeoutError:
            return False
        return True

    def _within_timeout(self, result: ipp.AsyncResult, doing: str):
        """The result, or a ClusterError if the engines take longer than the engines' timeout."""
        try:
            return result.get(timeout=ENGINE_TIMEOUT_SECONDS)
        except TimeoutError:
            raise ClusterError(f"engines still busy {doing} after {ENGINE_TIMEOUT_SECONDS:g} s") from None
        except CompositeError as error:
            engine_ranks = {info.engine_id: info.rank for info in self.ranks}
            died = [
                engine_ranks.get(engine_info.get("engine_id"))
                for ename, _, _, engine_info in error.elist
                if ename == "EngineError"
            ]
            if not died:
                raise
            known = sorted(rank for rank in died if rank is not None)
            who = protocol.rank_label(known) if known else f"{len(died)} new engine(s)"
            raise ClusterError(f"{who} died while {doing}") from None
