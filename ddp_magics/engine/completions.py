"""When a traced call is over, and its tensors read at that moment (tracing's values).

A call's ``after`` is what its output tensors hold when the call completes, not later: a library
reuses its buffers (DDP's gradient bucket is refilled by the next backward, FSDP frees and
refills its gathered parameters), and the cell may change a result in place. So a call's outputs
are read:

- at its wait from Python (``work.wait()``, also the one inside a blocking
  ``torch.distributed`` function): :meth:`Completions.complete`;
- for a library's call waited for in C++ (DDP's reducer, functional collectives), as soon as
  Python runs again after it completed: at the next traced call, at the functional collectives'
  ``wait_tensor`` (its kernel calls :meth:`Completions.settle`), and for calls made during a
  backward pass, in a final callback of that backward (queued twice over, so that it runs after
  the library's own: DDP's reducer waits for its buckets in its callback, then copies them to the
  gradients; its bucket is refilled only by the next backward's gradients);
- at the cell's end, for what is left (:meth:`Completions.finish`).

Not a completion callback on the work's future: that would run Python on the backend's thread,
which then waits for the GIL while the cell runs Python, and reads a buffer racing with the
library that waited for it.
"""

from __future__ import annotations

import time

from ddp_magics.protocol import DONE, OPS, RUNNING, WAITING, TraceEvent

UNFINISHED_GRACE_SECONDS = 0.1  # at the cell's end, for all of its libraries' futures together
UNFINISHED_POLL_SECONDS = 0.001


class Completions:
    """The cell's calls whose handles are not finished yet, and reading their outputs."""

    def __init__(self, torch, tensors) -> None:
        self._torch = torch
        self._tensors = tensors
        # id(work) -> (work, its event, the call's output tensors): handles not finished yet.
        self.pending: dict[int, tuple[object, TraceEvent, tuple]] = {}
        self._library: dict[int, tuple[object, TraceEvent, tuple, object]] = {}  # ... with a future
        self._futures: dict[int, object] = {}  # id(work) -> its future (None: it has none)
        self._unread: list[tuple[TraceEvent, tuple]] = []  # finished, seen from another thread
        self._graph_tasks: set[int] = set()  # backward passes with a callback of ours queued

    def follow(self, work, event: TraceEvent, outputs) -> None:
        """Keep the call's handle: its wait (or, for a library's call, its future) ends it."""
        self.pending[id(work)] = (work, event, outputs)
        if event.made_by is None:
            if event.async_op:
                event.status = WAITING
            return
        future = self._future(work)
        if future is not None:
            self._library[id(work)] = (work, event, outputs, future)
            self._after_backward()

    def finished(self, work) -> None:
        """The handle was waited for (its outputs are read by :meth:`complete`)."""
        self.pending.pop(id(work), None)
        self._library.pop(id(work), None)

    def complete(self, event: TraceEvent, outputs) -> None:
        """The call is over: what its outputs hold now is its ``after``."""
        before = event.before
        if before and OPS[event.op].in_place and not any(info.values for info in before):
            event.after = event.before  # same tensors, too large to keep values: nothing new
        else:
            event.after = self._tensors.describe(outputs)
        event.end = time.time()
        event.status = DONE

    def settle(self, read: bool = True) -> int:
        """Read the library calls finished since last asked; how many are not yet. ``read``
        False: another thread's look (a hang report's), which marks them done, read later."""
        if read and self._unread:
            for event, outputs in self._unread:
                if event.after is None:
                    event.after = self._tensors.describe(outputs)
            self._unread.clear()
        if not self._library:
            return 0
        unfinished = 0
        for key, (work, event, outputs, future) in list(self._library.items()):
            if event.status != RUNNING:
                self._library.pop(key, None)
            elif work.is_completed() or future.done():
                self._library.pop(key, None)
                self.pending.pop(key, None)
                if read:
                    self.complete(event, outputs)
                else:
                    event.status, event.end = DONE, time.time()
                    self._unread.append((event, outputs))
            else:
                unfinished += 1
        return unfinished

    def finish(self) -> None:
        """At the cell's end: a library's call whose handle nobody waited on in Python, if
        finished, is read now; one that is not (an async result the cell never used) is left as
        never waited on, its results unknown; one whose handle cannot tell is left done with its
        results unknown. The backend completes a future on its own thread, a little after the
        library that waited for its result (DDP's reducer) went on: so it gets a moment to."""
        deadline = time.monotonic() + UNFINISHED_GRACE_SECONDS
        while self.settle() and time.monotonic() < deadline:
            time.sleep(UNFINISHED_POLL_SECONDS)
        for key, (_, event, _) in self.pending.items():
            if event.status != RUNNING or event.made_by is None:
                continue
            if key in self._library:
                event.status = WAITING
            else:  # no way to tell (gloo's reduce-scatter never says it completed): results unknown
                event.status, event.end = DONE, time.time()
        for event, outputs in self._unread:
            if event.after is None:
                event.after = self._tensors.describe(outputs)

    def clear(self) -> None:
        """Let go of the cell's handles and tensors."""
        self.pending.clear()
        self._library.clear()
        self._futures.clear()
        self._unread.clear()
        self._graph_tasks.clear()

    def _future(self, work):
        """The handle's future; None if its backend has none (gloo's send, recv, reduce-scatter)."""
        if id(work) not in self._futures:
            try:
                self._futures[id(work)] = work.get_future()
            except RuntimeError:  # "not implemented"
                self._futures[id(work)] = None
        return self._futures[id(work)]

    def _after_backward(self) -> None:
        """In a backward pass: settle once it is over, after the library's own final callbacks
        (a callback queued by a callback runs after those queued before it)."""
        torch = self._torch
        graph_task = torch._C._current_graph_task_id()
        if graph_task == -1 or graph_task in self._graph_tasks:
            return
        self._graph_tasks.add(graph_task)
        engine = torch.autograd.Variable._execution_engine

        def then_settle() -> None:
            engine.queue_callback(self._settle_after_backward)

        try:
            engine.queue_callback(then_settle)
        except RuntimeError:  # not in this thread's backward after all: read at the next call
            self._graph_tasks.discard(graph_task)

    def _settle_after_backward(self) -> None:
        # On the backward's thread (the cell's, on CPU; while the cell waits in backward()).
        self.settle()
