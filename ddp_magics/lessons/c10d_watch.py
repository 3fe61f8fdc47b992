"""Every c10d operation a block of code ran, however it was called: what the lessons' checkers count.

    from ddp_magics.lessons.c10d_watch import c10d_watch

    with c10d_watch() as ops:
        answer(x)
    ops.names()              # ["allreduce_"]
    ops[0].numel             # elements this rank put in (a list of tensors: the sum)
    ops[0].nbytes, ops[0].group_size, ops[0].out_numel
    ops[0].kind              # "all_reduce", whichever op it was ("allreduce_", functional "all_reduce")
    ops.count("all_reduce")  # how many ops of that kind (or with that name) ran
    ops.numel("all_to_all")  # elements this rank put into them

Why not patch ``torch.distributed``: a learner who writes ``from torch.distributed import all_reduce``,
calls ``distributed_c10d.all_reduce``, a ``ProcessGroup`` method (``group.allreduce([t])``) or a functional
collective (``torch.distributed._functional_collectives``) never goes through a patched attribute. All of
them end in one dispatcher op: ``distributed_c10d.all_reduce`` calls ``group.allreduce([tensor], opts)``
(torch/distributed/distributed_c10d.py:3245), and ``ProcessGroup::allreduce`` calls the op
``c10d::allreduce_`` (torch/include/torch/csrc/distributed/c10d/ProcessGroup.hpp:246; the other methods
below it likewise: ``c10d::allgather_``, ``_allgather_base_``, ``reduce_scatter_``, ``_reduce_scatter_base_``,
``alltoall_base_``, ``broadcast_``, ``send``, ``recv_``, ...). The functional collectives are ops of their
own (``_c10d_functional::all_reduce``, ``all_gather_into_tensor``, ``reduce_scatter_tensor``,
``all_to_all_single``, ``broadcast``, and ``_c10d_functional_autograd::all_to_all_single``). A
``TorchDispatchMode`` sees every one of these ops, as ``torch.distributed.tensor.debug.CommDebugMode`` does;
this one records each with its sizes. An op run inside another (a functional op's own process-group call)
is not seen twice: a mode is off while it handles an op. A DTensor is let through to its own dispatch first
(as ``CommDebugMode`` does), so the collectives it makes to redistribute itself are recorded as plain ops.

``numel`` is what this rank contributes: the input of a gather, a scatter or an all-to-all, the tensor(s)
reduced, broadcast, sent or received otherwise; ``out_numel`` the output buffer where it differs (a
gather's whole result). ``group_size`` is the size of the group the op ran on.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

NAMESPACES = ("c10d", "_c10d_functional", "_c10d_functional_autograd", "c10d_functional")
# c10d ops whose first argument is the output and whose second is this rank's input
OUTPUT_FIRST = {
    "allgather_", "_allgather_base_", "allgather_coalesced_", "allgather_into_tensor_coalesced_",
    "reduce_scatter_", "_reduce_scatter_base_", "reduce_scatter_tensor_coalesced_", "alltoall_base_",
    "alltoall_", "gather_", "scatter_",
}
# what each op is, whichever way it was called: the names a checker can count by
KIND = {
    "allreduce_": "all_reduce", "allreduce_coalesced_": "all_reduce", "all_reduce": "all_reduce",
    "all_reduce_coalesced": "all_reduce", "all_reduce_": "all_reduce",
    "allgather_": "all_gather", "_allgather_base_": "all_gather", "allgather_coalesced_": "all_gather",
    "allgather_into_tensor_coalesced_": "all_gather", "all_gather_into_tensor": "all_gather",
    "all_gather_into_tensor_coalesced": "all_gather", "all_gather_into_tensor_out": "all_gather",
    "reduce_scatter_": "reduce_scatter", "_reduce_scatter_base_": "reduce_scatter",
    "reduce_scatter_tensor_coalesced_": "reduce_scatter", "reduce_scatter_tensor": "reduce_scatter",
    "reduce_scatter_tensor_coalesced": "reduce_scatter",
    "alltoall_": "all_to_all", "alltoall_base_": "all_to_all", "all_to_all_single": "all_to_all",
    "broadcast_": "broadcast", "broadcast": "broadcast", "reduce_": "reduce", "gather_": "gather",
    "scatter_": "scatter", "send": "send", "recv_": "recv", "recv_any_source_": "recv", "barrier": "barrier",
    "monitored_barrier_": "barrier",
}
NOT_COMMUNICATION = {"wait_tensor", "wait", "_wrap_tensor_autograd"}


@dataclass(frozen=True)
class C10dOp:
    name: str  # the op's name in its namespace: "allreduce_", "_allgather_base_", "all_to_all_single", ...
    namespace: str  # "c10d" (what torch.distributed and ProcessGroup methods call) or "_c10d_functional..."
    numel: int  # elements this rank put in (lists summed)
    nbytes: int  # their bytes
    out_numel: int  # elements of the output buffer (equal to numel for an op that works in place)
    group_size: int  # ranks in the group it ran on (0 when not found)

    @property
    def kind(self) -> str:
        """``all_reduce``, ``all_gather``, ``reduce_scatter``, ``all_to_all``, ``broadcast``, ``send``..."""
        return KIND.get(self.name, self.name)

    @property
    def functional(self) -> bool:
        return self.namespace != "c10d"


class C10dOps(list):
    """The ops recorded, in the order they ran."""

    def names(self) -> list[str]:
        return [op.name for op in self]

    def kinds(self) -> list[str]:
        return [op.kind for op in self]

    def of(self, *names: str) -> C10dOps:
        """The ops whose name or kind is one of ``names`` (all ops when none is named)."""
        return C10dOps(op for op in self if not names or op.name in names or op.kind in names)

    def count(self, *names: str) -> int:
        """How many ops ran whose name or kind is one of ``names`` (all ops when none is named)."""
        return len(self.of(*names))

    def numel(self, *names: str) -> int:
        """Elements this rank put into the ops named (by name or kind; all ops when none is named)."""
        return sum(op.numel for op in self.of(*names))

    def nbytes(self, *names: str) -> int:
        return sum(op.nbytes for op in self.of(*names))


def _tensors(value) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [tensor for item in value for tensor in _tensors(item)]
    return []


def _group_size(args, kwargs) -> int:
    import torch.distributed.distributed_c10d as c10d

    for value in (*args, *kwargs.values()):
        if isinstance(value, c10d.ProcessGroup):
            return value.size()
        if isinstance(value, torch.ScriptObject) and "ProcessGroup" in str(value._type()):
            return c10d.ProcessGroup.unbox(value).size()  # what the c10d ops are given
    for value in (*args, *kwargs.values()):  # functional ops name their group
        if isinstance(value, str):
            try:
                return c10d._resolve_process_group(value).size()
            except Exception:  # a string that is not a group name
                continue
    return 0


def _record(func, args, kwargs) -> C10dOp | None:
    namespace = getattr(func, "namespace", "")
    name = func._schema.name.split("::")[-1] if hasattr(func, "_schema") else str(func)
    if namespace not in NAMESPACES or name in NOT_COMMUNICATION:
        return None
    values = list(args) + list(kwargs.values())
    if namespace == "c10d" and name in OUTPUT_FIRST:
        inputs, outputs = _tensors(values[1:2]), _tensors(values[:1])
    else:
        inputs = outputs = _tensors(values[:1])
    return C10dOp(
        name=name,
        namespace=namespace,
        numel=sum(t.numel() for t in inputs),
        nbytes=sum(t.numel() * t.element_size() for t in inputs),
        out_numel=sum(t.numel() for t in outputs),
        group_size=_group_size(args, kwargs),
    )


class _Watch(TorchDispatchMode):
    def __init__(self, ops: C10dOps):
        super().__init__()
        self.ops = ops

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if isinstance(func, torch._ops.HigherOrderOperator):
            return func(*args, **kwargs)
        if any(issubclass(kind, DTensor) for kind in types):
            return NotImplemented  # a DTensor runs first; the collectives it makes come back here
        if any(issubclass(kind, FakeTensor) for kind in types):
            return func(*args, **kwargs)  # DTensor's sharding propagation, on no data: no communication
        op = _record(func, args, kwargs)
        if op is not None:
            self.ops.append(op)
        return func(*args, **kwargs)


@contextlib.contextmanager
def c10d_watch() -> Iterator[C10dOps]:
    """Record every c10d and functional-collective op run in the block (see the module's docstring)."""
    ops = C10dOps()
    with _Watch(ops):
        yield ops
