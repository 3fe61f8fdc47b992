"""NCCL at world size 1, the most one GPU allows it (skipped without CUDA, which is CI): what
changed since the NCCL path last ran, on one module cluster (``%dist_start -n 1``, auto: nccl).

- ``%dist_status`` shows each rank's CUDA memory (allocated and reserved) once the rank uses its GPU;
- ``--profile`` puts the rank's CUDA kernels on its lanes (compute on the device, the DDP bucket's
  ``c10d::allreduce_`` named as ``--trace`` names it); an NCCL all_reduce of one rank moves nothing,
  so no NCCL kernel is expected on the communication lane here (see test_gpu_nccl_shared_gpu.py);
- a rank that raises with an NCCL group formed: the cell's error, no release (no other rank), and
  the next cell's NCCL all_reduce works;
- ``dist.shrink_group``: the NCCL backend says it supports shrinking, and a group of one rank is
  refused (shrinking needs two ranks: test_gpu_nccl_shared_gpu.py shrinks one)."""

from __future__ import annotations

import json

import pytest
import torch

from ddp_magics.errors import DistributedCellError
from ddp_magics.protocol import COMMUNICATION, COMPUTE, LAUNCH
from tests.conftest import run_cell, shown_text, started_cluster

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

MIB = 1 << 20


def on_ranks(ip, code: str, line: str = "") -> str:
    captured, error = run_cell(ip, line, code)
    assert error is None, shown_text(captured) + captured.stdout + str(error)
    return shown_text(captured)


@pytest.fixture(scope="module")
def nccl_one(ip):
    with started_cluster(ip, "-n 1") as (magics, started):
        assert "ranks ready: backend nccl" in started, started
        yield magics


def test_dist_status_shows_the_ranks_cuda_memory(ip, nccl_one):
    on_ranks(ip, f"big = torch.empty({256 * MIB}, dtype=torch.uint8, device=device)")
    table = ip.run_line_magic("dist_status", "")
    text = repr(table)
    print(text)
    assert "cuda allocated" in text and "cuda reserved" in text, text
    columns, rows = table._shown()
    row = dict(zip(columns, rows[0]))
    assert row["device"] == "cuda:0", row
    assert row["cuda allocated"] in ("256.0 MiB", "256.1 MiB"), row  # the one tensor (and NCCL's few bytes)
    reserved = row["cuda reserved"]
    assert reserved.endswith(("MiB", "GiB")) and reserved != "?", row
    assert "<th>cuda allocated</th>" in table._repr_html_()
    on_ranks(ip, "del big\ntorch.cuda.empty_cache()")
    _, rows = ip.run_line_magic("dist_status", "")._shown()
    assert dict(zip(columns, rows[0]))["cuda allocated"] in ("0.0 MiB", "0.1 MiB"), rows


DDP_ON_CUDA = """\
import torch.nn as nn
torch.manual_seed(0)
model = nn.Sequential(*[nn.Linear(256, 256) for _ in range(4)]).to(device)
ddp = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=0.1)
x = torch.randn(64, 256, device=device)
for _ in range(3):
    ddp(x).pow(2).mean().backward()
torch.cuda.synchronize()
print(round(float(model[0].weight.grad.sum()), 4))
"""


def test_profile_puts_cuda_kernels_on_the_lanes(ip, nccl_one, tmp_path):
    captured, error = run_cell(ip, "--profile prof", DDP_ON_CUDA)
    assert error is None, error
    profile = ip.user_ns["prof"]
    print(profile.text())
    assert profile.ranks == [0] and not profile.missing
    spans = profile.spans[0]
    on_gpu = [s for s in spans if s.device == "cuda"]
    kinds = sorted({(s.kind, s.device) for s in spans})
    print("kinds of spans:", kinds)
    print("cuda kernels:", sorted({s.name for s in on_gpu})[:12])
    print("cuda communication:", sorted({s.name for s in on_gpu if s.kind == COMMUNICATION}))
    assert any(s.kind == COMPUTE for s in on_gpu), kinds
    launches = [s for s in spans if s.kind == LAUNCH and s.name == "c10d::allreduce_"]
    print("c10d::allreduce_ launches:", [s.label for s in launches])
    assert all("DDP bucket" in (s.label or "") for s in launches), launches
    row = profile.summary()[0]
    assert row["compute"] > 0, row
    assert row["wall"] > 0
    text = captured.stdout + shown_text(captured)
    assert "Profile of rank 0" in text, text
    diagram = profile.draw()
    assert diagram.figure.axes
    saved = profile.save(tmp_path / "profile.json")
    trace = json.loads(saved.read_text())
    threads = [e["args"]["name"] for e in trace["traceEvents"] if e.get("name") == "thread_name"]
    print("threads:", threads)
    assert any(name.startswith("cuda ") for name in threads), threads


def test_a_raise_with_an_nccl_group_leaves_the_rank_working(ip, nccl_one):
    nccl_one.error_grace = 1.0
    try:
        _, error = run_cell(
            ip,
            "",
            "t = torch.ones(2, device=device)\nif rank == 0:\n    raise ValueError('bad input')\n"
            "dist.all_reduce(t)",
        )
    finally:
        nccl_one.error_grace = 5.0
    assert isinstance(error, DistributedCellError), error
    print(error)
    assert str(error).startswith("rank 0 raised ValueError: bad input"), str(error)
    assert "released" not in str(error), str(error)
    shown = on_ranks(ip, "w = torch.full((2,), 3.0, device=device)\ndist.all_reduce(w)\nprint(w.tolist())")
    assert shown == "[rank 0]\n[3.0, 3.0]", shown


def test_shrink_group_on_nccl_at_world_size_one(ip, nccl_one):
    if not hasattr(torch.distributed, "shrink_group"):
        pytest.skip(f"torch {torch.__version__} has no dist.shrink_group")
    shown = on_ranks(
        ip,
        "backend = dist.group.WORLD._get_backend(torch.device('cuda'))\n"
        "print(type(backend).__name__, bool(getattr(backend, 'supports_shrinking', False)))\n"
        "try:\n    dist.shrink_group([0])\nexcept ValueError as error:\n    print('refused:', error)\n",
    )
    print(shown)
    assert "ProcessGroupNCCL True" in shown, shown
    assert "refused: " in shown, shown  # torch 2.13: "Cannot shrink a process group with size 1"
