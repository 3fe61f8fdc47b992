"""Lesson 08's exercise checkers refuse wrong answers and pass the reference solutions
(tests/checker_harness.py says how)."""

from __future__ import annotations

import pytest
from IPython.utils.capture import capture_output

from tests.checker_harness import assert_checker, assert_run_all, lesson_cell, on_ranks

# lesson 08: rotating checkpoints written crash-safely by rank 0; every rank's RNG state in rank 0's file

ROTATING = """
import os
import re


def steps_in(folder):
    return [int(m[1]) for name in os.listdir(folder) if (m := re.fullmatch(r"step(\\d+)\\.pt", name))]


def sync_directory(folder):
    fd = os.open(folder, os.O_RDONLY)
    os.fsync(fd)
    os.close(fd)


def durable(state, final):
    with open(final + ".tmp", "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(final + ".tmp", final)
    sync_directory(os.path.dirname(final))


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
DURABLE = "durable(state, final)"
BY_STEP = 'os.path.join(folder, f"step{max(steps)}.pt")'
ROTATING_WRONG = {
    "written straight to its final name": ROTATING.replace("SAVE", "torch.save(state, final)").replace(
        "LATEST", BY_STEP
    ),
    "renamed atomically but never synced: safe for readers, not for a crash": ROTATING.replace(
        "SAVE", 'torch.save(state, final + ".tmp"); os.replace(final + ".tmp", final)'
    ).replace("LATEST", BY_STEP),
    "the file synced, the directory not": ROTATING.replace("SAVE", DURABLE)
    .replace("    sync_directory(os.path.dirname(final))\n", "")
    .replace("LATEST", BY_STEP),
    "the directory synced before the rename, not after": ROTATING.replace(
        "SAVE",
        'torch.save(state, final + ".tmp"); fd = os.open(final + ".tmp", os.O_RDONLY); os.fsync(fd); '
        'os.close(fd); sync_directory(folder); os.replace(final + ".tmp", final)',
    ).replace("LATEST", BY_STEP),
    "the file synced after the rename, not before": ROTATING.replace(
        "SAVE",
        'torch.save(state, final + ".tmp"); os.replace(final + ".tmp", final); '
        "fd = os.open(final, os.O_RDONLY); os.fsync(fd); os.close(fd); sync_directory(folder)",
    ).replace("LATEST", BY_STEP),
    "the wrong directory synced (the parent)": ROTATING.replace("SAVE", DURABLE)
    .replace(
        "sync_directory(os.path.dirname(final))", "sync_directory(os.path.dirname(os.path.dirname(final)))"
    )
    .replace("LATEST", BY_STEP),
    "rank 1 writes a marker file of its own": ROTATING.replace("SAVE", DURABLE)
    .replace(
        "    dist.barrier()\n",
        '    else:\n        mine = os.path.join(folder, "rank1.tmp")\n'
        '        open(mine, "w").write("x")\n        os.remove(mine)\n    dist.barrier()\n',
    )
    .replace("LATEST", BY_STEP),
    "old ones removed before the directory fsync (keep=1: a crash can leave none)": ROTATING.replace(
        "SAVE", DURABLE
    )
    .replace("    sync_directory(os.path.dirname(final))\n", "")
    .replace(
        'os.remove(os.path.join(folder, f"step{old}.pt"))\n',
        'os.remove(os.path.join(folder, f"step{old}.pt"))\n        sync_directory(folder)\n',
    )
    .replace("LATEST", BY_STEP),
    "every checkpoint kept": ROTATING.replace("SAVE", DURABLE)
    .replace("[:-keep]", "[:0]")
    .replace("LATEST", BY_STEP),
    "the latest by name, not by step": ROTATING.replace("SAVE", DURABLE).replace(
        "LATEST", 'os.path.join(folder, max(f"step{s}.pt" for s in steps))'
    ),
    "the latest is any newest file, a crash's leftover included": ROTATING.replace("SAVE", DURABLE).replace(
        "LATEST", "max((os.path.join(folder, n) for n in os.listdir(folder)), key=os.path.getmtime)"
    ),
}
ROTATING_RIGHT_OTHER = {
    "a path, then the file reopened to sync it": ROTATING.replace(
        "SAVE",
        'torch.save(state, final + ".part"); fd = os.open(final + ".part", os.O_RDONLY); os.fsync(fd); '
        'os.close(fd); os.replace(final + ".part", final); sync_directory(folder)',
    ).replace("LATEST", BY_STEP),
    "a file object, the lesson's way": ROTATING.replace("SAVE", DURABLE).replace("LATEST", BY_STEP),
    "fsync, replace and save imported by name, bytes written by hand": "from os import fsync, replace\n"
    + "from torch import save\n"
    + ROTATING.replace(
        "SAVE",
        'buffer = io.BytesIO(); save(state, buffer); f = open(final + ".new", "wb"); '
        "f.write(buffer.getvalue()); f.flush(); fsync(f.fileno()); f.close(); "
        'replace(final + ".new", final); '
        "sync_directory(folder)",
    )
    .replace("import re\n", "import re\nimport io\n", 1)
    .replace("LATEST", BY_STEP),
}
RNG_WRONG = {
    "rank 1 writes its state with open(), rank 0 the rest": """
