"""Tracing torch.distributed calls: recorded on each rank, matched across ranks in the notebook.

Engine side: ``start_trace`` wraps the communication functions of ``torch.distributed`` for the
next cell and unwraps them when that cell ends (IPython's ``post_execute``). Every call becomes a
:class:`TraceEvent` (plain, picklable data) kept in memory and written to ``rankN.trace`` in the
cluster's directory when the cell ends. The events of a cell that blocks in C code can still be
read: the notebook writes a byte to the FIFO ``rankN.request`` and a thread of the engine, asleep
on it otherwise, writes ``rankN.trace``. When tracing is off nothing is wrapped.

Notebook side: :class:`Trace` merges the ranks' events. It pairs each send with its recv, lines
up each group's collectives by their order on every rank, names mismatches in plain words and
orders everything into steps that ``diagrams.py`` draws.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import itertools
import os
import pickle
import sys
import threading
import time
import weakref
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import NamedTuple

from ddp_magics.errors import rank_label

DEFAULT_VALUES_LIMIT = 16
TRACE_FILE = "rank{rank}.trace"
REQUEST_FILE = "rank{rank}.request"  # a FIFO: a byte written to it asks for a snapshot


# --------------------------------------------------------------------------- what a call records
@dataclass(frozen=True)
class OpSpec:
    """Which arguments of a torch.distributed function hold what."""

    inputs: tuple[str, ...] = ()  # tensors (or tensor lists) whose values go in
    outputs: tuple[str, ...] = ()  # tensors (or tensor lists) that hold the result
    primary: str | None = None  # the tensor whose shape must agree across the group
    root: str | None = None  # src/dst of a rooted collective
    peer: str | None = None  # dst/src of a point-to-point call
    has_reduce_op: bool = False
    p2p: bool = False

    @property
    def in_place(self) -> bool:
        """Writes its result into its input (all_reduce, broadcast, recv, ...)."""
        return self.outputs == self.inputs


OPS: dict[str, OpSpec] = {
    "send": OpSpec(inputs=("tensor",), primary="tensor", peer="dst", p2p=True),
    "recv": OpSpec(inputs=("tensor",), outputs=("tensor",), primary="tensor", peer="src", p2p=True),
    "isend": OpSpec(inputs=("tensor",), primary="tensor", peer="dst", p2p=True),
    "irecv": OpSpec(inputs=("tensor",), outputs=("tensor",), primary="tensor", peer="src", p2p=True),
    "broadcast": OpSpec(inputs=("tensor",), outputs=("tensor",), primary="tensor", root="src"),
    "reduce": OpSpec(
        inputs=("tensor",), outputs=("tensor",), primary="tensor", root="dst", has_reduce_op=True
    ),
    "all_reduce": OpSpec(inputs=("tensor",), outputs=("tensor",), primary="tensor", has_reduce_op=True),
    "gather": OpSpec(inputs=("tensor",), outputs=("gather_list",), primary="tensor", root="dst"),
    "all_gather": OpSpec(inputs=("tensor",), outputs=("tensor_list",), primary="tensor"),
    "all_gather_into_tensor": OpSpec(
        inputs=("input_tensor",), outputs=("output_tensor",), primary="input_tensor"
    ),
    # torch 2.13's name for all_gather_into_tensor (which it deprecates and forwards here)
    "all_gather_single": OpSpec(inputs=("input_tensor",), outputs=("output_tensor",), primary="input_tensor"),
    "scatter": OpSpec(inputs=("scatter_list",), outputs=("tensor",), primary="tensor", root="src"),
    "reduce_scatter": OpSpec(
        inputs=("input_list",), outputs=("output",), primary="output", has_reduce_op=True
    ),
    "reduce_scatter_tensor": OpSpec(
        inputs=("input",), outputs=("output",), primary="output", has_reduce_op=True
    ),
    # torch 2.13's name for reduce_scatter_tensor (which it deprecates and forwards here)
    "reduce_scatter_single": OpSpec(
        inputs=("input",), outputs=("output",), primary="output", has_reduce_op=True
    ),
    "all_to_all": OpSpec(inputs=("input_tensor_list",), outputs=("output_tensor_list",)),
    "all_to_all_single": OpSpec(inputs=("input",), outputs=("output",)),
    "barrier": OpSpec(),
}
TRACED_OPS = tuple(OPS)
SENDS, RECVS = ("send", "isend"), ("recv", "irecv")
WAIT = "wait"
# Status of an event: running (called, not returned), waiting (async op issued, not waited yet),
# done, error.
RUNNING, WAITING, DONE, ERROR = "running", "waiting", "done", "error"


class TensorInfo(NamedTuple):
    shape: tuple[int, ...]
    dtype: str
    values: tuple | None = None  # flat values when the tensor is small enough

    def describe(self) -> str:
        if self.values is not None:
            return "[" + ", ".join(format_number(value) for value in self.values) + "]"
        return f"<{'x'.join(map(str, self.shape)) or 'scalar'} {self.dtype}>"

    @property
    def layout(self) -> str:
        return f"shape ({', '.join(map(str, self.shape))}{',' if len(self.shape) == 1 else ''}) {self.dtype}"


@dataclass
class TraceEvent:
    """One call a rank made, as plain data. Ranks are global ranks."""

    rank: int
    seq: int  # 1, 2, ... in the order the rank made its calls
    op: str
    group: tuple[int, ...]
    group_name: str
    peer: int | None = None
    root: int | None = None
    reduce_op: str | None = None
    tag: int = 0
    primary: TensorInfo | None = None  # shape and dtype only
    before: tuple[TensorInfo, ...] = ()
    after: tuple[TensorInfo, ...] | None = None
    async_op: bool = False
    waits_for: int | None = None  # a wait: the seq of the call whose handle it waited on
    waited_op: str | None = None  # ... and that call's op
    line: int | None = None  # line in the cell that made the call
    start: float = 0.0
    end: float | None = None
    status: str = RUNNING
    error: str | None = None

    @property
    def is_collective(self) -> bool:
        return self.op in OPS and not OPS[self.op].p2p

    def call(self) -> str:
        """``recv from rank 1``, ``all_reduce SUM on ranks 0,1``, ``wait for isend #2``."""
        if self.op == WAIT:
            return f"wait for {self.waited_op} (call #{self.waits_for})"
        if self.op in SENDS:
            return f"{self.op} to rank {self.peer}"
        if self.op in RECVS:
            return f"{self.op} from {'any rank' if self.peer is None else f'rank {self.peer}'}"
        words = [self.op]
        if self.reduce_op:
            words.append(self.reduce_op)
        if self.root is not None:
            words.append(f"{'from' if OPS[self.op].root == 'src' else 'to'} rank {self.root}")
        words.append(f"on {group_label(self.group)}")
        return " ".join(words)

    def where(self) -> str:
        return f"line {self.line}" if self.line is not None else "an unknown line"


