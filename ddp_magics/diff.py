"""``%dist_diff``: where the ranks' values of one expression agree and where they differ, as
lines of text (what nbval compares), every rank measured against the lowest one."""

from __future__ import annotations

from ddp_magics.protocol import DTensorLeaf, ValueSnapshot, rank_label

EXPECTED = "differ as expected"


def describe_differences(expression: str, snapshots: dict[int, ValueSnapshot]) -> list[str]:
    ranks = sorted(snapshots)
    reference = ranks[0]
    kind = "/".join(sorted({snapshot.type_name for snapshot in snapshots.values()}))
    lines = [f"{expression} ({kind}) on {rank_label(ranks)}, each compared with rank {reference}:"]
    paths = list(dict.fromkeys(path for rank in ranks for path in snapshots[rank].leaves))
    width = max((len(path) for path in paths), default=0)
    differing = sharded = 0
    for path in paths:
        same, verdict = _compare_leaf({rank: snapshots[rank].leaves.get(path, _MISSING) for rank in ranks})
        differing += not same
        sharded += same and EXPECTED in verdict
        lines.append(f"  {path:<{width}}  {verdict}")
    if len(paths) > 1:
        expected = f" ({sharded} sharded: their local shards {EXPECTED})" if sharded else ""
        if differing:
            lines.append(f"{differing} of {len(paths)} entries differ{expected}.")
        else:
            lines.append(f"All entries agree{expected}." if sharded else "All entries equal.")
    return lines


class _Missing:
    def __repr__(self) -> str:
        return "(missing)"


_MISSING = _Missing()


def _compare_leaf(values: dict[int, object]) -> tuple[bool, str]:
    """Whether every rank's value equals the lowest rank's, and the words that say how."""
    import torch

    ranks = list(values)
    reference = values[ranks[0]]
    if all(isinstance(value, torch.Tensor) for value in values.values()):
        return _compare_tensors(values)
    if all(isinstance(value, DTensorLeaf) for value in values.values()):
        return _compare_dtensors(values)
    different = [rank for rank in ranks[1:] if not _same(values[rank], reference)]
    if not different:
        return True, f"equal: {_short(reference)}"
    shown = ", ".join(f"rank {rank} {_short(values[rank])}" for rank in [ranks[0], *different])
    return False, f"differs on {rank_label(different)}: {shown}"


def _compare_tensors(values: dict) -> tuple[bool, str]:
    ranks = list(values)
    reference = values[ranks[0]]
    header = f"tensor {tuple(reference.shape)} {str(reference.dtype).removeprefix('torch.')}"
    other_shapes = {rank: tuple(t.shape) for rank, t in values.items() if t.shape != reference.shape}
    if other_shapes:
        shown = ", ".join(f"rank {rank} {shape}" for rank, shape in other_shapes.items())
        return False, f"{header}  shape differs on {rank_label(list(other_shapes))}: {shown}"
    differences = []
    for rank in ranks[1:]:
        tensor = values[rank]
        if tensor.dtype != reference.dtype:
            differences.append(f"rank {rank} is {str(tensor.dtype).removeprefix('torch.')}")
            continue
        unequal = tensor != reference
        if tensor.is_floating_point() or tensor.is_complex():
            unequal &= ~(tensor.isnan() & reference.isnan())
        if not bool(unequal.any()):
            continue
        first = [int(i) for i in unequal.nonzero()[0]]
        if tensor.is_floating_point() or tensor.is_complex():
            gap = (tensor.double() - reference.double()).abs()[unequal].max().item()
            differences.append(f"rank {rank}: max |a-b| {gap:.3g}, first at {first}")
        else:
            differences.append(f"rank {rank}: first at {first}")
    if not differences:
        return True, f"{header}  equal"
    return False, f"{header}  differs ({'; '.join(differences)})"


def _compare_dtensors(values: dict[int, DTensorLeaf]) -> tuple[bool, str]:
    """DTensors: the layout must agree; ranks that hold the same part (the same place on every
    mesh dimension that is not replicated) must hold equal local tensors; the parts of a
    sharded or partial layout differ, as they should."""
    ranks = list(values)
    reference = values[ranks[0]]
    dtype = str(reference.local.dtype).removeprefix("torch.")
    header = f"DTensor {reference.shape} {dtype} [{reference.layout()}]"
    layout = (reference.shape, reference.placements, reference.mesh_shape)
    other = [
        rank
        for rank in ranks[1:]
        if (values[rank].shape, values[rank].placements, values[rank].mesh_shape) != layout
    ]
    if other:
        shown = ", ".join(f"rank {rank} {values[rank].shape} [{values[rank].layout()}]" for rank in other)
        return False, f"{header}  layout differs on {rank_label(other)}: {shown}"
    replicas: dict[tuple, list[int]] = {}
    for rank in ranks:
        replicas.setdefault(values[rank].replica_key(), []).append(rank)
    differences = []
    for members in replicas.values():
        if len(members) > 1:
            same, verdict = _compare_tensors({rank: values[rank].local for rank in members})
            if not same:
                differences.append(verdict.partition("  ")[2])
    if differences:
        return False, f"{header}  replicas {'; '.join(differences)}"
    split = [placement for placement in reference.placements if placement != "Replicate()"]
    if not split:
        return True, f"{header}  equal"
    kind = "sharded" if any(placement.startswith("Shard") for placement in split) else "partial"
    note = f"{kind} ({', '.join(split)}): local shards {EXPECTED}"
    if any(len(members) > 1 for members in replicas.values()):
        note += ", replicas equal"
    return True, f"{header}  {note}"


def _same(a, b) -> bool:
    try:
        return bool(a == b) and type(a) is type(b)
    except Exception:  # a value whose == raises or is ambiguous: compare the reprs
        return repr(a) == repr(b)


def _short(value, limit: int = 40) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
