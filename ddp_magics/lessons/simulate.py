"""Traces and diagrams of an op that is not run, computed from example inputs (for lessons)."""

from __future__ import annotations

import contextlib
import functools

from ddp_magics.diagrams import Diagram, Trace, draw_step
from ddp_magics.protocol import DONE, OPS, TRACED_OPS, TensorInfo, TraceEvent

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


def draw_op(op: str, values: list[list], *, root: int = 0, dst: int = 1, reduce_op: str = "SUM") -> Diagram:
    """The picture of ``op`` on ``len(values)`` ranks whose inputs are ``values`` (nothing runs).

    ``draw_op("all_reduce", [[1.0], [2.0]])``; for ``send``, rank ``root`` sends to ``dst``.
    """
    return draw_step(simulated_trace(op, values, root=root, dst=dst, reduce_op=reduce_op), 1)


# --------------------------------------------------------------------------- an answer on pretend ranks
class _Stop(Exception):
    """Raised inside the answer at its all_reduce, on the first pass: its input is all that pass wanted."""


def _reduced(tensors, op):
    import torch
    import torch.distributed as dist

    stacked = torch.stack(tensors)
    if op is None or op == dist.ReduceOp.SUM:
        return stacked.sum(0)
    if op == dist.ReduceOp.PRODUCT:
        return stacked.prod(0)
    if op == dist.ReduceOp.MIN:
        return stacked.amin(0)
    if op == dist.ReduceOp.MAX:
        return stacked.amax(0)
    for name, combine in (("BAND", "bitwise_and"), ("BOR", "bitwise_or"), ("BXOR", "bitwise_xor")):
        if op == getattr(dist.ReduceOp, name):
            return functools.reduce(getattr(torch, combine), tensors)
    raise ValueError(f"reduce op {op} is not simulated")


def on_pretend_ranks(answer, inputs: list, namespace: dict) -> list:
    """``answer(inputs[r])`` as each rank ``r`` of a pretend world of ``len(inputs)`` ranks, all in this one
    process, for an answer whose only communication is one ``dist.all_reduce``; the list of its results.

    While it runs, ``rank`` and ``world_size`` in ``namespace`` (the cell's globals) and ``dist.get_rank``,
    ``dist.get_world_size`` say which pretend rank it is, and ``dist.all_reduce`` answers with what every
    pretend rank gave it: a first pass collects each rank's input to the call (and stops the answer there), a
    second gives each rank the reduced tensor and lets the answer finish. So a checker tries world sizes the
    cluster does not have. Raises ``ValueError`` if the answer made no all_reduce or more than one; whatever
    the answer raises goes up.
    """
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    world = len(inputs)
    names = ("all_reduce", "get_rank", "get_world_size")
    saved_functions = {name: (getattr(dist, name), getattr(c10d, name)) for name in names}
    saved_names = {name: namespace[name] for name in ("rank", "world_size") if name in namespace}
    contributions, result, me = [], None, [0]
    state = {"pass": 1, "calls": 0}

    def all_reduce(tensor, op=None, group=None, async_op=False):
        state["calls"] += 1
        if state["calls"] > 1:
            raise ValueError("more than one all_reduce")
        if state["pass"] == 1:
            contributions.append(tensor.detach().clone())
            state["op"] = op
            raise _Stop
        tensor.copy_(result)
        return _Done() if async_op else None

    def install(r):
        me[0] = r
        namespace["rank"], namespace["world_size"] = r, world
        for module in (dist, c10d):
            module.all_reduce = all_reduce
            module.get_rank = lambda group=None: me[0]
            module.get_world_size = lambda group=None: world

    try:
        for r in range(world):
            install(r)
            state["calls"] = 0
            with contextlib.suppress(_Stop):
                answer(inputs[r])
            if state["calls"] == 0:
                raise ValueError("no all_reduce")
        if len({tuple(c.shape) for c in contributions}) != 1:
            raise ValueError("the ranks' all_reduce tensors differ in shape")
        result = _reduced(contributions, state.get("op"))
        state["pass"] = 2
        results = []
        for r in range(world):
            install(r)
            state["calls"] = 0
            results.append(answer(inputs[r]))
        return results
    finally:
        for name, (public, inner) in saved_functions.items():
            setattr(dist, name, public)
            setattr(c10d, name, inner)
        namespace.update(saved_names)


class _Done:
    def wait(self, *args, **kwargs):
        return True

    def is_completed(self):
        return True


def pretend_problem(answer, trials, namespace: dict) -> str | None:
    """What goes wrong when ``answer`` runs as every rank of the pretend worlds in ``trials`` (see
    ``on_pretend_ranks``), or None. ``trials`` holds pairs ``(inputs, judge)``: ``judge(inputs, results)``
    returns None when the results are right, else what is wrong with them."""
    for inputs, judge in trials:
        try:
            got = on_pretend_ranks(answer, inputs, namespace)
        except Exception as error:
            return f"as {len(inputs)} pretend ranks it raised {type(error).__name__}: {error}"
        if problem := judge(inputs, got):
            return f"as {len(inputs)} pretend ranks: {problem}"
    return None