def plural(count: int, noun: str) -> str:
    return f"{count} {noun}{'' if count == 1 else 's'}"


def group_label(group: tuple[int, ...]) -> str:
    return rank_label(list(group))


def format_number(value) -> str:
    if isinstance(value, float):
        text = format(value, ".6g")
        return text if any(mark in text for mark in ".enia") else text + ".0"
    return str(value)


def format_values(infos: tuple[TensorInfo, ...] | None) -> str:
    if infos is None:
        return "?"
    if not infos:
        return "-"
    return " ".join(info.describe() for info in infos)


# --------------------------------------------------------------------------- engine side
class Tracer:
    """Wraps torch.distributed's communication functions and records each call."""

    def __init__(self, directory: str, values_limit: int) -> None:
        import torch
        import torch.distributed as dist

        self._torch = torch
        self._dist = dist
        self.rank = dist.get_rank()
        self.values_limit = values_limit
        self.events: list[TraceEvent] = []
        self.active = False
        self._seq = itertools.count(1)
        self._originals: dict[str, object] = {}
        self._groups: dict[int, tuple[object, tuple[int, ...] | None, str | None]] = {}
        self._nested = False
        self._known: dict[int, tuple] = {}  # id -> (weak reference, TensorInfo without values, small)
        self.snapshot_path = Path(directory) / TRACE_FILE.format(rank=self.rank)

    # ---------------------------------------------------------------- install / remove
    def install(self) -> None:
        for name in TRACED_OPS:
            original = getattr(self._dist, name)
            self._originals[name] = original
            setattr(self._dist, name, self._wrap(name, original))
        self.active = True
        self.snapshot_path.unlink(missing_ok=True)

    def remove(self) -> None:
        for name, original in self._originals.items():
            setattr(self._dist, name, original)
        self._originals.clear()
        self.active = False
        # Let go of the cell's groups and tensors: a group the user deletes must really go
        # (destroying and re-forming the default group on the same port relies on it).
        self._groups.clear()
        self._known.clear()
        self.write_snapshot()  # the final state, for the ranks of a cell that others did not finish

    def write_snapshot(self) -> None:
        # The snapshot thread and the main thread (at the cell's end) may both write one.
        partial = self.snapshot_path.with_name(f"{self.snapshot_path.name}.{threading.get_ident()}.partial")
        partial.write_bytes(pickle.dumps(list(self.events), protocol=pickle.HIGHEST_PROTOCOL))
        os.replace(partial, self.snapshot_path)

    # ---------------------------------------------------------------- recording
    def _wrap(self, name: str, original):
        # Runs between two communication calls, when the CPU caches hold the tensors' data rather
        # than this code: so as few lookups and calls as possible.
        spec = OPS[name]
        parameter_names = tuple(inspect.signature(original).parameters)
        now, groups, events, sequence = time.time, self._groups, self.events, self._seq
        tensors, rank = self._tensors, self.rank
        default_async = name in ("isend", "irecv")

        @functools.wraps(original)
        def traced(*args, **kwargs):
            if self._nested:  # a traced function calling another: record the outer call only
                return original(*args, **kwargs)
            arguments = dict(zip(parameter_names, args))
            if kwargs:
                arguments.update(kwargs)
            group_object = arguments.get("group")
            group = groups.get(id(group_object)) or self._group(group_object)
            if group[1] is None:  # this rank is not in the group: torch makes the call a no-op
                return original(*args, **kwargs)
            before = tensors(arguments, spec.inputs)
            event = TraceEvent(
                rank,
                next(sequence),
                name,
                group[1],
                group[2],
                tag=arguments.get("tag", 0),
                before=before,
                async_op=arguments.get("async_op", default_async),
                line=cell_line(2),  # cell_line <- traced <- the caller
                start=now(),
            )
            if spec.peer:
                event.peer = self._global_rank(arguments, spec.peer, group_object)
            if spec.root:
                event.root = self._global_rank(arguments, spec.root, group_object)
            if spec.has_reduce_op:
                reduce_op = arguments.get("op")
                event.reduce_op = "SUM" if reduce_op is None else _reduce_op_name(reduce_op)
            if spec.primary:
                event.primary = self._layout_of(arguments.get(spec.primary))
            events.append(event)
            self._nested = True
            try:
                result = original(*args, **kwargs)
            except BaseException as error:
                self._fail(event, error)
                raise
            finally:
                self._nested = False
            if event.async_op and result is not None:
                event.status = WAITING
                return TracedWork(result, self, event, arguments)
            if name == "recv" and event.peer is None:
                event.peer = result
            self._complete(event, spec, arguments)
            return result

        return traced

    def _layout_of(self, tensor) -> TensorInfo | None:
        """Shape and dtype only (what must agree across a group)."""
        if isinstance(tensor, self._torch.Tensor):
            return self._known_info(tensor)[1]
        return None

    def _complete(self, event: TraceEvent, spec: OpSpec, arguments: dict) -> None:
        if spec.in_place and all(info.values is None for info in event.before):
            event.after = event.before  # same tensors, too large to keep values: nothing new
        else:
            event.after = self._tensors(arguments, spec.outputs)
        event.end = time.time()
        event.status = DONE

    def _fail(self, event: TraceEvent, error: BaseException) -> None:
        message = str(error).strip().splitlines()
        event.error = type(error).__name__ + (f": {message[0]}" if message else "")
        event.end = time.time()
        event.status = ERROR

    def _group(self, group) -> tuple[object, tuple[int, ...] | None, str | None]:
        """(group, its global ranks, its name), cached; ranks None if this rank is not a member."""
        dist = self._dist
        if group is dist.GroupMember.NON_GROUP_MEMBER:
            return (group, None, None)
        process_group = group if group is not None else dist.group.WORLD
        # The group object is kept in the entry so that its id is not reused while cached.
        entry = (group, tuple(dist.get_process_group_ranks(process_group)), process_group.group_name)
        self._groups[id(group)] = entry
        return entry

    def _global_rank(self, arguments: dict, name: str, group) -> int | None:
        value = arguments.get(name)
        if value is not None:
            return value
        group_rank = arguments.get(f"group_{name}")
        if group_rank is None:
            return None
        return self._dist.get_global_rank(group if group is not None else self._dist.group.WORLD, group_rank)

    def _tensors(self, arguments: dict, names: tuple[str, ...]) -> tuple[TensorInfo, ...]:
        tensor_type = self._torch.Tensor
        infos = []
        for name in names:
            value = arguments.get(name)
            if isinstance(value, tensor_type):
                infos.append(self._info(value))
            elif isinstance(value, (list, tuple)):
                infos.extend(self._info(tensor) for tensor in value if isinstance(tensor, tensor_type))
        return tuple(infos)

    def _known_info(self, tensor) -> tuple:
        """(weak reference, TensorInfo without values, small enough for values), cached.

        Reading a tensor's shape and dtype costs more than the rest of a traced call, so a tensor
        communicated again (a gradient bucket, a reused buffer) is described once per cell; the
        weak reference tells a new tensor that got an old id. (A tensor resized in place between
        two calls of one cell keeps its first shape in the trace.)
        """
        known = self._known.get(id(tensor))
        if known is None or known[0]() is not tensor:
            small = tensor.numel() <= self.values_limit
            known = (weakref.ref(tensor), TensorInfo(tuple(tensor.shape), _dtype_name(tensor)), small)
            self._known[id(tensor)] = known
        return known

    def _info(self, tensor) -> TensorInfo:
        known = self._known_info(tensor)
        if known[2]:
            return known[1]._replace(values=tuple(tensor.detach().reshape(-1).tolist()))
        return known[1]


