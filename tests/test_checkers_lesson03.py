"""Lesson 03's exercise checkers refuse wrong answers and pass the reference solutions
(tests/checker_harness.py says how)."""

from __future__ import annotations

from tests.checker_harness import assert_run_all, check, reference_answer
from tests.conftest import running_cluster

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
