"""Traces and diagrams of an op that is not run, computed from example inputs (for lessons)."""

from __future__ import annotations

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