class TracedWork:
    """The handle of a traced async call: records its ``wait`` and the values it produced."""

    def __init__(self, work, tracer: Tracer, event: TraceEvent, arguments: dict) -> None:
        self._work = work
        self._tracer = tracer
        self._event = event
        self._arguments = arguments

    def wait(self, *args, **kwargs):
        tracer, event = self._tracer, self._event
        if not tracer.active or event.status != WAITING:
            return self._work.wait(*args, **kwargs)
        wait_event = replace(
            event,
            seq=next(tracer._seq),
            op=WAIT,
            waits_for=event.seq,
            waited_op=event.op,
            before=(),
            after=None,
            async_op=False,
            line=cell_line(2),  # cell_line <- wait <- the caller
            start=time.time(),
            status=RUNNING,
        )
        tracer.events.append(wait_event)
        try:
            result = self._work.wait(*args, **kwargs)
        except BaseException as error:
            tracer._fail(wait_event, error)
            tracer._fail(event, error)
            raise
        if event.op == "irecv" and event.peer is None:
            event.peer = self._work._source_rank()
        tracer._complete(event, OPS[event.op], self._arguments)
        wait_event.after = ()
        wait_event.end = time.time()
        wait_event.status = DONE
        return result

    def __getattr__(self, name: str):
        return getattr(self._work, name)

    def __repr__(self) -> str:
        return f"<traced {self._event.op} handle: {self._work!r}>"


