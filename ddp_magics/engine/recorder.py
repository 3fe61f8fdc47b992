"""Recording what a rank's process groups do (the engine side of tracing).

Every call into a process group, whoever makes it, goes through PyTorch's dispatcher as a
``c10d::`` op: ``dist.all_reduce`` from a cell, DDP's reducer from C++ during backward, the
functional collectives of DTensor, FSDP2, pipelining's batched sends. ``start_trace`` registers,
for the next cell only, a kernel of ours for each of these ops on the dispatcher's
``BackendSelect`` key, which every call passes (inference tensors too); it records the call and
hands it on, unchanged, to the backend's kernel. The user's own ``work.wait()`` on a handle is
seen by replacing ``Work.wait`` for the cell (the handle the op returns is the object its caller
gets). Nothing of ``torch.distributed`` is replaced, so code that holds its functions
(``from torch.distributed import all_reduce``, ``P2POp(dist.isend, ...)``) runs as untraced.

Every call becomes a :class:`~ddp_magics.protocol.TraceEvent` (plain, picklable data) kept in
memory and published to the notebook (a data message of the cell, ``TRACE_KEY``) when the cell
ends (IPython's ``post_execute``). A call made by a library is labelled with who made it
(``DDP bucket 0``, ``DTensor``, ``broadcast_object_list``) and placed at the user's line that
led to it (``loss.backward()``), both read from its frames (:mod:`ddp_magics.engine.call_sites`).
A call's values are its tensors at the moment it completes (:mod:`ddp_magics.engine.completions`),
not later, when a library may have reused its buffer.
The events of a cell that blocks in C code reach the notebook with the rank's stack, through
:mod:`ddp_magics.engine.inspector`. The ops traced are listed in :mod:`ddp_magics.engine.c10d_ops`,
and their tensors described by :mod:`ddp_magics.engine.tensors`.

Why not a ``TorchDispatchMode`` (as ``CommDebugMode`` is): it runs Python for every tensor op of
the cell, which made a small DDP training step 1.7 times slower here; these kernels run only for
the process groups' own calls.
"""

from __future__ import annotations

import re
import sys
import threading
import time

from ddp_magics.engine.c10d_ops import API_OPS, C10D_OPS, C10dOp, reduce_op_name, work_of
from ddp_magics.engine.call_sites import CallSites
from ddp_magics.engine.completions import Completions
from ddp_magics.engine.tensors import TensorDescriptions, first_tensor
from ddp_magics.protocol import (
    DEFAULT_VALUES_LIMIT,
    DONE,
    ERROR,
    OPS,
    TRACE_KEY,
    WAIT,
    TraceEvent,
)

UNNAMED_MESH_DIM = re.compile(r"mesh_dim_\d+")


