"""Lesson 08's exercise checkers refuse wrong answers and pass the reference solutions
(tests/checker_harness.py says how)."""

from __future__ import annotations

import pytest
from IPython.utils.capture import capture_output

from tests.checker_harness import assert_checker, assert_run_all

# lesson 08: rotating checkpoints written atomically by rank 0; every rank's RNG state in rank 0's file

ROTATING = """
import os
import re


def steps_in(folder):
    return [int(m[1]) for name in os.listdir(folder) if (m := re.fullmatch(r"step(\\d+)\\.pt", name))]


def save_rotating(folder, state, step, keep=2):
    if rank == 0:
        final = os.path.join(folder, f"step{step}.pt")
        SAVE
        for old in sorted(steps_in(folder))[:-keep]:
            os.remove(os.path.join(folder, f"step{old}.pt"))
    dist.barrier()


def latest_checkpoint(folder):
    steps = steps_in(folder)
    return LATEST if steps else None
"""
ATOMIC = 'torch.save(state, final + ".tmp"); os.replace(final + ".tmp", final)'
BY_STEP = 'os.path.join(folder, f"step{max(steps)}.pt")'
ROTATING_WRONG = {
    "written straight to its final name": ROTATING.replace("SAVE", "torch.save(state, final)").replace(
        "LATEST", BY_STEP
    ),
    "every checkpoint kept": ROTATING.replace("SAVE", ATOMIC).replace("[:-keep]", "[:0]").replace(
        "LATEST", BY_STEP
    ),
    "the latest by name, not by step": ROTATING.replace("SAVE", ATOMIC).replace(
        "LATEST", 'os.path.join(folder, max(f"step{s}.pt" for s in steps))'
    ),
}
RNG_WRONG = {
    "rank 0's state only, loaded by every rank": """
def save_rng_states(path):
    if rank == 0:
        torch.save({"rng": torch.get_rng_state()}, path)
    dist.barrier()


def load_rng_state(path):
    torch.set_rng_state(torch.load(path)["rng"])
""",
    "every rank writes its own file": """
def save_rng_states(path):
    torch.save({"rng": torch.get_rng_state()}, f"{path}.rank{rank}")
    if rank == 0:
        torch.save({"ranks": world_size}, path)
    dist.barrier()


def load_rng_state(path):
    torch.set_rng_state(torch.load(f"{path}.rank{rank}")["rng"])
""",
}


@pytest.fixture
def ckpt_dir(ip, cluster, tmp_path):
    ip.user_ns["ckpt_dir"] = str(tmp_path)  # as the lesson pushes its checkpoint directory
    with capture_output():
        ip.run_line_magic("dist_push", "ckpt_dir")
    del ip.user_ns["ckpt_dir"]


@pytest.mark.parametrize("wrong", list(ROTATING_WRONG))
def test_08_rotating_checkpoints_atomic_by_step(ip, cluster, ckpt_dir, wrong):
    assert_checker(ip, "08_checkpointing", 1, ROTATING_WRONG[wrong], 2)


@pytest.mark.parametrize("wrong", list(RNG_WRONG))
def test_08_every_ranks_rng_state_in_rank_0s_file(ip, cluster, ckpt_dir, wrong):
    assert_checker(ip, "08_checkpointing", 2, RNG_WRONG[wrong], 2)


def test_08_run_all_checks_the_learners_answers(ip, cluster, ckpt_dir):
    by_name = ROTATING_WRONG["the latest by name, not by step"]
    wrong = {1: by_name, 2: RNG_WRONG["every rank writes its own file"]}
    assert_run_all(ip, "08_checkpointing", wrong, 2)