_DTYPE_NAMES: dict = {}
_REDUCE_OP_NAMES: dict = {}


def _dtype_name(tensor) -> str:
    dtype = tensor.dtype
    name = _DTYPE_NAMES.get(dtype)
    if name is None:
        name = _DTYPE_NAMES[dtype] = str(dtype).removeprefix("torch.")
    return name


def _reduce_op_name(reduce_op) -> str:
    try:
        return _REDUCE_OP_NAMES[reduce_op]
    except (KeyError, TypeError):  # a new op, or one that cannot be a key (a premul_sum ReduceOp)
        name = getattr(reduce_op, "name", None) or str(reduce_op)
        with contextlib.suppress(TypeError):
            _REDUCE_OP_NAMES[reduce_op] = name
        return name


def cell_line(depth: int) -> int | None:
    """The line of the running cell that led to this call (in the cell, or a function it defines).

    ``depth`` frames up from here is the code that made the traced call.
    """
    frame = sys._getframe(depth)
    back = frame.f_back
    if back is not None and back.f_code.co_name == "run_code":  # called from the cell itself
        return frame.f_lineno
    frames = []
    while frame is not None:
        frames.append(frame)
        back = frame.f_back
        if back is not None and back.f_code.co_name == "run_code":
            cell_file = frame.f_code.co_filename
            return next(f.f_lineno for f in frames if f.f_code.co_filename == cell_file)
        frame = back
    return None


_tracer: Tracer | None = None


def start_trace(directory: str, values_limit: int = DEFAULT_VALUES_LIMIT) -> None:
    """Trace the calls of the next cell this engine executes (sent just before that cell)."""
    global _tracer
    from IPython import get_ipython

    if _tracer is not None and _tracer.active:
        _stop_trace()
    _tracer = Tracer(directory, values_limit)
    _start_snapshot_server(Path(directory), _tracer.rank)
    _tracer.install()
    get_ipython().events.register("post_execute", _stop_trace)


_snapshot_server: threading.Thread | None = None


def _start_snapshot_server(directory: Path, rank: int) -> None:
    """Once per engine: a thread that writes a snapshot of the current trace whenever a byte
    arrives on the rank's request FIFO. It sleeps in ``read`` (no polling, the GIL released),
    and runs while the main thread is blocked in C code."""
    global _snapshot_server
    if _snapshot_server is not None:
        return
    fifo = directory / REQUEST_FILE.format(rank=rank)
    os.mkfifo(fifo, 0o600)
    descriptor = os.open(fifo, os.O_RDWR)  # read-write: opening does not wait for a writer

    def serve() -> None:
        while os.read(descriptor, 64):
            if _tracer is not None:
                _tracer.write_snapshot()

    _snapshot_server = threading.Thread(target=serve, name="ddp_magics trace snapshots", daemon=True)
    _snapshot_server.start()


def _stop_trace() -> None:
    from IPython import get_ipython

    events = get_ipython().events
    if _stop_trace in events.callbacks["post_execute"]:
        events.unregister("post_execute", _stop_trace)
    if _tracer is not None and _tracer.active:
        _tracer.remove()


def read_snapshots(
    directory: Path, ranks: list[int], still_running: list[int], wait: float = 2.0
) -> dict[int, list[TraceEvent]]:
    """The events of ``ranks`` so far, from their snapshot files (works while ranks block).

    Ranks that finished the cell wrote their final snapshot; ``still_running`` ranks are asked
    for one. A rank that does not answer within ``wait`` seconds gives [].
    """
    asked = []
    for rank in still_running:
        snapshot = directory / TRACE_FILE.format(rank=rank)
        snapshot.unlink(missing_ok=True)
        try:
            descriptor = os.open(directory / REQUEST_FILE.format(rank=rank), os.O_WRONLY | os.O_NONBLOCK)
        except OSError:  # no FIFO, or nobody reading it: this rank never traced
            continue
        try:
            os.write(descriptor, b"s")
        finally:
            os.close(descriptor)
        asked.append(snapshot)
    deadline = time.monotonic() + wait
    while not all(path.exists() for path in asked) and time.monotonic() < deadline:
        time.sleep(0.01)
    snapshots = {}
    for rank in ranks:
        try:
            snapshots[rank] = pickle.loads((directory / TRACE_FILE.format(rank=rank)).read_bytes())
        except FileNotFoundError:
            snapshots[rank] = []
    return snapshots


# --------------------------------------------------------------------------- notebook side
COLLECTIVE, TRANSFER, SOLO = "collective", "transfer", "solo"


