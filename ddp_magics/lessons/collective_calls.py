"""The ``torch.distributed`` collectives an answer calls: what the lessons' checkers use to judge a method.

``recorded_collectives()`` replaces the functions of ``torch.distributed`` (the names a learner calls) for
the time of a ``with`` block and records each call as ``(name, elements of its first tensor)``: the tensor
reduced or broadcast, or the *output* of a gather or a scatter (``all_gather_single(output, input)``).
torch's old names call their new ones through ``distributed_c10d``'s module globals, which stay as they
are, so each call is recorded once.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.distributed as dist

WATCHED = (
    "all_reduce",
    "broadcast",
    "all_gather",
    "all_gather_single",
    "all_gather_into_tensor",
    "all_gather_object",
    "reduce_scatter",
    "reduce_scatter_single",
    "reduce_scatter_tensor",
    "reduce",
    "all_reduce_coalesced",
    "all_to_all",
    "all_to_all_single",
    "gather",
    "scatter",
    "send",
    "recv",
    "isend",
    "irecv",
    "barrier",
)


@contextlib.contextmanager
def recorded_collectives(names: tuple[str, ...] = WATCHED) -> Iterator[list[tuple[str, int]]]:
    """Each call of ``torch.distributed.<name>`` in the block: ``(name, elements of its first tensor)``."""
    real = {name: getattr(dist, name) for name in names if hasattr(dist, name)}
    calls: list[tuple[str, int]] = []

    def recorder(name):
        def call(*args, **kwargs):
            first = args[0] if args else next(iter(kwargs.values()), None)
            calls.append((name, first.numel() if isinstance(first, torch.Tensor) else 0))
            return real[name](*args, **kwargs)

        return call

    for name in real:
        setattr(dist, name, recorder(name))
    try:
        yield calls
    finally:
        for name, function in real.items():
            setattr(dist, name, function)
