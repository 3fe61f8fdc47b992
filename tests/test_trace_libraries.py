"""Tracing what libraries make the process group do (DDP, DTensor tensor parallel, pipelining),
on real gloo clusters of 2 and 4 ranks: each cell traced shows the calls the group really
made, labelled with their maker and placed at the user's line, and gives the same results as
the same cell untraced; a DDP cell where one rank skips backward() is reported in DDP's
all-reduce, with the rank that never joined."""

from __future__ import annotations

import pytest
from IPython.utils.capture import capture_output

from ddp_magics.errors import DistributedCellError
from tests.conftest import run_cell, running_cluster, shown_text

DDP_CELL = """\
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
torch.manual_seed(0)
model = DDP(nn.Sequential(nn.Linear(16, 64), nn.Linear(64, 4)), bucket_cap_mb=0.001)
for step in range(3):
    loss = model(torch.randn(8, 16) + rank).sum()
    loss.backward()
print(round(model.module[0].weight.grad.sum().item(), 3))
"""

TP_CELL = """\
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import parallelize_module, ColwiseParallel, RowwiseParallel
mesh = init_device_mesh("cpu", (world_size,))
torch.manual_seed(0)
mlp = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8))
tp = parallelize_module(mlp, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
out = tp(torch.ones(4, 8))
out.sum().backward()
print(round(out.sum().item(), 3), round(mlp[0].weight.grad.to_local().sum().item(), 3))
"""

PIPELINE_CELL = """\
import torch.nn as nn
from torch.distributed.pipelining import PipelineStage, ScheduleGPipe
torch.manual_seed(0)
layers = [nn.Linear(8, 8) for _ in range(world_size)]
stage = PipelineStage(layers[rank], rank, world_size, torch.device("cpu"))
schedule = ScheduleGPipe(stage, n_microbatches=2, loss_fn=lambda out, target: out.sum())
if rank == 0:
    schedule.step(torch.ones(4, 8))
elif rank == world_size - 1:
    losses = []
    schedule.step(target=torch.zeros(4, 8), losses=losses)
    print([round(loss.item(), 3) for loss in losses])
else:
    schedule.step()
print(round(layers[rank].weight.grad.sum().item(), 3))
"""


@pytest.fixture(scope="module", params=[2, 4], ids=["2 ranks", "4 ranks"])
def world(ip, request):
    with running_cluster(ip, request.param):
        yield request.param


def traced_and_untraced(ip, cell: str):
    """(trace, output) of ``cell`` traced, after checking its output equals the untraced run's."""
    captured, error = run_cell(ip, "", cell)
    assert error is None, error
    untraced = shown_text(captured)
    captured, error = run_cell(ip, "--diagram --trace tr", cell)
    assert error is None, error
    traced = "\n".join(text for text in shown_text(captured).split("\n") if not text.startswith("Trace of"))
    assert untraced in shown_text(captured), (untraced, traced)
    return ip.user_ns["tr"], untraced


def test_ddp_construction_and_every_bucket_of_every_backward(ip, world):
    trace, _ = traced_and_untraced(ip, DDP_CELL)
    assert trace.complete and not trace.mismatches
    made = [(step.op, step.events[0].made_by, step.events[0].line) for step in trace.steps]
    # Construction: the parameters' shapes compared (all_gather), then the state sent from rank 0.
    assert made[:3] == [
        ("all_gather", "DDP construction", 4),
        ("broadcast", "DDP construction", 4),
        ("broadcast", "DDP construction", 4),
    ]
    backward = [(op, maker) for op, maker, line in made if line == 7]
    assert backward and all(op == "all_reduce" for op, _ in backward)
    # The first backward reduces everything as one bucket; after it DDP rebuilds its buckets in
    # the order gradients came (the forward's broadcasts), and the small cap makes two.
    assert [maker for _, maker in backward] == ["DDP bucket 0"] + ["DDP bucket 0", "DDP bucket 1"] * 2
    sizes = [step.events[0].primary.shape for step in trace.steps if step.op == "all_reduce"]
    assert sizes == [(1348,), (324,), (1024,), (324,), (1024,)]  # 1348 = 16*64 + 64 + 64*4 + 4
    rebuilt = [maker for op, maker, line in made if line == 6]
    assert rebuilt and set(rebuilt) == {"DDP forward"}
    assert "all_reduce SUM on" in trace.text() and "(DDP bucket 1)" in trace.text()