@dataclass
class Step:
    """One thing that happened: a collective across a group, a send paired with its recv, or one
    rank's lone call (a wait, or half of a pair that never met)."""

    kind: str
    events: dict[int, TraceEvent]  # rank -> its event (for a transfer: sender and receiver)
    group: tuple[int, ...] = ()
    index: int = 0  # for a collective: its position among the group's collectives (1, 2, ...)
    column: int = 0  # the earliest column of its events
    columns: dict[int, int] = field(default_factory=dict)  # rank -> column of its event (time order)
    waited: Step | None = None  # for waits: the step whose handles they waited on

    @property
    def ranks(self) -> list[int]:
        return sorted(self.events)

    @property
    def op(self) -> str:
        if self.kind == TRANSFER:
            send, recv = self.send, self.recv
            return f"{send.op}/{recv.op}" if send and recv else (send or recv).op
        ops = [self.events[rank].op for rank in self.ranks]
        return "/".join(dict.fromkeys(ops))  # "all_reduce", or "all_reduce/broadcast" if ranks differ

    @property
    def send(self) -> TraceEvent | None:
        return next((e for e in self.events.values() if e.op in SENDS), None)

    @property
    def recv(self) -> TraceEvent | None:
        return next((e for e in self.events.values() if e.op in RECVS), None)

    @property
    def missing(self) -> list[int]:
        return [rank for rank in self.group if rank not in self.events] if self.kind == COLLECTIVE else []

    def flows(self) -> list[tuple[int, int]]:
        """(from rank, to rank) for each rank-to-rank movement of data in this step."""
        if self.kind == TRANSFER:
            return [(self.send.rank, self.recv.rank)] if self.send and self.recv else []
        if self.kind != COLLECTIVE or len({event.op for event in self.events.values()}) > 1:
            return []
        ranks, op = self.ranks, self.op
        root = self.events[ranks[0]].root
        if op in ("broadcast", "scatter"):
            return [(root, rank) for rank in ranks if rank != root] if root in self.events else []
        if op in ("reduce", "gather"):
            return [(rank, root) for rank in ranks if rank != root] if root in self.events else []
        if op == "barrier":
            return []
        return [(a, b) for a in ranks for b in ranks if a != b]

    def title(self) -> str:
        if self.kind == TRANSFER and self.send and self.recv:
            return f"{self.op} rank {self.send.rank} -> rank {self.recv.rank}"
        first = self.events[self.ranks[0]]
        if self.kind == SOLO:
            if self.waited is None:
                return first.call()
            return f"wait for {self.waited.title()}"
        return _collective_title(self)

    def lines(self) -> list[str]:
        """Per rank: values before -> after; ranks with the same line share it."""
        ranks_by_line: dict[str, list[int]] = {}
        for rank in self.ranks:
            event = self.events[rank]
            if event.op == WAIT:
                line = f"{event.call()}{_status_note(event)}"
            else:
                flow = format_values(event.before)
                if OPS[event.op].outputs:
                    flow += " -> " + format_values(event.after)
                line = f"{_role(self, event)}{flow}{_status_note(event)}"
            ranks_by_line.setdefault(line, []).append(rank)
        if self.missing:
            ranks_by_line.setdefault("never called it", []).extend(self.missing)
        return [f"{rank_label(ranks)}: {line}" for line, ranks in ranks_by_line.items()]


def _collective_title(step: Step) -> str:
    first = step.events[step.ranks[0]]
    if len({event.op for event in step.events.values()}) > 1:
        return f"{step.op} on {group_label(step.group)} (ranks called different collectives)"
    words = [step.op]
    if first.reduce_op:
        words.append(first.reduce_op)
    if first.root is not None and first.op == step.op:
        words.append(f"{'from' if OPS[first.op].root == 'src' else 'to'} rank {first.root}")
    return " ".join(words) + f" on {group_label(step.group)}"


def _role(step: Step, event: TraceEvent) -> str:
    if step.kind == TRANSFER:
        return "sends " if event.op in SENDS else "receives "
    if step.kind == COLLECTIVE and event.op != step.op:
        return f"called {event.call()}: "
    return ""


def _status_note(event: TraceEvent) -> str:
    return {
        RUNNING: "  (still running)",
        WAITING: "  (not waited on)",
        ERROR: f"  (raised {event.error})",
    }.get(event.status, "")


@dataclass(frozen=True)
class Mismatch:
    kind: str
    message: str
    events: tuple[TraceEvent, ...]  # the calls involved

    @property
    def ranks(self) -> tuple[int, ...]:
        return tuple(sorted({event.rank for event in self.events}))

    def involves(self, event: TraceEvent) -> bool:
        return any(e.rank == event.rank and e.seq == event.seq for e in self.events)


MISSING_CALL = "collective not called by every rank"
DIFFERENT_OPS = "different collectives"
DIFFERENT_SHAPES = "different shapes or dtypes"
DIFFERENT_ROOTS = "different roots"
DIFFERENT_REDUCE_OPS = "different reduce ops"
SEND_WITHOUT_RECV = "send without recv"
RECV_WITHOUT_SEND = "recv without send"
SIZE_MISMATCH = "send and recv sizes differ"


