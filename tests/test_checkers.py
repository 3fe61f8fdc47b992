"""The lessons' exercise checkers fail the obvious wrong answers and still pass the reference solutions.

Each test runs, on a real gloo cluster, the lesson's own cells that its checker needs, then a solution and
the lesson's checker cell, and reads every rank's verdict. Cells are found by their text (the checker by
"# Checker for exercise N", the solution by "# Reference solution to exercise N"), so the tests follow
edits to the lessons. Lesson 04 runs on 4 ranks, as in the lesson; the others on the module's 2 ranks.
"""

from __future__ import annotations

import re
from pathlib import Path

import nbformat
import pytest
from IPython.utils.capture import capture_output

from tests.conftest import run_cell, running_cluster, shown_text

NOTEBOOKS = Path(__file__).resolve().parent.parent / "notebooks"


def lesson_cell(lesson: str, text: str) -> str:
    """The code of the one code cell of ``lesson`` containing ``text``, without a ``%%distributed`` line."""
    notebook = nbformat.read(NOTEBOOKS / f"{lesson}.ipynb", as_version=4)
    [source] = [cell.source for cell in notebook.cells if cell.cell_type == "code" and text in cell.source]
    first, _, rest = source.partition("\n")
    return rest if first.startswith("%%distributed") else source


def on_ranks(ip, code: str) -> str:
    """Run ``code`` on every rank; its shown text (the cell must not fail)."""
    captured, error = run_cell(ip, "", code)
    assert error is None, shown_text(captured)
    return shown_text(captured)


def verdicts(text: str, exercise: int) -> dict[int, str]:
    """``{rank: "pass" or "fail"}`` from the rank blocks (``[rank 1]``, ``[ranks 0,1]``, ``[ranks 0-3]``)."""
    found: dict[int, str] = {}
    ranks: list[int] = []
    for line in text.splitlines():
        if header := re.fullmatch(r"\[ranks? ([\d,\-]+)\]", line):
            ranks = []
            for part in header[1].split(","):
                first, _, last = part.partition("-")
                ranks += range(int(first), int(last or first) + 1)
        elif verdict := re.fullmatch(rf"exercise {exercise}: (pass|fail)", line):
            found.update(dict.fromkeys(ranks, verdict[1]))
    return found


def check(ip, lesson: str, exercise: int, solution: str, world_size: int) -> dict[int, str]:
    """Every rank's verdict of the lesson's checker after running ``solution`` on the ranks."""
    on_ranks(ip, solution)
    text = on_ranks(ip, lesson_cell(lesson, f"# Checker for exercise {exercise}"))
    found = verdicts(text, exercise)
    assert sorted(found) == list(range(world_size)), text
    return found


def assert_checker(ip, lesson: str, exercise: int, wrong: str, world_size: int) -> None:
    """The checker fails ``wrong`` on every rank and passes the lesson's reference solution on every rank."""
    assert set(check(ip, lesson, exercise, wrong, world_size).values()) == {"fail"}
    reference = lesson_cell(lesson, f"# Reference solution to exercise {exercise}")
    assert set(check(ip, lesson, exercise, reference, world_size).values()) == {"pass"}


# lesson 04: the ring, not a built-in collective

RING_WRONG = {
    (1, "built-in all_reduce"): """
def ring_reduce_scatter(tensor, group=None):
    dist.all_reduce(tensor, group=group)  # every chunk complete, no ring
    return (dist.get_rank(group) + 1) % dist.get_world_size(group)
""",
    (1, "the whole ring, both phases"): """
def ring_reduce_scatter(tensor, group=None):
    ring_all_reduce(tensor, group)  # 2(n-1) steps where the reduce-scatter takes n-1
    return (dist.get_rank(group) + 1) % dist.get_world_size(group)
""",
    (2, "built-in all_gather"): """
def ring_all_gather(chunk, group=None):
    pieces = [torch.zeros_like(chunk) for _ in range(dist.get_world_size(group))]
    dist.all_gather(pieces, chunk, group=group)
    return torch.cat(pieces)
""",
    (3, "built-in all_reduce MAX"): """
def ring_all_reduce_max(tensor, group=None):
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=group)
""",
}