import io


def save_rng_states(path):
    if rank == 1:
        with open(path + ".rank1", "wb") as f:
            f.write(torch.get_rng_state().numpy().tobytes())
    states = [None] * world_size
    dist.all_gather_object(states, torch.get_rng_state())
    if rank == 0:
        torch.save({"rng": states}, path)
    dist.barrier()


def load_rng_state(path):
    torch.set_rng_state(torch.load(path)["rng"][rank])
""",
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


@pytest.mark.parametrize("right", list(ROTATING_RIGHT_OTHER))
def test_08_rotating_checkpoints_accepts_other_right_answers(ip, cluster, ckpt_dir, right):
    checker = lesson_cell("08_checkpointing", "# Checker for exercise 1")
    text = on_ranks(ip, ROTATING_RIGHT_OTHER[right] + "\n" + checker)
    assert "exercise 1: pass" in text and "not yet" not in text, text


RNG_RIGHT_OTHER = """
def save_rng_states(path):
    states = [None] * world_size
    dist.all_gather_object(states, torch.get_rng_state())   # every rank gets them all; rank 0 writes
    if rank == 0:
        with open(path, "wb") as f:                          # a file object, synced
            torch.save(states, f)
            f.flush()
            os.fsync(f.fileno())
    dist.barrier()


def load_rng_state(path):
    torch.set_rng_state(torch.load(path)[rank])
"""


RNG_RIGHT_BYTES = """
import io


def save_rng_states(path):
    states = [None] * world_size if rank == 0 else None
    dist.gather_object(torch.get_rng_state(), states, dst=0)
    if rank == 0:
        buffer = io.BytesIO()
        torch.save({"rng": states}, buffer)              # serialised in memory, written with open()
        with open(path, "wb") as f:
            f.write(buffer.getvalue())
    dist.barrier()


def load_rng_state(path):
    torch.set_rng_state(torch.load(path)["rng"][rank])
"""


@pytest.mark.parametrize("right", [RNG_RIGHT_OTHER, RNG_RIGHT_BYTES], ids=["all_gather_object", "bytes"])
def test_08_rng_states_accepts_another_right_answer(ip, cluster, ckpt_dir, right):
    checker = lesson_cell("08_checkpointing", "# Checker for exercise 2")
    text = on_ranks(ip, "import os\n" + right + "\n" + checker)
    assert "exercise 2: pass" in text and "not yet" not in text, text


@pytest.mark.parametrize("wrong", list(RNG_WRONG))
def test_08_every_ranks_rng_state_in_rank_0s_file(ip, cluster, ckpt_dir, wrong):
    assert_checker(ip, "08_checkpointing", 2, RNG_WRONG[wrong], 2)


def test_08_run_all_checks_the_learners_answers(ip, cluster, ckpt_dir):
    by_name = ROTATING_WRONG["the latest by name, not by step"]
    wrong = {1: by_name, 2: RNG_WRONG["every rank writes its own file"]}
    assert_run_all(ip, "08_checkpointing", wrong, 2)
