"""Lessons 01, 03 and 09: each exercise checker fails an obvious wrong answer on every rank and passes the
lesson's reference solution on every rank (the same method as tests/test_checkers.py, whose helpers run the
lesson's own cells, found by their text). Lessons 01 and 03 run on 4 ranks, as in the lessons; 09 on 2.
"""

from __future__ import annotations

from tests.conftest import running_cluster
from tests.test_checkers import assert_checker, assert_run_all, check, lesson_cell, on_ranks, reference_answer

# lesson 01: the even ranks, rank arithmetic, a store hosted by another rank

LESSON_01_WRONG = {
    1: """
evens = dist.new_group(list(range(0, world_size, 2)))


def sum_on_evens(x):
    total = x.clone()
    dist.all_reduce(total)  # over every rank, and odd ranks get a tensor instead of None
    return total
""",
    2: """
def global_rank(node_rank, local_rank, nproc_per_node):
    return local_rank * nproc_per_node + node_rank  # node and local rank swapped


def node_and_local(rank, nproc_per_node):
    return tuple(reversed(divmod(rank, nproc_per_node)))
""",
    3: """
from datetime import timedelta


def form_around(host_rank, port):
    store = dist.TCPStore("127.0.0.1", port, world_size, is_master=rank == 0, timeout=timedelta(seconds=30))
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size)  # the store on rank 0
""",
}
STORE_FROM_URL = """
def form_around(host_rank, port):
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
"""


def test_01_checkers_fail_wrong_answers_and_pass_the_reference(ip):
    with running_cluster(ip, 4):
        on_ranks(ip, "import os")
        on_ranks(ip, lesson_cell("01_process_groups", "def free_port("))  # also re-forms the group on tcp://
        for exercise, wrong in LESSON_01_WRONG.items():
            assert_checker(ip, "01_process_groups", exercise, wrong, 4)
        assert_checker(ip, "01_process_groups", 3, STORE_FROM_URL, 4)  # tcp://: rank 0 hosts the store
        assert_run_all(ip, "01_process_groups", LESSON_01_WRONG, 4)


# lesson 03: one all_reduce for mean and std, all-gather from broadcasts only, argmax's smallest owner

LESSON_03_WRONG = {
    (1, "two all_reduce calls"): """
def global_mean_std(x):
    sums = torch.stack([x.sum(), torch.tensor(float(x.numel()), dtype=x.dtype, device=x.device)])
    dist.all_reduce(sums)
    mean = (sums[0] / sums[1]).item()
    squares = ((x - mean) ** 2).sum().reshape(1)
    dist.all_reduce(squares)  # a second collective: right values, not what was asked
    return mean, (squares.item() / sums[1].item()) ** 0.5
""",
    (1, "no communication"): """
def global_mean_std(x):
    return x.mean().item(), x.std(correction=0).item()  # this rank's values only
""",
    (2, "built-in all_gather"): """
def all_gather_by_broadcast(tensor_list, tensor):
    dist.all_gather(tensor_list, tensor)
""",
    (3, "the largest owner on ties"): """
def global_argmax(x):
    best = x.max().reshape(1).clone()
    dist.all_reduce(best, op=dist.ReduceOp.MAX)
    owner = torch.tensor([rank if x.max() == best[0] else -1], device=x.device)
    dist.all_reduce(owner, op=dist.ReduceOp.MAX)  # MAX picks the largest rank holding it
    return best.item(), int(owner.item())
""",
}


def test_03_checkers_fail_wrong_answers_and_pass_the_reference(ip):
    with running_cluster(ip, 4):
        for (exercise, name), wrong in LESSON_03_WRONG.items():
            assert set(check(ip, "03_collectives", exercise, wrong, 4).values()) == {"fail"}, name
        for exercise in (1, 2, 3):
            reference = reference_answer("03_collectives", exercise)
            assert set(check(ip, "03_collectives", exercise, reference, 4).values()) == {"pass"}, exercise
        first = {exercise: LESSON_03_WRONG[exercise, name] for exercise, name in reversed(LESSON_03_WRONG)}
        assert_run_all(ip, "03_collectives", first, 4)


# lesson 09: a skip connection across the cut, inside DDP; the split checkpoint loaded on one device

SKIP_MODEL = """
class SkipAcrossCut(nn.Module):
    def __init__(self, dev0, dev1):
        super().__init__()
        self.dev0, self.dev1 = dev0, dev1
        FIRST_SKIP_SECOND

    def forward(self, x):
        h = torch.tanh(self.first(x.to(self.dev0)))
        return self.second(h.to(self.dev1)) + self.skip(x.to(self.dev1))
"""
IN_ORDER = """self.first = nn.Linear(3, 8).to(dev0)
        self.second = nn.Linear(8, 1).to(dev1)
        self.skip = nn.Linear(3, 1, bias=False).to(dev1)"""
SKIP_FIRST = """self.skip = nn.Linear(3, 1, bias=False).to(dev1)
        self.first = nn.Linear(3, 8).to(dev0)
        self.second = nn.Linear(8, 1).to(dev1)"""
LESSON_09_WRONG = {
    (1, "not wrapped in DDP"): SKIP_MODEL.replace("FIRST_SKIP_SECOND", IN_ORDER)
    + """

def make_skip_ddp(dev0, dev1):
    torch.manual_seed(0)
    return SkipAcrossCut(dev0, dev1)
""",
    (1, "the lesson's split, no skip"): """
def make_skip_ddp(dev0, dev1):
    torch.manual_seed(0)
    return DDP(TwoDeviceMLP(dev0, dev1))
""",
    (1, "skip created first: other weights"): SKIP_MODEL.replace("FIRST_SKIP_SECOND", SKIP_FIRST)
    + """

def make_skip_ddp(dev0, dev1):
    torch.manual_seed(0)
    return DDP(SkipAcrossCut(dev0, dev1))
""",
    (2, "a fresh model, nothing loaded"): """
single_ex2 = TwoDeviceMLP(device, device)
""",
}


def test_09_checkers_fail_wrong_answers_and_pass_the_reference(ip):
    lesson = "09_ddp_model_parallel"
    setup = (
        "n_gpus = torch.cuda.device_count()",
        "class TwoDeviceMLP(",
        "ddp_split = DDP(split)",
        "X_all = torch.randn(16, 3",
    )
    with running_cluster(ip, 2):
        for text in setup:
            on_ranks(ip, lesson_cell(lesson, text))
        for (exercise, name), wrong in LESSON_09_WRONG.items():
            assert set(check(ip, lesson, exercise, wrong, 2).values()) == {"fail"}, name
        for exercise in (1, 2):
            reference = reference_answer(lesson, exercise)
            assert set(check(ip, lesson, exercise, reference, 2).values()) == {"pass"}, exercise
        wrong = {exercise: LESSON_09_WRONG[exercise, name] for exercise, name in reversed(LESSON_09_WRONG)}
        assert_run_all(ip, lesson, wrong, 2)
