"""The lessons' exercise checkers fail the obvious wrong answers and pass the reference solutions, and
they test the learner's own answer when the notebook runs from top to bottom.

Every exercise has three cells, in this order: the learner's stub ("# Exercise N: your answer"), which
keeps the exercise's names; the checker ("# Checker for exercise N"), which tests those names; the
reference solution ("# Reference solution to exercise N"), whose names end in ``_reference`` so that it
never replaces the learner's answer. Two kinds of tests, on real gloo clusters:

- ``assert_checker``: a wrong answer, then the reference (its names given back), each followed by the
  checker.
- ``assert_run_all``: the lesson's exercise cells run in the notebook's order (stub, checker, reference,
  next stub, ...), with every stub replaced by a known-wrong answer, then by the reference's code: every
  checker must say "not yet" to the first and "pass" to the second. A reference that ran before its
  checker, or a cell that redefined the learner's names before the checker, fails it.

Cells are found by their text, so the tests follow edits to the lessons. Lesson 04 runs on 4 ranks, as in
the lesson; the others on the module's 2 ranks.
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
    """``{rank: "pass" or "fail"}`` from the rank blocks (``[rank 1]``, ``[ranks 0,1]``, ``[ranks 0-3]``);
    a checker prints ``exercise N: pass`` or ``exercise N: not yet: ...`` (read as "fail")."""
    found: dict[int, str] = {}
    ranks: list[int] = []
    for line in text.splitlines():
        if header := re.fullmatch(r"\[ranks? ([\d,\-]+)\]", line):
            ranks = []
            for part in header[1].split(","):
                first, _, last = part.partition("-")
                ranks += range(int(first), int(last or first) + 1)
        elif verdict := re.fullmatch(rf"exercise {exercise}: (pass|not yet: .+)", line):
            found.update(dict.fromkeys(ranks, "pass" if verdict[1] == "pass" else "fail"))
    return found


def check(ip, lesson: str, exercise: int, solution: str, world_size: int) -> dict[int, str]:
    """Every rank's verdict of the lesson's checker after running ``solution`` on the ranks."""
    on_ranks(ip, solution)
    text = on_ranks(ip, lesson_cell(lesson, f"# Checker for exercise {exercise}"))
    found = verdicts(text, exercise)
    assert sorted(found) == list(range(world_size)), text
    return found


def reference_answer(lesson: str, exercise: int) -> str:
    """The lesson's reference solution to ``exercise``, under the exercise's own names."""
    reference = lesson_cell(lesson, f"# Reference solution to exercise {exercise}")
    return re.sub(r"\b(\w+)_reference\b", r"\1", reference)


def assert_checker(ip, lesson: str, exercise: int, wrong: str, world_size: int) -> None:
    """The checker fails ``wrong`` on every rank and passes the lesson's reference solution on every rank."""
    assert set(check(ip, lesson, exercise, wrong, world_size).values()) == {"fail"}
    reference = reference_answer(lesson, exercise)
    assert set(check(ip, lesson, exercise, reference, world_size).values()) == {"pass"}


def exercise_cells(lesson: str) -> list[str]:
    """The lesson's code cells from the first exercise's stub to the last reference solution, in order."""
    notebook = nbformat.read(NOTEBOOKS / f"{lesson}.ipynb", as_version=4)
    code = [cell.source for cell in notebook.cells if cell.cell_type == "code"]
    first = next(i for i, source in enumerate(code) if "# Exercise 1: your answer" in source)
    last = max(i for i, source in enumerate(code) if "# Reference solution to exercise" in source)
    return code[first : last + 1]


def run_in_order(ip, lesson: str, answers: dict[int, str]) -> dict[int, dict[int, str]]:
    """Run the lesson's exercise cells in the notebook's order, each stub replaced by ``answers[N]`` (a
    ``%%distributed`` stub stays one); ``{exercise: {rank: "pass" or "fail"}}`` from every checker. A checker
    that runs in the notebook (not on the ranks) counts as rank 0."""
    found: dict[int, dict[int, str]] = {}
    stubs = []
    for source in exercise_cells(lesson):
        if stub := re.search(r"# Exercise (\d+): your answer", source):
            stubs.append(int(stub[1]))
            first = source.partition("\n")[0]
            source = (first + "\n" if first.startswith("%%distributed") else "") + answers[int(stub[1])]
        with capture_output() as captured:
            result = ip.run_cell(source)
        shown = shown_text(captured) if source.startswith("%%distributed") else "[rank 0]\n" + captured.stdout
        assert result.error_in_exec is None and result.error_before_exec is None, (lesson, source, shown)
        if checker := re.search(r"# Checker for exercise (\d+)", source):
            found[int(checker[1])] = verdicts(shown, int(checker[1]))
    assert sorted(stubs) == sorted(answers) == sorted(found), (lesson, stubs, sorted(found))
    return found


