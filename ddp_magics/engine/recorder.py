"""Recording torch.distributed calls on a rank (the engine side of tracing).

``start_trace`` wraps the communication functions of ``torch.distributed`` for the next cell
and unwraps them when that cell ends (IPython's ``post_execute``). Every call becomes a
:class:`~ddp_magics.protocol.TraceEvent` (plain, picklable data) kept in memory and published
to the notebook (a data message of the cell, ``TRACE_KEY``) when the cell ends. The events of a
cell that blocks in C code reach the notebook with the rank's stack, through
:mod:`ddp_magics.engine.inspector`. When tracing is off nothing is wrapped.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import itertools
import sys
import time
import weakref
from dataclasses import replace

from ddp_magics.protocol import (
    DEFAULT_VALUES_LIMIT,
    DONE,
    ERROR,
    OPS,
    RUNNING,
    TRACE_KEY,
    TRACED_OPS,
    WAIT,
    WAITING,
    OpSpec,
    TensorInfo,
    TraceEvent,
)


class Tracer:
    """Wraps torch.distributed's communication functions and records each call."""

    def __init__(self, values_limit: int) -> None:
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

    # ---------------------------------------------------------------- install / remove
    def install(self) -> None:
        # Wrapped all at once or not at all: a wrapper left behind would outlive the cell.
        wrappers = {
            name: self._wrap(name, getattr(self._dist, name))
            for name in TRACED_OPS
            if hasattr(self._dist, name)  # a torch older than 2.13 lacks its newest names
        }
        for name, wrapper in wrappers.items():
            self._originals[name] = wrapper.__wrapped__
            setattr(self._dist, name, wrapper)
        self.active = True

    def remove(self) -> None:
        for name, original in self._originals.items():
            setattr(self._dist, name, original)
        self._originals.clear()
        self.active = False
        # Let go of the cell's groups and tensors: a group the user deletes must really go
        # (destroying and re-forming the default group on the same port relies on it).
        self._groups.clear()
        self._known.clear()

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


def start_trace(values_limit: int = DEFAULT_VALUES_LIMIT) -> None:
    """Trace the calls of the next cell this engine executes (sent just before that cell)."""
    global _tracer
    from IPython import get_ipython

    if _tracer is not None and _tracer.active:
        _stop_trace()
    _tracer = Tracer(values_limit)
    _tracer.install()
    get_ipython().events.register("post_execute", _stop_trace)


def _stop_trace() -> None:
    from IPython import get_ipython

    events = get_ipython().events
    if _stop_trace in events.callbacks["post_execute"]:
        events.unregister("post_execute", _stop_trace)
    if _tracer is not None and _tracer.active:
        _tracer.remove()
        # Still inside the cell: the message belongs to it, and arrives before its end.
        get_ipython().data_pub.publish_data({TRACE_KEY: list(_tracer.events)})


def events_so_far() -> list[TraceEvent] | None:
    """The calls the running cell made so far, if it is traced (read from another thread)."""
    tracer = _tracer
    return list(tracer.events) if tracer is not None and tracer.active else None

