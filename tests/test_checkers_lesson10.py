"""Lesson 10's exercise checkers fail the obvious wrong answers and pass the reference solutions.

Exercise 1 runs on the ranks (a real 2-rank gloo cluster, with torchrun's assignments as the lesson records
them); exercise 2 runs in the notebook's own namespace, with the lesson's fake Slurm, in a temporary folder.
"""

from __future__ import annotations

import pytest
from IPython.utils.capture import capture_output

from tests.checker_harness import assert_checker, assert_run_all, lesson_cell, reference_answer

LESSON = "10_torchrun_multinode"

# What torchrun set in the lesson's runs: 1 node x 2 workers, 2 nodes x 1 (static), 2 nodes x 2 (c10d).
LAYOUTS = [(1, 2), (2, 1), (2, 2)]
OBSERVED = [
    {
        "RANK": node * nproc + local,
        "WORLD_SIZE": nodes * nproc,
        "LOCAL_RANK": local,
        "LOCAL_WORLD_SIZE": nproc,
        "GROUP_RANK": node,
        "GROUP_WORLD_SIZE": nodes,
    }
    for nodes, nproc in LAYOUTS
    for node in range(nodes)
    for local in range(nproc)
]

PLACE_WRONG = {
    "one node only": """
def place(rank, world_size, nproc_per_node):
    return 0, rank
""",
    "round robin over the nodes": """
def place(rank, world_size, nproc_per_node):
    nnodes = world_size // nproc_per_node
    return rank % nnodes, rank // nnodes
""",
    "local rank and node swapped": """
def place(rank, world_size, nproc_per_node):
    return rank % nproc_per_node, rank // nproc_per_node
""",
}


@pytest.mark.parametrize("wrong", list(PLACE_WRONG))
def test_10_place_must_match_torchrun(ip, cluster, wrong):
    ip.user_ns["observed"] = OBSERVED
    with capture_output():
        ip.run_line_magic("dist_push", "observed")
    del ip.user_ns["observed"]
    assert_checker(ip, LESSON, 1, PLACE_WRONG[wrong], 2)


SBATCH_WRONG = {
    "the broken script itself": "fixed_sbatch = broken_sbatch",
    "node rank still expanded by the batch script": """
fixed_sbatch = broken_sbatch.replace("srun torchrun", 'srun bash -c "torchrun')
fixed_sbatch = fixed_sbatch.replace("train.py\\n", 'train.py"\\n')
""",
    "node count written in by hand": """
fixed_sbatch = broken_sbatch.replace(
    'srun torchrun --nnodes "$SLURM_NNODES"', "srun bash -c 'torchrun --nnodes 2"
)
fixed_sbatch = fixed_sbatch.replace("train.py\\n", "train.py'\\n")
""",
    "two agents per node": """
fixed_sbatch = broken_sbatch.replace("--ntasks-per-node=1", "--ntasks-per-node=2")
""",
    "MASTER_ADDR in the environment only (torchrun ignores it)": """
fixed_sbatch = broken_sbatch.replace("srun torchrun", "srun bash -c 'torchrun")
fixed_sbatch = fixed_sbatch.replace("train.py\\n", "train.py'\\n")
fixed_sbatch = fixed_sbatch.replace('--master_addr "$MASTER_ADDR" ', "")
""",
    "a different port on each node": """
fixed_sbatch = broken_sbatch.replace("srun torchrun", "srun bash -c 'torchrun")
fixed_sbatch = fixed_sbatch.replace("train.py\\n", "train.py'\\n")
fixed_sbatch = fixed_sbatch.replace('"$MASTER_PORT"', '"$((MASTER_PORT + SLURM_NODEID))"')
""",
}


def notebook_verdict(ip, solution: str) -> str:
    """Run ``solution`` and the lesson's checker of exercise 2 in the shell; the verdict it printed."""
    ip.user_ns.pop("fixed_sbatch", None)
    for code in (solution, lesson_cell(LESSON, "# Checker for exercise 2")):
        with capture_output() as captured:
            result = ip.run_cell(code)
        assert result.error_in_exec is None and result.error_before_exec is None, captured.stdout
    lines = [line for line in captured.stdout.splitlines() if line.startswith("exercise 2: ")]
    assert len(lines) == 1, captured.stdout
    return "pass" if lines[0] == "exercise 2: pass" else "fail"  # or "exercise 2: not yet: ..."


@pytest.fixture
def fake_slurm_namespace(ip, tmp_path, monkeypatch):
    """The lesson's fake Slurm and broken script, defined in the shell, working in a temporary folder."""
    monkeypatch.chdir(tmp_path)
    for code in (
        "import json, os, subprocess, sys",
        lesson_cell(LESSON, "FAKES = {"),
        lesson_cell(LESSON, "broken_sbatch = r"),
    ):
        with capture_output():
            result = ip.run_cell(code)
        assert result.error_in_exec is None
    yield ip
    for name in ("FAKES", "fake_slurm", "broken_sbatch", "fixed_sbatch", "torchrun_options", "check_sbatch"):
        ip.user_ns.pop(name, None)


@pytest.mark.parametrize("wrong", list(SBATCH_WRONG))
def test_10_sbatch_fix_must_give_each_node_its_rank(fake_slurm_namespace, wrong):
    ip = fake_slurm_namespace
    assert notebook_verdict(ip, SBATCH_WRONG[wrong]) == "fail"
    assert notebook_verdict(ip, reference_answer(LESSON, 2)) == "pass"


def test_10_sbatch_fix_with_c10d_passes(fake_slurm_namespace):
    c10d = """
fixed_sbatch = broken_sbatch.replace(
    'srun torchrun --nnodes "$SLURM_NNODES" --node_rank "$SLURM_NODEID" --nproc_per_node 2 \\\\\\n'
    '    --master_addr "$MASTER_ADDR" --master_port "$MASTER_PORT" train.py',
    'srun torchrun --nnodes "$SLURM_NNODES" --nproc_per_node 2 --rdzv_backend c10d '
    '--rdzv_endpoint "$MASTER_ADDR:$MASTER_PORT" --rdzv_id "$SLURM_JOB_ID" train.py',
)
assert fixed_sbatch != broken_sbatch
"""
    assert notebook_verdict(fake_slurm_namespace, c10d) == "pass"


def test_10_run_all_checks_the_learners_answers(ip, cluster, fake_slurm_namespace):
    """Exercise 1 on the ranks, exercise 2 in the notebook, in the lesson's order."""
    ip.user_ns["observed"] = OBSERVED
    with capture_output():
        ip.run_line_magic("dist_push", "observed")
    del ip.user_ns["observed"]
    wrong = {1: PLACE_WRONG["local rank and node swapped"], 2: SBATCH_WRONG["two agents per node"]}
    assert_run_all(ip, LESSON, wrong, 2)
