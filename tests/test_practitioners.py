"""The code practitioners already run, in the ranks of a real 2-rank gloo cluster: transformers'
tensor-parallel plan (a tiny Llama built from a config and saved here: no downloads), accelerate,
Lightning Fabric. Each runs as a script would write it, gives what one process gives, and every
call it makes is named in the trace by whoever made it."""

from __future__ import annotations

import ast

import pytest

from tests.conftest import run_cell, shown_text

pytest.importorskip("transformers")

# Progress bars on the ranks are widgets (ipywidgets' comms), which this test's terminal shell
# cannot show.
QUIET = """\
import os
os.environ["TQDM_DISABLE"] = "1"
os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"
"""

SAVE_TINY_LLAMA = """\
from transformers import LlamaConfig, LlamaForCausalLM
config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
if rank == 0:
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(path)
dist.barrier()
"""

TP_LOAD = """\
from transformers import AutoModelForCausalLM
from transformers.distributed import DistributedConfig
model = AutoModelForCausalLM.from_pretrained(path, distributed_config=DistributedConfig(tp_plan="auto"))
one = AutoModelForCausalLM.from_pretrained(path)  # the same model, whole, in this process alone
ids = torch.tensor([[1, 2, 3, 4]])
print(type(model.model.layers[0].self_attn.q_proj.weight).__name__)
"""

TP_FORWARD = """\
with torch.no_grad():
    logits = model(ids).logits
print(torch.allclose(logits, one(ids).logits, atol=1e-5))
"""

TP_GENERATE = """\
tp = model.generate(ids, max_new_tokens=6, do_sample=False).tolist()
alone = one.generate(ids, max_new_tokens=6, do_sample=False).tolist()
print([tp == alone, tp])
"""


