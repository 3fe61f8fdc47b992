"""Lesson 03's exercise checkers refuse wrong answers and wrong methods and accept other right answers
(tests/checker_harness.py says how)."""

from __future__ import annotations

from tests.checker_harness import assert_run_all, check, reference_answer
from tests.conftest import running_cluster

# lesson 03: one small collective for mean and std, all-gather from broadcasts only, argmax in two numbers

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
    (1, "everyone's data gathered"): """
def global_mean_std(x):
    everything = [None] * world_size
    dist.all_gather_object(everything, x.cpu())  # one call, but it moves every value
    both = torch.cat(everything)
    return both.mean().item(), both.std(correction=0).item()
""",
    (2, "built-in all_gather"): """
def all_gather_by_broadcast(tensor_list, tensor):
    dist.all_gather(tensor_list, tensor)
""",
    (2, "send and recv"): """
def all_gather_by_broadcast(tensor_list, tensor):
    tensor_list[rank].copy_(tensor)
    for other in range(world_size):
        if other != rank:
            requests = [dist.isend(tensor, dst=other), dist.irecv(tensor_list[other], src=other)]
            for req in requests:
                req.wait()
""",
    (3, "the largest owner on ties"): """
def global_argmax(x):
    best = x.max().reshape(1).clone()
    dist.all_reduce(best, op=dist.ReduceOp.MAX)
    owner = torch.tensor([rank if x.max() == best[0] else -1], device=x.device)
    dist.all_reduce(owner, op=dist.ReduceOp.MAX)  # MAX picks the largest rank holding it
    return best.item(), int(owner.item())
""",
    (3, "every tensor gathered"): """
def global_argmax(x):
    everything = [torch.zeros_like(x) for _ in range(world_size)]
    dist.all_gather(everything, x)  # five numbers from every rank
    maxima = torch.stack([t.max() for t in everything])
    return maxima.max().item(), int(maxima.argmax().item())
""",
}

LESSON_03_RIGHT = {
    1: """
def global_mean_std(x):
    count = torch.tensor(float(x.numel()), dtype=x.dtype, device=x.device)
    local_mean = x.mean()
    stats = torch.stack([count, count * local_mean, ((x - local_mean) ** 2).sum() + count * local_mean ** 2])
    dist.all_reduce(stats)  # count, sum and sum of squares, in another order and form
    n, total, squares = stats.tolist()
    return total / n, (squares / n - (total / n) ** 2) ** 0.5
""",
    2: """
def all_gather_by_broadcast(tensor_list, tensor):
    for src, slot in enumerate(tensor_list):
        if src == rank:
            slot.copy_(tensor)
        dist.broadcast(slot, src=src, async_op=True).wait()  # asynchronous, waited at once
""",
    3: """
def global_argmax(x):
    maxima = [torch.zeros(1, device=x.device) for _ in range(world_size)]
    dist.all_gather(maxima, x.max().reshape(1))  # one number per rank
    maxima = torch.cat(maxima)
    return maxima.max().item(), int(maxima.argmax().item())  # argmax: the first, smallest rank
""",
}


def test_03_checkers_fail_wrong_answers_and_pass_the_reference(ip):
    with running_cluster(ip, 4):
        for (exercise, name), wrong in LESSON_03_WRONG.items():
            assert set(check(ip, "03_collectives", exercise, wrong, 4).values()) == {"fail"}, name
        for exercise in (1, 2, 3):
            reference = reference_answer("03_collectives", exercise)
            assert set(check(ip, "03_collectives", exercise, reference, 4).values()) == {"pass"}, exercise
        for exercise, right in LESSON_03_RIGHT.items():
            assert set(check(ip, "03_collectives", exercise, right, 4).values()) == {"pass"}, exercise
        first = {exercise: LESSON_03_WRONG[exercise, name] for exercise, name in reversed(LESSON_03_WRONG)}
        assert_run_all(ip, "03_collectives", first, 4)
