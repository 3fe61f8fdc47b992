"""A traced call's tensors described as :class:`~ddp_magics.protocol.TensorInfo`: shape, dtype
and, for a tensor small enough, its values."""

from __future__ import annotations

import weakref

from ddp_magics.protocol import TensorInfo


class TensorDescriptions:
    """Describes tensors for one cell's trace, each tensor once (see :meth:`known`)."""

    def __init__(self, torch, values_limit: int) -> None:
        self._torch = torch
        self.values_limit = values_limit
        self._known: dict[int, tuple] = {}  # id -> (weak reference, TensorInfo without values, small)

    def describe(self, value) -> tuple[TensorInfo, ...]:
        """The tensors in a tensor or in (nested) lists and tuples of them; () if none."""
        tensor_type = self._torch.Tensor
        if isinstance(value, tensor_type):
            return (self.info(value),)
        if isinstance(value, list) and len(value) == 1 and isinstance(value[0], tensor_type):
            return (self.info(value[0]),)  # the usual case, made short
        if isinstance(value, (list, tuple)):
            return tuple(info for item in value for info in self.describe(item))
        return ()

    def known(self, tensor) -> tuple:
        """(tensor, TensorInfo without values, small enough for values), cached.

        Reading a tensor's shape and dtype costs more than the rest of a traced call, so a tensor
        communicated again (a gradient bucket, a reused buffer) is described once per cell; the
        weak reference tells a new tensor that got an old id. (A tensor resized in place between
        two calls of one cell keeps its first shape in the trace.)
        """
        known = self._known.get(id(tensor))
        if known is None or known[0]() is not tensor:
            small = tensor.numel() <= self.values_limit
            known = (weakref.ref(tensor), TensorInfo(tuple(tensor.shape), dtype_name(tensor)), small)
            self._known[id(tensor)] = known
        return known

    def info(self, tensor) -> TensorInfo:
        known = self.known(tensor)
        if known[2]:
            return known[1]._replace(values=tuple(tensor.detach().reshape(-1).tolist()))
        return known[1]

    def clear(self) -> None:
        """Let go of the tensors described so far."""
        self._known.clear()


def first_tensor(value, tensor_type):
    """The first tensor in a tensor or in (nested) lists and tuples of them; None if none."""
    if isinstance(value, tensor_type):
        return value
    if isinstance(value, list) and value and isinstance(value[0], tensor_type):
        return value[0]  # the usual case, made short
    if isinstance(value, (list, tuple)):
        for item in value:
            found = first_tensor(item, tensor_type)
            if found is not None:
                return found
    return None


_DTYPE_NAMES: dict = {}


def dtype_name(tensor) -> str:
    dtype = tensor.dtype
    name = _DTYPE_NAMES.get(dtype)
    if name is None:
        name = _DTYPE_NAMES[dtype] = str(dtype).removeprefix("torch.")
    return name