@pytest.fixture(scope="module")
def tiny_llama(ip, cluster, tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-llama")
    for cell in (QUIET, f"path = {str(path)!r}\n" + SAVE_TINY_LLAMA, TP_LOAD):
        captured, error = run_cell(ip, "", cell)
        assert error is None, error
    assert shown_text(captured).strip().endswith("DTensor")


def test_transformers_tensor_parallel_generates_what_one_process_does(ip, tiny_llama):
    captured, error = run_cell(ip, "", TP_GENERATE)
    assert error is None, error
    same, tokens = ast.literal_eval(shown_text(captured).strip().splitlines()[-1])
    assert same and len(tokens[0]) == 10


def test_every_call_of_a_tensor_parallel_forward_is_named(ip, tiny_llama):
    captured, error = run_cell(ip, "--trace forward", TP_FORWARD)
    assert error is None, error
    assert shown_text(captured).strip().endswith("True")
    trace = ip.user_ns["forward"]
    assert trace.complete and not trace.mismatches
    makers = [step.events[0].made_by for step in trace.steps]
    assert all(makers), trace.text()
    plan = "transformers/distributed/tensor_parallel.py:"
    # Row-parallel outputs all-reduced by the plan itself; DTensor redistributions it asked for.
    assert any(maker.startswith(plan) for maker in makers), makers
    assert any(maker.startswith(f"DTensor from {plan}") for maker in makers), makers
    text = trace.text()
    assert all(f"({maker})" in text for maker in makers)


ACCELERATE = """\
from accelerate import Accelerator
from accelerate.utils import broadcast_object_list
accelerator = Accelerator(cpu=True)
model, opt = accelerator.prepare(torch.nn.Linear(4, 1), torch.optim.SGD(torch.nn.Linear(4, 1).parameters()))
accelerator.backward(model(torch.ones(2, 4) * rank).sum())
print([str(accelerator.state.distributed_type), accelerator.num_processes,
       accelerator.gather(torch.tensor([rank])).tolist(), broadcast_object_list([rank])[0]])
"""


def test_accelerate_joins_the_running_group_and_its_calls_are_named(ip, cluster):
    pytest.importorskip("accelerate")
    run_cell(ip, "", QUIET)
    captured, error = run_cell(ip, "--trace acc", ACCELERATE)
    assert error is None, error
    lines = shown_text(captured).strip().splitlines()
    printed = [ast.literal_eval(line) for line in lines if line.startswith("['")]
    assert printed == [["DistributedType.MULTI_CPU", 2, [0, 1], 0]]  # the same on both ranks
    trace = ip.user_ns["acc"]
    made = [step.events[0].made_by for step in trace.steps]
    assert all(made), trace.text()
    assert "DDP bucket 0" in made
    assert any(maker.startswith("broadcast_object_list from accelerate/") for maker in made), made
    assert any(maker.startswith("accelerate/utils/operations.py:") for maker in made), made


FABRIC = """\
import sys
import lightning as L
fabric = L.Fabric(accelerator="cpu", devices=world_size, strategy="ddp")
fabric.launch()
torch.manual_seed(0)
model, opt = fabric.setup(*(lambda m: (m, torch.optim.SGD(m.parameters(), lr=0.1)))(torch.nn.Linear(4, 1)))
for step in range(3):
    opt.zero_grad()
    fabric.backward(model(torch.ones(2, 4) * (rank + 1)).sum())
    opt.step()
weights = [round(value, 4) for value in model.module.weight.reshape(-1).tolist()]
total = fabric.all_reduce(torch.tensor(float(rank)), reduce_op="sum").item()
strategy = type(fabric.strategy).__name__
print([hasattr(sys, "ps1"), fabric.global_rank == rank, fabric.world_size, strategy, weights, total])
"""


def test_lightning_fabric_ddp_runs_in_the_ranks_as_a_script_writes_it(ip, cluster):
    """Lightning refuses strategy='ddp' where ``sys.ps1`` exists (IPython's sign of a prompt):
    the ranks are processes launched from outside, as under torchrun, and say so."""
    pytest.importorskip("lightning")
    captured, error = run_cell(ip, "--trace fabric", FABRIC)
    assert error is None, error
    # Both ranks print the same line; where Slurm's srun is installed, Lightning warns on rank 0
    # only, so the ranks' blocks are shown apart and the line comes twice.
    lines = {line for line in shown_text(captured).splitlines() if line.startswith("[")}
    [printed] = [ast.literal_eval(line) for line in lines if not line.startswith("[rank")]
    no_prompt, same_rank, world, strategy, weights, total = printed
    assert (no_prompt, same_rank, world, strategy, total) == (False, True, 2, "DDPStrategy", 1.0)
    assert weights == [-0.9037, -0.6318, -1.3115, -1.268]  # both ranks: one model, trained together
    made = [step.events[0].made_by for step in ip.user_ns["fabric"].steps]
    assert made.count("DDP bucket 0") == 3
    assert made[-1].startswith("lightning/fabric/utilities/distributed.py:"), made


FSDP_AND_TP = """\
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import distribute_tensor, Replicate
mesh = init_device_mesh("cpu", (world_size,))
torch.manual_seed(0)
sharded = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2))
fully_shard(sharded, mesh=mesh)
replicated = distribute_tensor(torch.arange(6.0), mesh, [Replicate()])
"""


def test_dist_diff_knows_dtensors(ip, cluster):
    """FSDP2's shards differ as they should; a replicated DTensor is compared."""
    _, error = run_cell(ip, "", FSDP_AND_TP)
    assert error is None, error
    lines = dist_diff(ip, "sharded")
    assert lines[-1] == "All entries agree (4 sharded: their local shards differ as expected)."
    weight = next(line for line in lines if line.strip().startswith("0.weight"))
    assert "DTensor (8, 4) float32 [Shard(0)]  sharded (Shard(0)): local shards differ as expected" in weight
    assert "equal" in dist_diff(ip, "replicated")[-1] and "[Replicate()]" in dist_diff(ip, "replicated")[-1]
    run_cell(ip, "", "if rank == 1:\n    replicated.to_local()[0] = 7.0")
    assert "replicas differs (rank 1: max |a-b| 7" in dist_diff(ip, "replicated")[-1]


def dist_diff(ip, expression: str) -> list[str]:
    from IPython.utils.capture import capture_output

    with capture_output() as captured:
        ip.run_line_magic("dist_diff", expression)
    return captured.stdout.strip().splitlines()