@dataclass
class Trace:
    """The merged trace of one cell: every rank's calls, matched into steps, with mismatches.

    ``complete`` is False when some ranks had not finished the cell (the trace holds what they
    had recorded so far).
    """

    events: dict[int, list[TraceEvent]]
    complete: bool = True
    steps: list[Step] = field(init=False)
    mismatches: list[Mismatch] = field(init=False)

    def __post_init__(self) -> None:
        self.events = {rank: list(events) for rank, events in sorted(self.events.items())}
        self.steps, self.mismatches = match(self.events)

    @property
    def ranks(self) -> list[int]:
        return list(self.events)

    def calls(self) -> int:
        return sum(len(events) for events in self.events.values())

    def in_progress(self, rank: int) -> TraceEvent | None:
        """The call ``rank`` is in (not returned, or a wait not returned), if any."""
        running = [event for event in self.events.get(rank, []) if event.status == RUNNING]
        return running[-1] if running else None

    def text(self, max_steps: int = 30) -> str:
        lines = [
            f"Trace of {rank_label(self.ranks)}: {plural(self.calls(), 'call')} in "
            f"{plural(len(self.steps), 'step')}" + ("" if self.complete else " (cell not finished)")
        ]
        for number, step in enumerate(self.steps[:max_steps], 1):
            lines.append(f"{number:>3}. {step.title()}")
            lines.extend(f"       {line}" for line in step.lines())
        if len(self.steps) > max_steps:
            lines.append(f"     ... {len(self.steps) - max_steps} more steps: {self.summary()}")
        lines.extend(f"Mismatch: {mismatch.message}" for mismatch in self.mismatches)
        return "\n".join(lines)

    def summary(self) -> str:
        """``12 x all_reduce, 4 x send/recv`` over all steps."""
        counts: dict[str, int] = {}
        for step in self.steps:
            counts[step.op] = counts.get(step.op, 0) + 1
        return ", ".join(f"{count} x {op}" for op, count in counts.items())

    def __repr__(self) -> str:
        return self.text()

    def draw(self, step: int | None = None, timeline: bool | None = None):
        """A diagram: one step (``step=N``, numbered as in the listing) or the timeline."""
        from ddp_magics import diagrams

        return diagrams.draw_trace(self, step=step, timeline=timeline)


def match(events: dict[int, list[TraceEvent]]) -> tuple[list[Step], list[Mismatch]]:
    """Pair sends with recvs, line up collectives, find mismatches and order the steps."""
    steps: list[Step] = []
    mismatches: list[Mismatch] = []
    _match_collectives(events, steps, mismatches)
    _match_transfers(events, steps, mismatches)
    step_of = {(rank, event.seq): step for step in steps for rank, event in step.events.items()}
    waits: dict[int, Step] = {}  # one wait step per step whose handles were waited on
    for rank, rank_events in events.items():
        for event in rank_events:
            if (rank, event.seq) in step_of:
                continue
            waited = step_of.get((rank, event.waits_for)) if event.op == WAIT else None
            if waited is not None and id(waited) in waits and rank not in waits[id(waited)].events:
                waits[id(waited)].events[rank] = event
                continue
            step = Step(SOLO, {rank: event}, waited=waited)
            if waited is not None:
                waits[id(waited)] = step
            steps.append(step)
    return _in_time_order(events, steps), mismatches


def _match_collectives(events, steps: list[Step], mismatches: list[Mismatch]) -> None:
    by_group: dict[str, dict[int, list[TraceEvent]]] = {}
    groups: dict[str, tuple[int, ...]] = {}
    for rank, rank_events in events.items():
        for event in rank_events:
            if event.is_collective:
                by_group.setdefault(event.group_name, {}).setdefault(rank, []).append(event)
                groups[event.group_name] = event.group
    for name, per_rank in by_group.items():
        group = groups[name]
        for index in range(max(len(calls) for calls in per_rank.values())):
            step_events = {rank: calls[index] for rank, calls in per_rank.items() if index < len(calls)}
            step = Step(COLLECTIVE, step_events, group=group, index=index + 1)
            steps.append(step)
            mismatches.extend(_collective_mismatches(step, traced=set(events)))


def _collective_mismatches(step: Step, traced: set[int]) -> list[Mismatch]:
    found = []
    events = step.events
    nth = f"collective #{step.index} on {group_label(step.group)}"
    missing = [rank for rank in step.missing if rank in traced]
    if missing:
        called = ", ".join(f"rank {r} called {e.op} at {e.where()}" for r, e in sorted(events.items()))
        found.append(
            Mismatch(
                MISSING_CALL,
                f"{nth}: {called}; {rank_label(missing)} never called it",
                tuple(events.values()),
            )
        )
    if len({event.op for event in events.values()}) > 1:
        called = ", ".join(f"rank {r} called {e.op} at {e.where()}" for r, e in sorted(events.items()))
        found.append(Mismatch(DIFFERENT_OPS, f"{nth}: {called}", tuple(events.values())))
        return found  # shapes, roots and reduce ops of different ops are not comparable
    for kind, describe in (
        (DIFFERENT_SHAPES, lambda e: e.primary.layout if e.primary else None),
        (DIFFERENT_ROOTS, lambda e: None if e.root is None else f"root rank {e.root}"),
        (DIFFERENT_REDUCE_OPS, lambda e: e.reduce_op),
    ):
        seen = {rank: describe(event) for rank, event in sorted(events.items())}
        if len(set(seen.values())) > 1:
            detail = ", ".join(f"rank {rank} {text}" for rank, text in seen.items())
            found.append(Mismatch(kind, f"{nth} ({step.op}): {kind}: {detail}", tuple(events.values())))
    return found


