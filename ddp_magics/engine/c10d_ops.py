"""The ``c10d::`` ops that tracing records, and reading their arguments.

:data:`C10D_OPS` says, for each op the tracer registers a kernel for, where its arguments are;
the functions here read the ones that are not tensors (the handle an op returns, its reduce op).
"""

from __future__ import annotations

import contextlib
from typing import NamedTuple


class C10dOp(NamedTuple):
    """Where a ``c10d::`` op's arguments are (positions in its schema, torch 2.13)."""

    op: str  # the trace's name for it (the torch.distributed function that makes it)
    group: int
    inputs: int | None = None  # a tensor, a list of tensors or a list of lists
    outputs: int | None = None
    reduce_op: int | None = None
    root: int | None = None  # a rank of the group
    peer: int | None = None  # a rank of the group
    tag: int | None = None
    async_op: int | None = None  # the caller asked for a handle (None: the op has no such flag)

    @property
    def primary_in_outputs(self) -> bool:
        """Its shape to compare across the group is its output's (a reduce-scatter's)."""
        return self.op in ("reduce_scatter", "reduce_scatter_tensor")


C10D_OPS: dict[str, C10dOp] = {
    "allreduce_": C10dOp("all_reduce", 1, inputs=0, outputs=0, reduce_op=2, async_op=4),
    "allreduce_coalesced_": C10dOp("all_reduce", 1, inputs=0, outputs=0, reduce_op=2, async_op=3),
    "broadcast_": C10dOp("broadcast", 1, inputs=0, outputs=0, root=2, async_op=4),
    "reduce_": C10dOp("reduce", 1, inputs=0, outputs=0, reduce_op=2, root=3, async_op=5),
    "allgather_": C10dOp("all_gather", 2, inputs=1, outputs=0, async_op=3),
    "allgather_coalesced_": C10dOp("all_gather", 2, inputs=1, outputs=0, async_op=3),
    "_allgather_base_": C10dOp("all_gather_into_tensor", 2, inputs=1, outputs=0, async_op=3),
    "allgather_into_tensor_coalesced_": C10dOp("all_gather_into_tensor", 2, inputs=1, outputs=0, async_op=3),
    "gather_": C10dOp("gather", 2, inputs=1, outputs=0, root=3, async_op=4),
    "scatter_": C10dOp("scatter", 2, inputs=1, outputs=0, root=3, async_op=4),
    "reduce_scatter_": C10dOp("reduce_scatter", 2, inputs=1, outputs=0, reduce_op=3, async_op=4),
    "_reduce_scatter_base_": C10dOp("reduce_scatter_tensor", 2, inputs=1, outputs=0, reduce_op=3, async_op=4),
    "reduce_scatter_tensor_coalesced_": C10dOp(
        "reduce_scatter_tensor", 2, inputs=1, outputs=0, reduce_op=3, async_op=4
    ),
    "alltoall_": C10dOp("all_to_all", 2, inputs=1, outputs=0, async_op=3),
    "alltoall_base_": C10dOp("all_to_all_single", 2, inputs=1, outputs=0, async_op=5),
    "barrier": C10dOp("barrier", 1, async_op=3),
    "monitored_barrier_": C10dOp("barrier", 1),
    "send": C10dOp("isend", 1, inputs=0, peer=2, tag=3),
    "recv_": C10dOp("irecv", 1, inputs=0, outputs=0, peer=2, tag=3),
    "recv_any_source_": C10dOp("irecv", 1, inputs=0, outputs=0, tag=2),
}
# torch.distributed functions named in a trace for the op they make, where the names differ.
API_OPS = {
    "send": "isend",  # blocking: the trace says send, and no wait of its own
    "recv": "irecv",
    "all_gather_single": "all_gather_into_tensor",
    "reduce_scatter_single": "reduce_scatter_tensor",
}

_REDUCE_OP_NAMES: dict = {}


def work_of(work_type, handle):
    """The ``Work`` a c10d op returned, or None if it returned none (a backend that finished the
    call before returning, as NCCL does for a blocking call)."""
    try:
        return work_type.unbox(handle)
    except RuntimeError:  # an empty handle
        return None


def reduce_op_name(dist, reduce_op) -> str:
    """The name of a ``ReduceOp`` as the dispatcher passes it (a TorchScript object whose
    ``op()`` is the number of its ``RedOpType``)."""
    number = reduce_op.op()
    name = _REDUCE_OP_NAMES.get(number)
    if name is None:
        with contextlib.suppress(ValueError):
            name = dist.ReduceOp.RedOpType(number).name
        name = _REDUCE_OP_NAMES[number] = name or str(number)
    return name
