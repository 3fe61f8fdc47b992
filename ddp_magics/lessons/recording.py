"""What a learner's answer sent: the torch.distributed collectives a call made, for lessons 05-09's checkers.

Each collective of ``torch.distributed.distributed_c10d`` is replaced, for the duration of one call, by a
wrapper that notes its name and the number of values it was given, then calls the real one. Both the module
and ``torch.distributed`` (which re-exports the same functions) are patched, so ``dist.all_reduce`` and
``torch.distributed.distributed_c10d.all_reduce`` are both seen.
"""

from __future__ import annotations

from collections.abc import Callable

COLLECTIVES = (
    "all_reduce",
    "all_gather",
    "all_gather_into_tensor",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "broadcast",
    "reduce",
    "gather",
    "scatter",
    "all_to_all",
    "all_to_all_single",
    "all_reduce_coalesced",
    "all_gather_object",
    "broadcast_object_list",
    "gather_object",
)


def _size(tensor) -> int:
    if isinstance(tensor, (list, tuple)):
        return sum(_size(t) for t in tensor)
    return tensor.numel() if hasattr(tensor, "numel") else 0


def recorded_collectives(fn: Callable, *args, **kwargs) -> list[tuple[str, int]]:
    """Run ``fn(*args, **kwargs)``; every collective it called, in order, as ``(name, number of values)``
    (for the object collectives the number of values is 0)."""
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    calls: list[tuple[str, int]] = []
    real = {name: getattr(c10d, name) for name in COLLECTIVES if hasattr(c10d, name)}

    def recording(name: str) -> Callable:
        def call(first, *rest, **more):
            calls.append((name, _size(first)))
            return real[name](first, *rest, **more)

        return call

    for name in real:
        setattr(c10d, name, recording(name))
        setattr(dist, name, recording(name))
    try:
        fn(*args, **kwargs)
    finally:
        for name, function in real.items():
            setattr(c10d, name, function)
            setattr(dist, name, function)
    return calls