def _match_transfers(events, steps: list[Step], mismatches: list[Mismatch]) -> None:
    sends: dict[tuple, list[TraceEvent]] = {}
    recvs: dict[tuple, list[TraceEvent]] = {}
    open_recvs: list[TraceEvent] = []  # from any rank, not received yet
    for rank_events in events.values():
        for event in rank_events:
            if event.op in SENDS:
                sends.setdefault((event.rank, event.peer, event.tag), []).append(event)
            elif event.op in RECVS and event.peer is None:
                open_recvs.append(event)
            elif event.op in RECVS:
                recvs.setdefault((event.peer, event.rank, event.tag), []).append(event)
    for key in sorted(set(sends) | set(recvs)):
        src, dst, tag = key
        key_sends, key_recvs = sends.get(key, []), recvs.get(key, [])
        for send, recv in itertools.zip_longest(key_sends, key_recvs):
            if send and recv:
                steps.append(Step(TRANSFER, {send.rank: send, recv.rank: recv}))
                if send.primary and recv.primary and send.primary != recv.primary:
                    mismatches.append(
                        Mismatch(
                            SIZE_MISMATCH,
                            f"rank {src} sends {send.primary.layout} at {send.where()}, but rank {dst} "
                            f"receives into {recv.primary.layout} at {recv.where()}",
                            (send, recv),
                        )
                    )
            elif send:
                if dst not in events:
                    continue  # the receiver was not traced
                if any(recv.rank == dst for recv in open_recvs):
                    continue  # an any-source recv on dst may take it
                tag_note = f" with tag {tag}" if tag else ""
                mismatches.append(
                    Mismatch(
                        SEND_WITHOUT_RECV,
                        f"rank {src} sends to rank {dst}{tag_note} at {send.where()}, but rank {dst} "
                        "posts no matching recv",
                        (send,),
                    )
                )
            elif src in events:
                tag_note = f" with tag {tag}" if tag else ""
                mismatches.append(
                    Mismatch(
                        RECV_WITHOUT_SEND,
                        f"rank {dst} receives from rank {src}{tag_note} at {recv.where()}, but rank {src} "
                        "never sends to it",
                        (recv,),
                    )
                )
    for recv in open_recvs:
        if recv.status == RUNNING and not any(dst == recv.rank for (_, dst, _) in sends):
            mismatches.append(
                Mismatch(
                    RECV_WITHOUT_SEND,
                    f"rank {recv.rank} receives from any rank at {recv.where()}, but no rank sends to it",
                    (recv,),
                )
            )


def _in_time_order(events: dict[int, list[TraceEvent]], steps: list[Step]) -> list[Step]:
    """Give every event a column and order the steps by it.

    An event comes after the rank's previous event; the events of one collective share a column;
    a recv is no earlier than its send. This is a longest-path layering; if mismatched calls
    make it cyclic, each event falls back to its position among its rank's calls.
    """
    node_of: dict[tuple[int, int], object] = {}
    step_of: dict[tuple[int, int], Step] = {}
    for step in steps:
        for rank, event in step.events.items():
            node_of[(rank, event.seq)] = id(step) if step.kind == COLLECTIVE else (rank, event.seq)
            step_of[(rank, event.seq)] = step
    edges: list[tuple[object, object, int]] = []
    for rank, rank_events in events.items():
        for earlier, later in itertools.pairwise(rank_events):
            edges.append((node_of[(rank, earlier.seq)], node_of[(rank, later.seq)], 1))
    for step in steps:
        if step.kind == TRANSFER and step.send and step.recv:
            send, recv = step.send, step.recv
            edges.append((node_of[(send.rank, send.seq)], node_of[(recv.rank, recv.seq)], 0))
    columns = _longest_path(set(node_of.values()), edges)
    for rank, rank_events in events.items():
        for position, event in enumerate(rank_events):
            key = (rank, event.seq)
            step_of[key].columns[rank] = position if columns is None else columns[node_of[key]]
    for step in steps:
        step.column = min(step.columns.values())
    return sorted(steps, key=lambda step: (step.column, step.ranks[0], step.kind))


def _longest_path(nodes: set, edges: list[tuple[object, object, int]]) -> dict | None:
    """Column of each node: the longest weighted path reaching it; None if the graph has a cycle."""
    incoming = {node: 0 for node in nodes}
    outgoing: dict[object, list[tuple[object, int]]] = {node: [] for node in nodes}
    for source, target, weight in edges:
        if source != target:
            outgoing[source].append((target, weight))
            incoming[target] += 1
    column = {node: 0 for node in nodes}
    ready = [node for node, count in incoming.items() if count == 0]
    placed = 0
    while ready:
        node = ready.pop()
        placed += 1
        for target, weight in outgoing[node]:
            column[target] = max(column[target], column[node] + weight)
            incoming[target] -= 1
            if incoming[target] == 0:
                ready.append(target)
    return column if placed == len(nodes) else None


