"""A traced call's values are what its tensors held when the call completed, not later: DDP's
gradient bucket after its buckets are rebuilt (each step's all_reduce against that step's real
gradients), FSDP2's gathered parameters and reduce-scattered gradients over two steps, and a
DTensor all-reduce waited for in C++ whose result the cell then changes in place. Real 2-rank
gloo cluster."""

from __future__ import annotations

import ast

import pytest

from tests.conftest import run_cell, shown_text

DDP_STEPS = """\
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
torch.manual_seed(0)
model = DDP(nn.Linear(4, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
grads = []
for step in range(5):
    opt.zero_grad()
    model(torch.randn(3, 4) * (rank + 1) + step).sum().backward()
    grads.append([[g for g in p.grad.reshape(-1).tolist()] for p in model.parameters()])
    opt.step()
print(grads)
"""


def printed(captured):
    return ast.literal_eval(shown_text(captured).strip().splitlines()[-1])


def close(a, b) -> bool:
    return len(a) == len(b) and all(x == pytest.approx(y, rel=1e-5, abs=1e-6) for x, y in zip(a, b))


def test_each_ddp_steps_all_reduce_shows_that_steps_gradients(ip, cluster):
    captured, error = run_cell(ip, "--trace tr", DDP_STEPS)
    assert error is None, error
    grads = printed(captured)  # per step: [weight's 4 values, bias's 1]
    buckets = [step for step in ip.user_ns["tr"].steps if step.events[0].made_by == "DDP bucket 0"]
    assert len(buckets) == len(grads) == 5
    for number, (step, (weight, bias)) in enumerate(zip(buckets, grads)):
        for event in step.events.values():
            [after] = event.after
            # DDP's first bucket holds the parameters in order; the rebuilt one in the order
            # their gradients came (the bias first).
            assert close(after.values, weight + bias) or close(after.values, bias + weight), (
                number,
                after.values,
                weight,
                bias,
            )


FSDP_STEPS = """\
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
mesh = init_device_mesh("cpu", (world_size,))
torch.manual_seed(0)
net = nn.Linear(4, 2)
fully_shard(net, mesh=mesh)
opt = torch.optim.SGD(net.parameters(), lr=0.5)
params, grads = [], []
for step in range(2):
    params.append(sorted(v for p in net.parameters() for v in p.full_tensor().reshape(-1).tolist()))
    net(torch.ones(1, 4) * (rank + 1 + step)).sum().backward()
    grads.append([v for p in net.parameters() for v in p.grad.to_local().reshape(-1).tolist()])
    opt.step()
    opt.zero_grad()
print([params, grads])
"""


def test_fsdp2s_gathers_and_reduce_scatters_show_each_steps_values(ip, cluster):
    captured, error = run_cell(ip, "--trace tr", FSDP_STEPS)
    assert error is None, error
    params, grads = printed(captured)
    steps = [step for step in ip.user_ns["tr"].steps if step.events[0].made_by == "FSDP"]
    gathers = [step for step in steps if step.op.startswith("all_gather")]
    scatters = [step for step in steps if step.op.startswith("reduce_scatter")]
    assert len(gathers) == len(scatters) == 2
    for number in range(2):
        for event in gathers[number].events.values():
            assert close(sorted(event.after[0].values), params[number]), number
        for event in scatters[number].events.values():
            # Both ranks print their own shard; the trace keeps each rank's.
            assert len(event.after[0].values) == len(grads[number])
    rank0 = [scatters[number].events[0].after[0].values for number in range(2)]
    assert close(rank0[0], grads[0]) and close(rank0[1], grads[1])


TP_IN_PLACE = """\
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import parallelize_module, RowwiseParallel
mesh = init_device_mesh("cpu", (world_size,))
torch.manual_seed(0)
row = parallelize_module(nn.Linear(4, 2, bias=False), mesh, RowwiseParallel())
with torch.no_grad():
    out = row(torch.ones(1, 4 // world_size) * (rank + 1))
    out.mul_(100)  # waits for the all-reduce (in C++), then changes its result
print(out.tolist())
"""


def test_a_functional_all_reduce_shows_its_result_not_what_the_cell_made_of_it(ip, cluster):
    captured, error = run_cell(ip, "--trace tr", TP_IN_PLACE)
    assert error is None, error
    [reduced] = [[value / 100 for value in row] for row in printed(captured)]
    [step] = [step for step in ip.user_ns["tr"].steps if step.op == "all_reduce"]
    for event in step.events.values():
        assert close(event.after[0].values, reduced), event.after
