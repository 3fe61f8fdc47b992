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


def _size(tensor, in_bytes: bool = False) -> int:
    if isinstance(tensor, (list, tuple)):
        return sum(_size(t, in_bytes) for t in tensor)
    if not hasattr(tensor, "numel"):
        return 0
    return tensor.numel() * (tensor.element_size() if in_bytes else 1)


def recorded_collectives(fn: Callable, *args, **kwargs) -> list[tuple[str, int]]:
    """Run ``fn(*args, **kwargs)``; every collective it called, in order, as ``(name, number of values)``
    (for the object collectives the number of values is 0)."""
    return [(call["name"], call["values"]) for call in recorded_calls(fn, *args, **kwargs)]


def recorded_calls(fn: Callable, *args, **kwargs) -> list[dict]:
    """Run ``fn(*args, **kwargs)``; every collective it called, in order, as a dict: ``name``, ``values``
    (the number of values of its first argument), ``bytes`` and ``caller`` (the module of the code that
    called it: a learner's cell, or one of torch's own modules)."""
    import sys

    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    calls: list[dict] = []
    real = {name: getattr(c10d, name) for name in COLLECTIVES if hasattr(c10d, name)}

    def recording(name: str) -> Callable:
        def call(first, *rest, **more):
            caller = sys._getframe(1).f_globals.get("__name__", "")
            calls.append({"name": name, "values": _size(first), "bytes": _size(first, True),
                          "caller": caller})
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
