"""Two gloo ranks sharing the one GPU, their tensors on it (skipped without CUDA, which is CI): the
paths that changed since the NCCL path last ran and that need two ranks, which NCCL refuses on
one GPU.

- a rank that raises while the other waits in an all_reduce of CUDA tensors: the waiting rank is
  released in the same cell, its CUDA tensors kept, and the next cell's all_reduce works;
- ``--profile`` with CUDA tensors: the ranks' CUDA kernels on the device lanes, and gloo's
  all-reduces (on gloo's CPU threads, staged through host memory) still counted as communication;
- ``%dist_status``: each rank's CUDA memory."""

from __future__ import annotations

import pytest
import torch

from ddp_magics.errors import DistributedCellError
from ddp_magics.protocol import COMMUNICATION, COMPUTE
from tests.conftest import run_cell, shown_text

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

MIB = 1 << 20


def on_ranks(ip, code: str, line: str = "") -> str:
    captured, error = run_cell(ip, line, code)
    assert error is None, shown_text(captured) + captured.stdout + str(error)
    return shown_text(captured)


def test_a_rank_waiting_on_cuda_tensors_is_released_after_the_other_raised(ip, healthy):
    on_ranks(ip, "mine = torch.arange(3.0, device='cuda') + rank\nbefore = mine.clone()")
    healthy.error_grace = 1.0
    try:
        _, error = run_cell(
            ip,
            "",
            "t = torch.ones(4, device='cuda')\nif rank == 1:\n    raise ValueError('rank 1 gave up')\n"
            "dist.all_reduce(t)",
        )
    finally:
        healthy.error_grace = 5.0
    assert isinstance(error, DistributedCellError), error
    print(error)
    assert str(error) == (
        "rank 1 raised ValueError: rank 1 gave up; rank 0 was waiting in all_reduce at cell line 4 and was "
        "released (state kept, new process group)"
    ), str(error)
    shown = on_ranks(
        ip,
        "print(mine.device, torch.equal(mine, before))\nv = torch.ones(2, device='cuda')\n"
        "dist.all_reduce(v)\nprint(v.tolist())",
    )
    assert shown == "[ranks 0,1]\ncuda:0 True\n[2.0, 2.0]", shown


DDP_ON_CUDA = """\
import torch.nn as nn
torch.manual_seed(0)
model = nn.Sequential(*[nn.Linear(256, 256) for _ in range(4)]).to('cuda')
ddp = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=0.1)
x = torch.randn(64, 256, device='cuda') + rank
for _ in range(3):
    ddp(x).pow(2).mean().backward()
torch.cuda.synchronize()
"""


def test_profile_of_gloo_on_cuda_tensors(ip, healthy):
    _, error = run_cell(ip, "--profile prof", DDP_ON_CUDA)
    assert error is None, error
    profile = ip.user_ns["prof"]
    print(profile.text())
    assert profile.ranks == [0, 1] and not profile.missing
    for rank in (0, 1):
        spans = profile.spans[rank]
        print(f"rank {rank} kinds:", sorted({(s.kind, s.device) for s in spans}))
        assert any(s.kind == COMPUTE and s.device == "cuda" for s in spans), "no CUDA kernel on the lanes"
        gloo = [s for s in spans if s.kind == COMMUNICATION and s.name.startswith("gloo:")]
        assert gloo and any("DDP bucket" in (s.label or "") for s in gloo), gloo[:3]
        row = profile.summary()[rank]
        print(f"rank {rank} summary:", {k: v for k, v in row.items() if k != "top_ops"})
        # gloo moves the data on its CPU threads even for CUDA tensors: that time is the rank's
        # communication, also when its compute is on the GPU.
        assert row["communication"] > 0, "gloo's all-reduces left out of the communication lane"


def cuda_allocated(ip) -> dict[int, float]:
    """Each rank's ``cuda allocated`` of %dist_status, in MiB (as shown, to 0.1 MiB)."""
    table = ip.run_line_magic("dist_status", "")
    print(repr(table))
    columns, rows = table._shown()
    shown = {int(row[0]): dict(zip(columns, row))["cuda allocated"] for row in rows}
    return {
        rank: float(text.split()[0]) * (1024 if text.endswith("GiB") else 1) for rank, text in shown.items()
    }


def test_dist_status_shows_each_ranks_cuda_memory(ip, healthy):
    on_ranks(ip, "torch.ones(1, device='cuda')")  # CUDA in use on both ranks
    before = cuda_allocated(ip)
    on_ranks(ip, f"block = torch.empty({64 * MIB} * (rank + 1), dtype=torch.uint8, device='cuda')")
    after = cuda_allocated(ip)
    grown = {rank: round(after[rank] - before[rank]) for rank in after}
    assert grown == {0: 64, 1: 128}, (before, after)
    on_ranks(ip, "del block\ntorch.cuda.empty_cache()")