def test_tensor_parallel_collectives_are_traced(ip, world):
    trace, _ = traced_and_untraced(ip, TP_CELL)
    assert trace.complete and not trace.mismatches
    ops = [step.op for step in trace.steps]
    assert "all_reduce" in ops and "scatter" in ops  # RowwiseParallel's output; weights distributed
    assert all(step.events[0].made_by == "DTensor" for step in trace.steps)
    forward = [step for step in trace.steps if step.op == "all_reduce"]
    assert [step.events[0].line for step in forward] == [8]


def test_pipelining_runs_unchanged_and_its_transfers_pair_up(ip, world):
    trace, output = traced_and_untraced(ip, PIPELINE_CELL)
    assert trace.complete and not trace.mismatches
    transfers = [step for step in trace.steps if step.kind == "transfer"]
    assert transfers and all(step.send and step.recv for step in transfers)
    # Activations go down the pipeline, gradients come back: each pair of neighbours both ways.
    pairs = {(step.send.rank, step.recv.rank) for step in transfers}
    assert pairs == {(r, r + 1) for r in range(world - 1)} | {(r + 1, r) for r in range(world - 1)}
    assert all(step.send.made_by == "pipelining" for step in transfers)
    assert f"[rank {world - 1}]\n[" in output  # the last stage's losses


def test_a_rank_skipping_backward_under_ddp_is_reported_in_ddps_all_reduce(ip, world):
    # Construction (imports, DDP's broadcasts) is over before the timed cell starts: under load it
    # could outlast the timeout, and a rank still computing its backward is rightly reported
    # there, not in the all_reduce it has not made yet.
    construct = (
        "import torch.nn as nn\n"
        "from torch.nn.parallel import DistributedDataParallel as DDP\n"
        "model = DDP(nn.Linear(4, 2))\n"
    )
    assert run_cell(ip, "", construct)[1] is None
    cell = "loss = model(torch.randn(3, 4)).sum()\nif rank != 1:\n    loss.backward()\n"
    _, error = run_cell(ip, "--trace hung --timeout 3", cell)
    assert isinstance(error, DistributedCellError)
    waiting = [rank for rank in range(world) if rank != 1]
    report = "\n".join(error._render_traceback_())
    group = "ranks 0-3" if world == 4 else "ranks 0,1"
    call = f"all_reduce SUM on {group} (DDP bucket 0)"
    label = "rank 0" if world == 2 else "ranks 0,2,3"
    assert f"[{label}] still running, in {call} at cell line 3" in report, report
    mismatch = next(line for line in report.splitlines() if line.startswith("Mismatch:"))
    assert "rank 0 called all_reduce (DDP bucket 0) at line 3" in mismatch
    assert mismatch.endswith("rank 1 never called it"), mismatch
    assert sorted(blocked.rank for blocked in error.blocked) == waiting
    with capture_output():
        ip.run_line_magic("dist_recover", "")
    # Untraced: the stack ends in the autograd engine, and the report says what may wait there.
    assert run_cell(ip, "", construct)[1] is None  # on the new group
    _, error = run_cell(ip, "--timeout 3", cell)
    report = "\n".join(error._render_traceback_())
    assert f"[{label}] still running, in backward at cell line 3" in report, report
    assert "DDP's reducer all-reduces gradients: %%distributed --trace names the call" in report
    with capture_output():
        ip.run_line_magic("dist_recover", "")


def test_a_50_step_ddp_training_loop_stays_readable(ip, world):
    """Repeated steps are listed and drawn once, with how many times they came."""
    cell = DDP_CELL.replace("range(3)", "range(50)").replace(
        "    loss.backward()", "    model.zero_grad()\n    loss.backward()"
    )
    trace, _ = traced_and_untraced(ip, cell)
    assert len(trace.steps) == 3 + 1 + 2 + 49 * 2
    text = trace.text()
    # Construction (3), the first backward (one bucket), the rebuild's broadcasts (2), then two
    # buckets per backward, 49 times.
    assert "  7. all_reduce SUM on" in text and "(DDP bucket 0)" in text
    assert "  9-104. steps 7-8 again, 48 more times (the same calls; their values not listed)" in text
    assert len(text.splitlines()) < 30
    diagram = trace.draw()
    assert len(diagram.gids("collective:")) == 8
    labels = {artist.get_text().split("\n")[0] for artist in diagram.artists("text:event:")}
    assert {"7 x49 all_reduce", "8 x49 all_reduce"} <= labels