def test_04_ring_exercises_must_use_the_ring(ip):
    """On the lesson's 4 ranks, with its helpers: reusable, ring_all_reduce, pass_right (the pipelined one
    the exercises run with) and the checkers' call counter. First in the module: no other cluster runs yet."""
    helpers = ("def reusable(", "def ring_all_reduce(", "SEGMENT_ELEMENTS = ", "# Used by the checkers")
    with running_cluster(ip, 4):
        for text in helpers:
            on_ranks(ip, lesson_cell("04_ring_allreduce", text))
        for (exercise, name), wrong in RING_WRONG.items():
            assert set(check(ip, "04_ring_allreduce", exercise, wrong, 4).values()) == {"fail"}, name
        for exercise in (1, 2, 3):
            reference = lesson_cell("04_ring_allreduce", f"# Reference solution to exercise {exercise}")
            assert set(check(ip, "04_ring_allreduce", exercise, reference, 4).values()) == {"pass"}, exercise


# lesson 00: one all_reduce, not a value by hand


COUNT_WRONG = {
    "value by hand": """
def count_ranks():
    return torch.ones(1) * world_size  # the right value, no communication
""",
    "all_reduce of another tensor": """
def count_ranks():
    dist.all_reduce(torch.ones(1))
    return torch.ones(1) * world_size  # still written in by hand
""",
}


@pytest.mark.parametrize("wrong", list(COUNT_WRONG))
def test_00_count_ranks_must_all_reduce(ip, cluster, wrong):
    assert_checker(ip, "00_start_here", 2, COUNT_WRONG[wrong], 2)


# lesson 05: weighted average through all_reduce

WEIGHTED_WRONG = {
    "no communication": """
def average_gradients_weighted(model, n_local):
    X15, y15 = make_data(n=15)  # the whole data set, rebuilt locally instead of communicating
    full = make_model().to(device)
    F.mse_loss(full(X15.to(device)), y15.to(device)).backward()
    for p, q in zip(model.parameters(), full.parameters()):
        p.grad.copy_(q.grad)
""",
    "total written in by hand": """
def average_gradients_weighted(model, n_local):
    for p in model.parameters():
        p.grad *= n_local
        dist.all_reduce(p.grad)
        p.grad /= 15  # right only for the 15 samples of the exercise text
""",
}


@pytest.mark.parametrize("wrong", list(WEIGHTED_WRONG))
def test_05_weighted_average_must_communicate(ip, cluster, wrong):
    for text in ("X_full, y_full = make_data()", "X = X_all.tensor_split"):  # make_data, make_model, X, y
        on_ranks(ip, lesson_cell("05_distributed_sgd", text))
    assert_checker(ip, "05_distributed_sgd", 2, WEIGHTED_WRONG[wrong], 2)


# lesson 06: your own comm hook, not the built-in one

HOOK_WRONG = {
    "built-in allreduce_hook": """
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks


def mean_hook(state, bucket):
    return default_hooks.allreduce_hook(state, bucket)
""",
    "built-in allreduce_hook renamed": """
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook as mean_hook
""",
}


@pytest.mark.parametrize("wrong", list(HOOK_WRONG))
def test_06_comm_hook_must_be_your_own(ip, cluster, wrong):
    on_ranks(ip, lesson_cell("06_ddp", "def wrap("))  # make_data, make_model, wrap, the shards X, y
    assert_checker(ip, "06_ddp", 2, HOOK_WRONG[wrong], 2)


# lesson 08: only rank 0 writes the file


def test_08_only_rank_0_writes_the_loss(ip, cluster, tmp_path):
    ip.user_ns["ckpt_dir"] = str(tmp_path)  # as the lesson pushes its checkpoint directory
    with capture_output():
        ip.run_line_magic("dist_push", "ckpt_dir")
    del ip.user_ns["ckpt_dir"]
    every_rank_writes = """
def save_with_global_loss(path, loss):
    global_loss = loss.detach().clone()
    dist.all_reduce(global_loss)
    torch.save({"loss": global_loss.item() / world_size}, path)  # on every rank: the right file, N times
    dist.barrier()
"""
    assert_checker(ip, "08_checkpointing", 2, every_rank_writes, 2)