# --------------------------------------------------------------------------- without running anything
REDUCERS = {
    "SUM": sum,
    "AVG": lambda column: sum(column) / len(column),
    "PRODUCT": lambda column: functools.reduce(lambda a, b: a * b, column),
    "MIN": min,
    "MAX": max,
}


def simulated_trace(
    op: str, values: list[list], *, root: int = 0, dst: int = 1, reduce_op: str = "SUM"
) -> Trace:
    """The trace ``op`` would leave on ``len(values)`` ranks whose inputs are ``values``.

    ``values[r]`` is rank r's input (a flat list). Ops that split their input (scatter at the
    root, reduce_scatter, all_to_all) cut it into one equal chunk per rank. For send/recv,
    ``root`` sends ``values[root]`` to ``dst``.
    """
    if op not in OPS:
        raise ValueError(f"unknown op {op!r}; expected one of {', '.join(TRACED_OPS)}")
    reduce_op = reduce_op.upper()
    if OPS[op].has_reduce_op and reduce_op not in REDUCERS:
        raise ValueError(f"unknown reduce op {reduce_op!r}; expected one of {', '.join(REDUCERS)}")
    world = len(values)
    group = tuple(range(world))
    for r in (root, dst) if op in ("send", "recv", "isend", "irecv") else (root,):
        if not 0 <= r < world:
            raise ValueError(f"rank {r} does not exist among {world} ranks")

    def chunks(flat: list) -> list[list]:
        if len(flat) % world:
            raise ValueError(f"{op}: {len(flat)} values do not split into {world} equal chunks")
        size = len(flat) // world
        return [list(flat[i * size : (i + 1) * size]) for i in range(world)]

    def reduced(lists: list[list]) -> list:
        return [REDUCERS[reduce_op](column) for column in zip(*lists)]

    before: dict[int, list[list]] = {r: [list(values[r])] for r in group}
    after: dict[int, list[list]] = {}
    if op in ("send", "isend", "recv", "irecv"):
        return _simulated_transfer(op, values, root, dst)
    if op == "broadcast":
        after = {r: [list(values[root])] for r in group}
    elif op == "reduce":
        after = {r: [reduced(values)] if r == root else None for r in group}  # others: unspecified
    elif op == "all_reduce":
        after = {r: [reduced(values)] for r in group}
    elif op == "gather":
        after = {r: [list(v) for v in values] if r == root else [] for r in group}
    elif op == "all_gather":
        after = {r: [list(v) for v in values] for r in group}
    elif op in ("all_gather_into_tensor", "all_gather_single"):
        after = {r: [[x for v in values for x in v]] for r in group}
    elif op == "scatter":
        before = {r: chunks(values[root]) if r == root else [] for r in group}
        after = {r: [chunks(values[root])[r]] for r in group}
    elif op in ("reduce_scatter", "reduce_scatter_tensor", "reduce_scatter_single"):
        split = [chunks(values[r]) for r in group]
        if op == "reduce_scatter":
            before = {r: split[r] for r in group}
        after = {r: [reduced([split[i][r] for i in group])] for r in group}
    elif op in ("all_to_all", "all_to_all_single"):
        split = [chunks(values[r]) for r in group]
        if op == "all_to_all":
            before = {r: split[r] for r in group}
            after = {r: [split[i][r] for i in group] for r in group}
        else:
            after = {r: [[x for i in group for x in split[i][r]]] for r in group}
    elif op == "barrier":
        before = after = {r: [] for r in group}
    spec = OPS[op]
    events = {
        r: [
            TraceEvent(
                rank=r,
                seq=1,
                op=op,
                group=group,
                group_name="simulated",
                root=root if spec.root else None,
                reduce_op=reduce_op if spec.has_reduce_op else None,
                before=tuple(_simulated_info(v) for v in before[r]),
                after=None if after[r] is None else tuple(_simulated_info(v) for v in after[r]),
                status=DONE,
            )
        ]
        for r in group
    }
    return Trace(events)


def _simulated_transfer(op: str, values: list[list], src: int, dst: int) -> Trace:
    if src == dst:
        raise ValueError(f"{op}: a rank cannot send to itself (rank {src})")
    asynchronous = op.startswith("i")
    send_op, recv_op = ("isend", "irecv") if asynchronous else ("send", "recv")
    data = _simulated_info(values[src])
    buffer = _simulated_info(values[dst]) if len(values[dst]) == len(values[src]) else data
    common = dict(seq=1, group=tuple(range(len(values))), group_name="simulated", status=DONE)
    events = {
        src: [TraceEvent(rank=src, op=send_op, peer=dst, before=(data,), after=(), **common)],
        dst: [TraceEvent(rank=dst, op=recv_op, peer=src, before=(buffer,), after=(data,), **common)],
    }
    return Trace(events)


def _simulated_info(values: list) -> TensorInfo:
    dtype = "float32" if any(isinstance(v, float) for v in values) else "int64"
    return TensorInfo((len(values),), dtype, tuple(values))
