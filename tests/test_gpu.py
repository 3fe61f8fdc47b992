"""The CUDA and NCCL paths, on a machine with a GPU (skipped elsewhere, which is CI): one NCCL
rank per GPU with CUDA tensors traced, %dist_recover's NCCL abort keeping CUDA state, a rank
stuck on the GPU refused in one line then restarted, and two gloo ranks sharing the GPU whose
hang over CUDA tensors is recovered with state kept."""

from __future__ import annotations

import json

import psutil
import pytest
import torch
from IPython.core.error import UsageError
from IPython.utils.capture import capture_output
from jupyter_client.manager import start_new_kernel

from ddp_magics.errors import DistributedCellError
from tests.conftest import assert_gone, current_magics, run_cell, shown_text
from tests.test_debugging import run_with_answers

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

KEPT_AND_WORKING = """\
print({name}.device, torch.equal({name}, before))
v = torch.ones(1, device={device})
dist.all_reduce(v)
print(v.item())
"""
MISMATCHED = """\
t = torch.ones(3, device='cuda')
if rank == 0:
    dist.all_reduce(t)
else:
    dist.broadcast(t, 0)
"""


def on_ranks(ip, code: str, line: str = "") -> str:
    captured, error = run_cell(ip, line, code)
    assert error is None, shown_text(captured) + str(error)
    return shown_text(captured)


def line_magic(ip, name: str, line: str = "") -> str:
    with capture_output() as captured:
        ip.run_line_magic(name, line)
    return captured.stdout


@pytest.fixture
def stopped_afterwards(ip):
    yield
    magics = current_magics(ip)
    processes = magics.cluster.processes() if magics.cluster else []
    line_magic(ip, "dist_stop")
    assert_gone(processes)


def test_nccl_rank_per_gpu_traced_recovered_and_restarted(ip, stopped_afterwards):
    """auto picks NCCL with one rank per visible GPU; a CUDA all_reduce is traced; %dist_recover
    aborts the NCCL communicator and forms a new group, the CUDA tensor kept; then a restart."""
    gpus = torch.cuda.device_count()
    started = line_magic(ip, "dist_start")
    assert f"{gpus} ranks ready: backend nccl" in started, started
    shown = on_ranks(
        ip, "t = torch.arange(4.0, device=device) + rank\ndist.all_reduce(t)\nprint(t.device, t.sum().item())"
    )
    expected = sum(4 * rank + 6 for rank in range(gpus))
    for rank in range(gpus):
        assert f"[rank {rank}]\ncuda:{rank} {float(expected)}" in shown, shown

    _, error = run_cell(ip, "--diagram --trace tr", "u = torch.ones(3, device=device)\ndist.all_reduce(u)")
    assert error is None, error
    trace = ip.user_ns["tr"]
    assert [step.op for step in trace.steps] == ["all_reduce"], trace.text()
    assert trace.complete and not trace.mismatches
    print(trace.text())

    on_ranks(ip, "before = t.clone()")
    report = line_magic(ip, "dist_recover")
    assert "Recovered: a new nccl process group" in report, report
    shown = on_ranks(ip, KEPT_AND_WORKING.format(name="t", device="device"))
    for rank in range(gpus):
        assert f"[rank {rank}]\ncuda:{rank} True\n{float(gpus)}" in shown, shown

    assert "ranks ready" in line_magic(ip, "dist_restart")
    assert f"{float(gpus)}" in on_ranks(
        ip, "w = torch.ones(1, device=device)\ndist.all_reduce(w)\nprint(w.item())"
    )


def test_a_rank_stuck_on_the_gpu_is_refused_in_one_line_then_restarted(ip, stopped_afterwards):
    """A kernel that spins for a minute and a synchronize waiting for it: the hang report, then
    %dist_recover says in one line that the rank cannot be stopped (it is in C code, where no
    signal handler runs), and %dist_restart gives working ranks."""
    line_magic(ip, "dist_start", "-n 1")
    on_ranks(ip, "kept = torch.ones(2, device=device)")
    _, error = run_cell(ip, "--timeout 2", "torch.cuda._sleep(200_000_000_000)\ntorch.cuda.synchronize()")
    assert isinstance(error, DistributedCellError) and "still running after 2 s" in str(error), error
    print(error)
    with pytest.raises(UsageError, match=r"did not stop within .* %dist_restart") as refused:
        line_magic(ip, "dist_recover")
    print(refused.value)
    assert "ranks ready" in line_magic(ip, "dist_restart")
    assert "[rank 0]\n2.0" in on_ranks(ip, "print(torch.ones(2, device=device).sum().item())")


