"""Lesson 09's exercise checkers refuse wrong answers and pass the reference solutions
(tests/checker_harness.py says how)."""

from __future__ import annotations

from tests.checker_harness import assert_run_all, check, lesson_cell, on_ranks, reference_answer
from tests.conftest import running_cluster

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