FSDP_CELL = """\
import torch.nn as nn
from torch.distributed.fsdp import fully_shard
torch.manual_seed(0)
net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
for layer in (net[0], net[2]):
    fully_shard(layer, mesh=mesh)
fully_shard(net, mesh=mesh)
net(torch.ones(2, 8) + rank).sum().backward()
print(round(net[0].weight.grad.full_tensor().sum().item(), 3))
"""
# The ranks' own device (cpu for gloo ranks, also on a machine with GPUs, where FSDP would
# otherwise take the current accelerator).
FSDP_MESH = """\
from torch.distributed.device_mesh import init_device_mesh
mesh = init_device_mesh(device.type, (world_size,))
"""


def test_fsdp2_gathers_before_forward_and_reduce_scatters_after_backward(ip, world):
    run_cell(ip, "", FSDP_MESH)
    trace, _ = traced_and_untraced(ip, FSDP_CELL)
    assert trace.complete and not trace.mismatches
    made = {(step.op, step.events[0].made_by, step.events[0].line) for step in trace.steps}
    # torch 2.13's FSDP2 calls the new names of all_gather_into_tensor and reduce_scatter_tensor
    # (torch 2.11's, seen on a GPU machine, the old ones).
    gathers = {("all_gather_single", "FSDP", 8), ("all_gather_into_tensor", "FSDP", 8)}
    scatters = {("reduce_scatter_single", "FSDP", 8), ("reduce_scatter_tensor", "FSDP", 8)}
    assert made & gathers  # unsharding parameters for forward
    assert made & scatters  # sharding gradients in backward
    assert ("all_gather_into_tensor", "DTensor", 9) in made  # full_tensor() of a sharded gradient


def test_a_watching_tool_is_not_taken_for_the_maker(ip, world):
    """CommDebugMode (under torch.distributed.tensor) re-makes each call it counts: the cell's
    own all_reduce stays the cell's."""
    cell = (
        "from torch.distributed.tensor.debug import CommDebugMode\n"
        "with CommDebugMode() as counted:\n"
        "    dist.all_reduce(torch.ones(1))\n"
        "print(counted.get_total_counts())"
    )
    trace, output = traced_and_untraced(ip, cell)
    assert output.endswith("\n1")
    assert [(step.op, step.events[0].made_by) for step in trace.steps] == [("all_reduce", None)]


def test_a_decorators_wrapper_is_not_taken_for_the_maker(ip, world):
    """torch 2.13 wraps all_gather_into_tensor and reduce_scatter_tensor in
    typing_extensions.deprecated: the cell's calls stay the cell's."""
    cell = (
        "import warnings\nwarnings.simplefilter('ignore', FutureWarning)  # deprecated, once per process\n"
        "x = torch.ones(2) * rank\nout = torch.zeros(2 * world_size)\n"
        "dist.all_gather_into_tensor(out, x)\nmine = torch.zeros(1)\n"
        "dist.reduce_scatter_tensor(mine, torch.ones(world_size))\nprint(out.sum().item(), mine.item())"
    )
    trace, _ = traced_and_untraced(ip, cell)
    assert [(step.op, step.events[0].made_by) for step in trace.steps] == [
        ("all_gather_into_tensor", None),
        ("reduce_scatter_tensor", None),
    ]
    assert "typing_extensions" not in repr(trace)


def test_a_librarys_result_never_used_in_the_cell_is_not_shown_as_done(ip, world):
    """DTensor's row-parallel output is all-reduced asynchronously and waited for where it is
    used: a cell that never uses it ends before the values are known, and says so."""
    run_cell(ip, "", TP_CELL)
    captured, error = run_cell(ip, "--trace unused", "y = tp(torch.ones(4, 8))")
    assert error is None, error
    [step] = [step for step in ip.user_ns["unused"].steps if step.op == "all_reduce"]
    for event in step.events.values():
        assert (event.status == "done" and event.after is not None) or (
            event.status == "waiting" and event.after is None
        ), event
    captured, error = run_cell(ip, "", "print(round(y.sum().item(), 3))")
    assert error is None and shown_text(captured).endswith(shown_text(captured).split("\n")[-1])