def test_gloo_ranks_sharing_the_gpu_recover_from_a_hang_over_cuda_tensors(ip, stopped_afterwards):
    """Two gloo ranks with CUDA tensors (both on the one GPU): mismatched collectives hang, the
    report comes, %dist_recover brings both back with their CUDA tensors and a working group."""
    line_magic(ip, "dist_start", "-n 2 --backend gloo")
    on_ranks(ip, "kept = torch.arange(3.0, device='cuda') + rank\nbefore = kept.clone()")
    _, error = run_cell(ip, "--timeout 3", MISMATCHED)
    assert isinstance(error, DistributedCellError) and "still running after 3 s" in str(error), error
    print(error)
    report = line_magic(ip, "dist_recover")
    assert "Recovered: a new gloo process group" in report, report
    shown = on_ranks(ip, KEPT_AND_WORKING.format(name="kept", device="'cuda'"))
    assert shown == "[ranks 0,1]\ncuda:0 True\n2.0", shown


BREAKING = """\
%%distributed --timeout 2
t = torch.full((2,), rank + 1.0, device='cuda')
if rank == 1:
    breakpoint()
dist.all_reduce(t)
print(t.tolist())
"""


def test_breakpoint_on_a_rank_holding_cuda_tensors_is_answered_in_the_front_end():
    """In a real kernel with two gloo ranks on the GPU: rank 1 stops, ``p`` shows its CUDA
    tensor, ``c`` lets both finish the all_reduce."""
    manager, client = start_new_kernel(kernel_name="python3")
    processes = []
    try:
        start = (
            "%load_ext ddp_magics\n%dist_start -n 2 --backend gloo\n"
            "m = next(m for m in get_ipython().configurables if type(m).__name__ == 'DistributedMagics')\n"
            "import json; print(json.dumps([p.pid for p in m.cluster.processes()]))"
        )
        outputs = []
        reply = client.execute_interactive(start, timeout=120, output_hook=outputs.append)
        assert reply["content"]["status"] == "ok", reply["content"]
        texts = "".join(m["content"]["text"] for m in outputs if m["msg_type"] == "stream")
        processes = [psutil.Process(pid) for pid in json.loads(texts.strip().splitlines()[-1])]
        status, prompts, text, _ = run_with_answers(client, BREAKING, ["p t", "p t.device", "c"])
        print(text)
        assert status == "ok", text
        assert prompts == ["(Pdb rank 1) "] * 3
        assert "tensor([2., 2.], device='cuda:0')" in text and "cuda:0" in text
        assert "[3.0, 3.0]" in text
    finally:
        client.stop_channels()
        manager.shutdown_kernel(now=True)
    assert_gone(processes)


DDP_ON_THE_GPU = """\
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
model = DDP(nn.Linear(8, 4).to(device))
for step in range(2):
    model(torch.ones(2, 8, device=device)).sum().backward()
print(model.module.weight.grad.device)
"""


@pytest.mark.parametrize("backend", ["nccl", "gloo"])
def test_ddp_on_cuda_tensors_is_traced_from_the_autograd_engines_thread(ip, stopped_afterwards, backend):
    """Backward of CUDA tensors runs on the autograd engine's own thread, where DDP's reducer
    makes its all-reduce: still recorded, labelled, and placed at the cell's line."""
    line_magic(ip, "dist_start", "" if backend == "nccl" else "-n 2 --backend gloo")
    cell = DDP_ON_THE_GPU if backend == "nccl" else DDP_ON_THE_GPU.replace("(device)", "('cuda')")
    cell = cell.replace("device=device", "device='cuda'")
    captured, error = run_cell(ip, "--trace tr", cell)
    assert error is None, error
    assert "cuda:0" in shown_text(captured)
    trace = ip.user_ns["tr"]
    print(trace.text())
    made = [(step.op, step.events[0].made_by, step.events[0].line) for step in trace.steps]
    assert ("broadcast", "DDP construction", 3) in made
    assert made.count(("all_reduce", "DDP bucket 0", 5)) == 2
    assert trace.complete and not trace.mismatches