def assert_run_all(ip, lesson: str, wrong: dict[int, str], world_size: int) -> None:
    """Run All, with the stubs replaced by ``wrong`` answers, then by the reference solutions: every checker
    says "not yet" to the first and "pass" to the second, on every rank (a notebook checker: rank 0 only)."""
    right = {exercise: reference_answer(lesson, exercise) for exercise in wrong}
    for answers, expected in ((wrong, "fail"), (right, "pass")):
        for exercise, per_rank in run_in_order(ip, lesson, answers).items():
            assert per_rank and set(per_rank) <= set(range(world_size)), (lesson, exercise, per_rank)
            assert set(per_rank.values()) == {expected}, (lesson, exercise, expected, per_rank)


# lesson 04: the ring, not a built-in collective

RING_WRONG = {
    (1, "built-in broadcast"): """
def ring_broadcast(tensor, src, group=None):
    dist.broadcast(tensor, src=src, group=group)
""",
    (1, "the whole tensor passed on n-1 times, not pipelined chunks"): """
def ring_broadcast(tensor, src, group=None):
    me, n = dist.get_rank(group), dist.get_world_size(group)
    hop = (me - src) % n
    incoming = torch.empty_like(tensor)
    for step in range(n - 1):
        pass_right(tensor, incoming, group)
        if hop == step + 1:  # the left neighbour had src's values: keep them
            tensor.copy_(incoming)
""",
    (2, "built-in all_gather"): """
def ring_all_gather(chunk, group=None):
    pieces = [torch.zeros_like(chunk) for _ in range(dist.get_world_size(group))]
    dist.all_gather(pieces, chunk, group=group)
    return torch.cat(pieces)
""",
    (3, "built-in all_reduce per tensor"): """
def ring_all_reduce_many(tensors, group=None):
    for t in tensors:
        dist.all_reduce(t, group=group)
""",
    (3, "one ring per tensor"): """
def ring_all_reduce_many(tensors, group=None):
    for t in tensors:
        ring_all_reduce(t, group)  # 2(n-1) steps each, where one bucket takes 2(n-1) in all
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
            reference = reference_answer("04_ring_allreduce", exercise)
            assert set(check(ip, "04_ring_allreduce", exercise, reference, 4).values()) == {"pass"}, exercise
        first_wrong = {exercise: RING_WRONG[exercise, name] for exercise, name in reversed(RING_WRONG)}
        assert_run_all(ip, "04_ring_allreduce", first_wrong, 4)


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


def test_00_run_all_checks_the_learners_answers(ip, cluster):
    three = "mine = torch.full((3,), float(rank ** 2))  # three elements, not four"
    wrong = {1: three, 2: COUNT_WRONG["value by hand"]}
    assert_run_all(ip, "00_start_here", wrong, 2)


# lesson 02: point-to-point only (setup: section 5's p2p group and device)

P2P_WRONG = {
    1: """
def on_demand(n_jobs, work):
    if rank == 0:
        return [work(job) for job in range(n_jobs)]  # rank 0 runs every job itself: nothing handed out
    return []
""",
    2: """
def gather_to_zero(t):
    pieces = [torch.zeros_like(t) for _ in range(world_size)]
    dist.all_gather(pieces, t)  # a collective, not send/recv
    return pieces if rank == 0 else None
""",
    3: """
def exchange_with_neighbours(t):
    return t.clone(), t.clone()  # nothing exchanged
""",
}


ON_DEMAND_RESULTS_WRONG = """
def on_demand(n_jobs, work):
    request = torch.tensor([-1, 0], device=p2p_device)
    if rank == 0:
        results, handed_out, stopped = [None] * n_jobs, 0, 0
        while stopped < world_size - 1:
            worker = dist.recv(request, group=p2p)
            job, result = request.tolist()
            if job >= 0:
                results[job] = job  # the job's number, not work's result
            answer = handed_out if handed_out < n_jobs else -1
            dist.send(torch.tensor([answer], device=p2p_device), dst=worker, group=p2p)
            handed_out, stopped = (handed_out + 1, stopped) if answer >= 0 else (handed_out, stopped + 1)
        return results
    ran, job = [], torch.zeros(1, dtype=torch.int64, device=p2p_device)
    while True:
        dist.send(request, dst=0, group=p2p)
        dist.recv(job, src=0, group=p2p)
        if job.item() < 0:
            return ran
        ran.append(job.item())
        request = torch.tensor([job.item(), work(job.item())], device=p2p_device)
"""


def test_02_run_all_checks_the_learners_answers(ip, cluster):
    on_ranks(ip, lesson_cell("02_point_to_point", "p2p = None if"))
    assert_checker(ip, "02_point_to_point", 1, ON_DEMAND_RESULTS_WRONG, 2)
    assert_run_all(ip, "02_point_to_point", P2P_WRONG, 2)


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


def test_05_run_all_checks_the_learners_answers(ip, cluster):
    for text in ("X_full, y_full = make_data()", "X = X_all.tensor_split"):
        on_ranks(ip, lesson_cell("05_distributed_sgd", text))
    summed = """
def average_gradients_flat(model):
    flat = torch.cat([p.grad.flatten() for p in model.parameters()])
    dist.all_reduce(flat)  # summed, never divided by world_size
    offset = 0
    for p in model.parameters():
        p.grad.copy_(flat[offset:offset + p.grad.numel()].view_as(p.grad))
        offset += p.grad.numel()
"""
    assert_run_all(ip, "05_distributed_sgd", {1: summed, 2: WEIGHTED_WRONG["total written in by hand"]}, 2)


# lesson 06: the loss for uneven shards under DDP; your own comm hook, not the built-in one

SHARD_LOSS_WRONG = {
    "each rank's plain mean": """
def shard_loss(output, target):
    return F.mse_loss(output, target)  # every rank weighs the same, whatever its number of rows
""",
    "sum over the global count, not scaled by world_size": """
def shard_loss(output, target):
    count = torch.tensor(float(target.numel()), device=target.device)
    dist.all_reduce(count)
    return F.mse_loss(output, target, reduction="sum") / count  # DDP divides by world_size once more
""",
    "total written in by hand": """
def shard_loss(output, target):
    return F.mse_loss(output, target, reduction="sum") * world_size / 16  # right only for 16 rows
""",
    "weighted by the local count only": """
def shard_loss(output, target):
    return F.mse_loss(output, target) * len(target)  # never divided by the total
""",
    "not a loss": """
def shard_loss(output, target):
    return (output - target).pow(2).sum().item()
""",
}

NOT_YET_BECAUSE = {
    "each rank's plain mean": "plain average of the ranks' mean losses",
    "sum over the global count, not scaled by world_size": "0.5 times the full-batch ones",
    "total written in by hand": "right for 16 rows but not for 10",
    "weighted by the local count only": "differ from one process's F.mse_loss",
    "not a loss": "should return a scalar tensor",
}


@pytest.mark.parametrize("wrong", list(SHARD_LOSS_WRONG))
def test_06_shard_loss_weighs_ranks_by_their_rows(ip, cluster, wrong):
    on_ranks(ip, lesson_cell("06_ddp", "def wrap("))  # make_data, make_model, wrap, the shards X, y
    on_ranks(ip, SHARD_LOSS_WRONG[wrong])
    text = on_ranks(ip, lesson_cell("06_ddp", "# Checker for exercise 1"))
    assert NOT_YET_BECAUSE[wrong] in text, text  # the checker says what is wrong
    assert_checker(ip, "06_ddp", 1, SHARD_LOSS_WRONG[wrong], 2)


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


def test_06_run_all_checks_the_learners_answers(ip, cluster):
    on_ranks(ip, lesson_cell("06_ddp", "def wrap("))
    wrong = {1: SHARD_LOSS_WRONG["each rank's plain mean"], 2: HOOK_WRONG["built-in allreduce_hook"]}
    assert_run_all(ip, "06_ddp", wrong, 2)


# lesson 07: the sampler's indices, a new order every epoch

SAMPLER_WRONG = {
    1: """
import math


def my_indices(n, rank, world_size):
    per_rank = math.ceil(n / world_size)
    return list(range(rank * per_rank, min(n, (rank + 1) * per_rank)))  # blocks, not strided
""",
    2: """
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

data_ex2 = TensorDataset(torch.arange(24))
loader_ex2 = DataLoader(data_ex2, batch_size=6 // world_size, sampler=DistributedSampler(data_ex2, seed=7))


def epoch_order(epoch):
    return [i for (batch,) in loader_ex2 for i in batch.tolist()]  # no set_epoch: the same order every epoch
""",
}


def test_07_run_all_checks_the_learners_answers(ip, cluster):
    assert_run_all(ip, "07_data_loading", SAMPLER_WRONG, 2)


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
