"""What an exercise's answer sent: the ``torch.distributed`` calls it made, for lessons 00-04 and 11-13.

    with watching() as calls:
        answer(...)
    calls.names()      # ["all_reduce"]
    calls[0].numel     # elements of the tensor it passed
    calls[0].group_size
    calls.numel("all_reduce")   # elements this rank put into all its all_reduce calls

``watching`` replaces every collective and point-to-point function in both ``torch.distributed`` and
``torch.distributed.distributed_c10d`` (torch calls itself through the second: ``all_gather_object`` calls
``all_gather`` there) by one that records the call, then runs the real one. A call's ``numel`` is what this
rank puts in: a tensor's elements, the sum over a list of tensors (``all_gather_coalesced``,
``all_reduce_coalesced``), an object's pickled bytes / 4 (``all_gather_object``), so no argument form
passes a big message as a small one. Calls made inside another
recorded call are not recorded again, so a learner's ``all_gather_object`` counts once. ``paused()`` stops the
recording for a helper the lesson gave (lesson 04's ``pass_right``), whose own calls are counted by the
checker as steps instead.
"""

from __future__ import annotations

import contextlib
import pickle
import threading
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

COLLECTIVES = (
    "all_reduce", "reduce", "broadcast", "all_gather", "all_gather_into_tensor", "all_gather_object",
    "gather", "gather_object", "scatter", "scatter_object_list", "broadcast_object_list", "reduce_scatter",
    "reduce_scatter_tensor", "all_to_all", "all_to_all_single", "barrier", "monitored_barrier",
    "all_gather_single", "reduce_scatter_single", "all_reduce_coalesced", "all_gather_coalesced",
)
POINT_TO_POINT = ("send", "recv", "isend", "irecv", "batch_isend_irecv", "send_object_list",
                  "recv_object_list")
_local = threading.local()


@dataclass
class Call:
    name: str
    numel: int  # elements this rank contributes (a list: the sum; objects: pickled bytes / 4)
    group_size: int  # ranks of the group it ran on
    peer: int | None = None  # a point-to-point call's dst or src (global rank); None: any, or a collective

    @property
    def collective(self) -> bool:
        return self.name in COLLECTIVES


class Calls(list):
    def names(self) -> list[str]:
        return [call.name for call in self]

    def collectives(self) -> list[Call]:
        return [call for call in self if call.collective]

    def point_to_point(self) -> list[Call]:
        return [call for call in self if not call.collective]

    def numel(self, *names: str) -> int:
        """Elements this rank contributed to the calls named (all calls when none is named)."""
        return sum(call.numel for call in self if not names or call.name in names)


INPUT_AT = {  # where a collective takes what this rank contributes, when that is not its first tensor
    "all_gather": (1, "tensor"),
    "all_gather_into_tensor": (1, "input_tensor"),
    "all_gather_single": (1, "input_tensor"),
    "all_gather_coalesced": (1, "input_tensor_list"),
    "reduce_scatter_single": (1, "input"),
    "reduce_scatter": (1, "input_list"),
    "reduce_scatter_tensor": (1, "input"),
    "all_to_all": (1, "input_tensor_list"),
    "all_to_all_single": (1, "input"),
}
OBJECTS_AT = {
    "all_gather_object": (1, "obj"),
    "gather_object": (0, "obj"),
    "send_object_list": (0, "object_list"),
    "broadcast_object_list": (0, "object_list"),
    "scatter_object_list": (1, "scatter_object_input_list"),
}


def _tensor_numel(value) -> int | None:
    if isinstance(value, torch.Tensor):
        return value.numel()
    if isinstance(value, (list, tuple)) and value and all(isinstance(v, torch.Tensor) for v in value):
        return sum(v.numel() for v in value)
    return None


def _numel(name, args, kwargs) -> int:
    """The elements this rank contributes to the call; for an object collective, its pickled bytes / 4."""
    if name in OBJECTS_AT:
        position, key = OBJECTS_AT[name]
        value = kwargs.get(key, args[position] if len(args) > position else None)
        try:
            return len(pickle.dumps(value)) // 4 + 1
        except Exception:
            return 0
    if name in INPUT_AT:
        position, key = INPUT_AT[name]
        value = kwargs.get(key, args[position] if len(args) > position else None)
        found = _tensor_numel(value)
        if found is not None:
            return found
    for value in list(args) + list(kwargs.values()):
        found = _tensor_numel(value)
        if found is not None:
            return found
    return 0


def _peer(name, args, kwargs):
    if name not in ("send", "recv", "isend", "irecv"):
        return None
    key = "dst" if name in ("send", "isend") else "src"
    if kwargs.get(key) is not None:
        return kwargs[key]
    if len(args) > 1 and isinstance(args[1], int):
        return args[1]
    group_key = "group_" + key
    if kwargs.get(group_key) is not None:
        try:
            return dist.get_global_rank(kwargs.get("group") or dist.group.WORLD, kwargs[group_key])
        except Exception:  # a group this rank cannot resolve: the call itself will say what is wrong
            return None
    return None


def _group_size(args, kwargs) -> int:
    group = kwargs.get("group")
    if group is None:
        group = next((value for value in args if isinstance(value, dist.ProcessGroup)), None)
    try:
        return dist.get_world_size(group)
    except Exception:  # a non-member's placeholder
        return -1


@contextlib.contextmanager
def watching():
    """Record every ``torch.distributed`` collective and point-to-point call made in the block."""
    calls = Calls()
    saved = {}
    for name in COLLECTIVES + POINT_TO_POINT:
        real = getattr(c10d, name, None)
        if real is None:
            continue

        def recorded(*args, _name=name, _real=real, **kwargs):
            if getattr(_local, "depth", 0) == 0:
                peer = _peer(_name, args, kwargs)
                calls.append(Call(_name, _numel(_name, args, kwargs), _group_size(args, kwargs), peer))
            _local.depth = getattr(_local, "depth", 0) + 1
            try:
                return _real(*args, **kwargs)
            finally:
                _local.depth -= 1

        saved[name] = (getattr(dist, name, None), real)
        for module in (dist, c10d):
            setattr(module, name, recorded)
    try:
        yield calls
    finally:
        for name, (public, real) in saved.items():
            if public is not None:
                setattr(dist, name, public)
            setattr(c10d, name, real)


@contextlib.contextmanager
def paused():
    """Inside ``watching``: calls made in this block are not recorded."""
    _local.depth = getattr(_local, "depth", 0) + 1
    try:
        yield
    finally:
        _local.depth -= 1


def agreed(result, group=None):
    """Every rank's verdict made one: ``True`` when every rank's check returned ``True``, else the first
    failing rank's message (prefixed by its rank), on every rank: an answer wrong on one rank is "not yet" on
    all of them."""
    mine = result if result is True or isinstance(result, str) else "not yet"
    everyone = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, mine, group=group)
    for rank, theirs in enumerate(everyone):
        if theirs is not True:
            return f"rank {rank}: {theirs}"
    return True