class Tracer:
    """Records every call into this rank's process groups while installed."""

    def __init__(self, values_limit: int) -> None:
        import torch
        import torch.distributed as dist

        self._torch = torch
        self._dist = dist
        self.rank = dist.get_rank()
        self.events: list[TraceEvent] = []
        self.active = False
        self._calls = 0  # the seq of the last event
        self._kernel_code = None  # of the kernels' function (found on a stack by it)
        self._in_flight: tuple | None = None  # (spec, args, start, before, thread) of a call in the backend
        self._library = None
        self._original_wait = None
        self._groups: dict[int, tuple[object, tuple[int, ...], str]] = {}
        self._tensors = TensorDescriptions(torch, values_limit)
        self._completions = Completions(torch, self._tensors)
        self._call_sites = CallSites(torch)
        self._unnamed_reduce_ops: list[tuple[TraceEvent, object]] = []  # (event, its ReduceOp)

    # ---------------------------------------------------------------- install / remove
    def install(self) -> None:
        torch = self._torch
        work_type = self._dist.distributed_c10d.Work
        # Everything registered at once or nothing: a kernel left behind would outlive the cell.
        library = torch.library.Library("c10d", "IMPL")
        functional = torch.library.Library("_c10d_functional", "IMPL")
        try:
            for name, spec in C10D_OPS.items():
                if torch._C._dispatch_has_kernel(f"c10d::{name}"):  # an older torch may lack one
                    library.impl(name, self._kernel(name, spec), "BackendSelect", with_keyset=True)
            if torch._C._dispatch_has_kernel("_c10d_functional::wait_tensor"):
                functional.impl("wait_tensor", self._wait_tensor_kernel(), "BackendSelect", with_keyset=True)
        except BaseException:
            library._destroy()
            functional._destroy()
            raise
        self._library = (library, functional)
        original = self._original_wait = work_type.wait
        pending = self._completions.pending
        tracer = self

        def wait(work, *args, **kwargs):
            entry = pending.get(id(work))
            if entry is None:  # not a handle of this cell's calls, or one finished already
                return original(work, *args, **kwargs)
            return tracer._wait(original, work, entry, args, kwargs)

        work_type.wait = wait
        self.active = True

    def remove(self) -> None:
        if self._library is not None:
            # torch.library drops a registration when the Library is garbage collected; this
            # drops it now (there is no public way to).
            for library in self._library:
                library._destroy()
            self._library = None
        if self._original_wait is not None:
            self._dist.distributed_c10d.Work.wait = self._original_wait
            self._original_wait = None
        self.active = False
        self._completions.finish()
        self.name_reduce_ops()
        # Let go of the cell's groups, handles and tensors: a group the user deletes must really
        # go (destroying and re-forming the default group on the same port relies on it).
        self._completions.clear()
        self._groups.clear()
        self._tensors.clear()
        self._call_sites.forget_paths()

    def events_with_in_flight(self) -> list[TraceEvent]:
        """The events so far and, if a thread is inside a call (blocked in the backend:
        a first NCCL call creating its communicator, monitored_barrier), that call's."""
        self._completions.settle(read=False)
        events = list(self.events)
        in_flight = self._in_flight
        if in_flight is None:
            return events
        spec, args, started, before, thread = in_flight
        frame = sys._current_frames().get(thread)
        while frame is not None and frame.f_code is not self._kernel_code:  # our kernel's frame
            frame = frame.f_back
        if frame is not None:  # its caller: none on a thread with no Python (the autograd engine's)
            try:
                events.append(self._event(spec, args, started, before, frame.f_back, in_flight=True))
            except Exception as error:  # a report without it rather than none
                _say_recording_failed(error)
        return events

    def name_reduce_ops(self) -> None:
        """Name the reduce ops of the calls recorded so far (also from another thread)."""
        unnamed = self._unnamed_reduce_ops
        while unnamed:
            event, reduce_op = unnamed.pop()
            event.reduce_op = reduce_op_name(self._dist, reduce_op)

    # ---------------------------------------------------------------- recording
    def _kernel(self, name: str, spec: C10dOp):
        torch = self._torch
        op = getattr(torch.ops.c10d, name).default
        below = torch._C._dispatch_keyset_full_after(torch._C.DispatchKey.BackendSelect)
        work_type = self._dist.distributed_c10d.Work
        script_object = torch.ScriptObject

        def traced(keyset, *args, **kwargs):
            keys = keyset & below  # what the dispatcher would have done next
            # Only what the call may change is read before it; the rest is recorded once the
            # backend has the call, while it communicates (measured: that time is hidden).
            started = time.time()
            try:
                self._completions.settle()  # a library's calls finished since: read before reuse
                before = self._tensors.describe(args[spec.inputs]) if spec.inputs is not None else ()
            except Exception as error:  # a bug of ours must not change what the cell does
                return _recording_failed(error, op, keys, args, kwargs)
            self._in_flight = (spec, args, started, before, threading.get_ident())  # for a hang report
            try:
                result = op.redispatch(keys, *args, **kwargs)
            except BaseException as error:
                self._in_flight = None
                try:
                    self._fail(self._record(spec, args, started, before)[0], error)
                except Exception as recording_error:  # the cell gets its own error either way
                    _say_recording_failed(recording_error)
                raise
            self._in_flight = None
            try:
                event, outputs = self._record(spec, args, started, before)
                handle = result[-1] if isinstance(result, tuple) and result else result
                work = work_of(work_type, handle) if isinstance(handle, script_object) else None
                if work is not None:
                    self._completions.follow(work, event, outputs)
                else:  # over already: monitored_barrier, or a backend that waited in C++ (NCCL)
                    self._completions.complete(event, outputs)
            except Exception as error:
                _say_recording_failed(error)
            return result

        self._kernel_code = traced.__code__  # the same for every op's kernel
        return traced

    def _record(self, spec: C10dOp, args: tuple, started: float, before: tuple) -> tuple[TraceEvent, tuple]:
        """The call as an event, added to the cell's (made on the thread that made the call)."""
        # _record <- traced <- its caller: none on a thread with no Python (the autograd engine's).
        event = self._event(spec, args, started, before, sys._getframe(1).f_back)
        self._calls = event.seq
        self.events.append(event)
        return event, (args[spec.outputs] if spec.outputs is not None else ())

    def _event(
        self, spec: C10dOp, args: tuple, started: float, before: tuple, caller, in_flight: bool = False
    ) -> TraceEvent:
        """The event of a call. ``in_flight``: one still inside the backend, seen from another
        thread (a hang report's), to be made again on the calling thread when it returns."""
        frames, site = self._call_sites.find(caller)
        api = site.api
        if api is not None and API_OPS.get(api, api) != spec.op:
            api = None  # not the op this function makes: some other path to it
        op = api or spec.op
        group = self._group(self._dist.ProcessGroup.unbox(args[spec.group]))
        inputs = args[spec.inputs] if spec.inputs is not None else ()
        made_by = self._call_sites.maker(site, spec, frames, count=not in_flight)
        if made_by is not None and spec.op == "irecv":
            before = ()  # a library's receive buffer, made for it: what it held says nothing
        event = TraceEvent(
            self.rank,
            self._calls + 1,
            op,
            group[1],
            group[2],
            tag=args[spec.tag] if spec.tag is not None else 0,
            before=before,
            line=site.line(frames),
            made_by=made_by,
            start=started,
            mesh_dim=group[3] if group[3] != "default" else None,
            backend=group[4],
        )
        if api is not None and spec.async_op is not None:
            # The dispatcher leaves out trailing arguments equal to their default (True here).
            event.async_op = bool(args[spec.async_op]) if len(args) > spec.async_op else True
        elif api is not None:
            event.async_op = op not in API_OPS
        if spec.peer is not None:
            event.peer = group[1][args[spec.peer]]
        if spec.root is not None:
            event.root = group[1][args[spec.root]]
        if spec.reduce_op is not None and in_flight:
            event.reduce_op = reduce_op_name(self._dist, args[spec.reduce_op])
        elif spec.reduce_op is not None:  # named later: reading a ReduceOp costs more than this call
            self._unnamed_reduce_ops.append((event, args[spec.reduce_op]))
        if OPS[op].primary:
            tensor_type = self._torch.Tensor
            first = None if spec.primary_in_outputs else first_tensor(inputs, tensor_type)
            if first is None and spec.outputs is not None:
                first = first_tensor(args[spec.outputs], tensor_type)
            if first is not None:
                event.primary = self._tensors.known(first)[1]
        return event

    def _wait_tensor_kernel(self):
        """The functional collectives' wait (DTensor's, in C++): their calls finished are read."""
        torch = self._torch
        op = torch.ops._c10d_functional.wait_tensor.default
        below = torch._C._dispatch_keyset_full_after(torch._C.DispatchKey.BackendSelect)
        completions = self._completions

        def traced_wait(keyset, *args, **kwargs):
            result = op.redispatch(keyset & below, *args, **kwargs)
            try:
                completions.settle()
            except Exception as error:
                _say_recording_failed(error)
            return result

        return traced_wait

    def _wait(self, original, work, pending: tuple, args: tuple, kwargs: dict):
        _, event, outputs = pending
        wait_event = None
        caller = sys._getframe(2) if event.async_op else None  # _wait <- wait <- the caller
        if caller is not None and not caller.f_globals.get("__name__", "").startswith("torch."):  # the cell's
            frames, site = self._call_sites.find(caller)
            self._calls += 1
            wait_event = TraceEvent(
                self.rank,
                self._calls,
                WAIT,
                event.group,
                event.group_name,
                peer=event.peer,
                root=event.root,
                tag=event.tag,
                waits_for=event.seq,
                waited_op=event.op,
                line=site.line(frames),
                start=time.time(),
            )
            self.events.append(wait_event)
        try:
            result = original(work, *args, **kwargs)
        except BaseException as error:
            if wait_event is not None:
                self._fail(wait_event, error)
            self._fail(event, error)
            raise
        if event.peer is None and event.op in ("recv", "irecv"):  # from any source
            event.peer = event.group[work._source_rank()]
        self._completions.finished(work)
        self._completions.complete(event, outputs)
        if wait_event is not None:
            wait_event.after, wait_event.end, wait_event.status = (), time.time(), DONE
        return result

    def _fail(self, event: TraceEvent, error: BaseException) -> None:
        message = str(error).strip().splitlines()
        event.error = type(error).__name__ + (f": {message[0]}" if message else "")
        event.end = time.time()
        event.status = ERROR

    def _group(self, group) -> tuple[object, tuple[int, ...], str, str | None, str]:
        """(group, its global ranks in group-rank order, its name, its DeviceMesh dimension's
        name if a mesh made it, its backend), cached."""
        entry = self._groups.get(id(group))
        if entry is None:
            ranks = tuple(self._dist.get_process_group_ranks(group))
            # DeviceMesh describes each dimension's group as mesh_<name> (mesh_tp, mesh_dp), or as
            # mesh_dim_<n> where its dimensions have no names (nothing to show then).
            description = getattr(group, "group_desc", "") or ""
            named = description.startswith("mesh_") and not UNNAMED_MESH_DIM.fullmatch(description)
            mesh_dim = description.removeprefix("mesh_") if named else None
            # The group object is kept in the entry so that its id is not reused while cached.
            backend = str(self._dist.get_backend(group))
            entry = self._groups[id(group)] = (group, ranks, group.group_name, mesh_dim, backend)
        return entry


def _recording_failed(error: Exception, op, keys, args, kwargs):
    """The call made as if untraced, after saying on the rank's stderr what failed."""
    _say_recording_failed(error)
    return op.redispatch(keys, *args, **kwargs)


def _say_recording_failed(error: Exception) -> None:
    print(f"ddp_magics: tracing could not record a call ({type(error).__name__}: {error})", file=sys.stderr)


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
    if tracer is None or not tracer.active:
        return None
    tracer.name_reduce_ops()
    return tracer.events_with_in_flight()
