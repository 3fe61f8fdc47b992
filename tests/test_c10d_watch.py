"""The lessons' recorder of c10d operations (ddp_magics/lessons/c10d_watch.py) sees every way a learner
can reach a collective: the torch.distributed function, a from-import of it, distributed_c10d's, a
ProcessGroup method, a functional collective, and a send/recv, each with its kind and sizes. One rank,
gloo, in a child process (a process group is for the life of a process)."""

from __future__ import annotations

import json
import subprocess
import sys

SCRIPT = r"""
import json, os, sys
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch.distributed import all_reduce as imported_all_reduce
from torch.distributed import distributed_c10d
from ddp_magics.lessons.c10d_watch import c10d_watch

store = dist.FileStore(os.path.join(sys.argv[1], "store"), 1)
dist.init_process_group("gloo", store=store, rank=0, world_size=1)
t = torch.ones(6)
ways = {
    "function": lambda: dist.all_reduce(t),
    "from-import": lambda: imported_all_reduce(t),
    "distributed_c10d": lambda: distributed_c10d.all_reduce(t),
    "ProcessGroup method": lambda: dist.group.WORLD.allreduce([t]).wait(),
    "functional": lambda: funcol.all_reduce(t, "sum", dist.group.WORLD).wait(),
    "all_gather list": lambda: dist.all_gather([torch.empty(6)], t),
    "functional all_gather": lambda: funcol.all_gather_tensor(t, 0, dist.group.WORLD).wait(),
    "nothing": lambda: t.add(1),
}
seen = {}
for way, call in ways.items():
    with c10d_watch() as ops:
        call()
    seen[way] = [(op.kind, op.numel, op.group_size) for op in ops]
dist.destroy_process_group()
print(json.dumps(seen))
"""


def test_every_way_to_a_collective_is_recorded_once_with_its_kind_and_size(tmp_path):
    command = [sys.executable, "-c", SCRIPT, str(tmp_path)]
    run = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    seen = json.loads(run.stdout.strip().splitlines()[-1])
    for way in ("function", "from-import", "distributed_c10d", "ProcessGroup method", "functional"):
        assert seen[way] == [["all_reduce", 6, 1]], (way, seen[way])
    for way in ("all_gather list", "functional all_gather"):
        assert seen[way] == [["all_gather", 6, 1]], (way, seen[way])
    assert seen["nothing"] == []
