"""Lesson 03's exercise checkers refuse wrong answers and wrong methods and accept other right answers
(tests/checker_harness.py says how)."""

from __future__ import annotations

from tests.checker_harness import assert_run_all, check, reference_answer
from tests.conftest import running_cluster

# lesson 03: one small collective for mean and std, an all-gather of uneven lengths, argmax in two numbers

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
    (1, "one all_gather of the three numbers"): """
def global_mean_std(x):
    mine = torch.stack([x.sum(), (x * x).sum(), torch.tensor(float(x.numel()), dtype=x.dtype)])
    stats = [torch.zeros_like(mine) for _ in range(world_size)]
    dist.all_gather(stats, mine)  # three numbers sent, but 3 * world_size received
    total, total_sq, count = torch.stack(stats).sum(0).tolist()
    mean = total / count
    return mean, (total_sq / count - mean * mean) ** 0.5
""",
    (1, "all_reduce past torch.distributed's functions"): """
def global_mean_std(x):
    stats = torch.stack([x.sum(), (x * x).sum(), torch.tensor(float(x.numel()), dtype=x.dtype)])
    dist.all_reduce(torch.zeros(1, dtype=x.dtype))  # the one call the checker sees ...
    dist.group.WORLD.allreduce([stats]).wait()  # ... and the ProcessGroup's own method, unseen by it
    total, total_sq, count = stats.tolist()
    mean = total / count
    return mean, (total_sq / count - mean * mean) ** 0.5
""",
    (2, "objects gathered"): """
def all_gather_uneven(x):
    everyone = [None] * world_size
    dist.all_gather_object(everyone, x)  # pickled: not a tensor collective
    return everyone
""",
    (2, "padded to a fixed size"): """
def all_gather_uneven(x):
    lengths = [torch.zeros(1, dtype=torch.int64) for _ in range(world_size)]
    dist.all_gather(lengths, torch.tensor([x.numel()]))
    padded = torch.zeros(64, dtype=x.dtype)  # a guess far above the longest tensor
    padded[: x.numel()] = x
    slots = [torch.zeros_like(padded) for _ in range(world_size)]
    dist.all_gather(slots, padded)
    return [slot[: int(n)] for slot, n in zip(slots, lengths)]
""",
    (2, "its own tensor everywhere"): """
def all_gather_uneven(x):
    return [x.clone() for _ in range(world_size)]  # no communication
""",
    (2, "send and recv"): """
def all_gather_uneven(x):
    lengths = [torch.zeros(1, dtype=torch.int64) for _ in range(world_size)]
    dist.all_gather(lengths, torch.tensor([x.numel()]))
    got = [torch.zeros(int(n), dtype=x.dtype) for n in lengths]
    got[rank] = x.clone()
    requests = [dist.isend(x, dst=other) for other in range(world_size) if other != rank]
    requests += [dist.irecv(got[other], src=other) for other in range(world_size) if other != rank]
    for req in requests:
        req.wait()
    return got
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
def all_gather_uneven(x):
    lengths = torch.zeros(world_size, dtype=torch.int64)
    lengths[rank] = x.numel()
    dist.all_reduce(lengths)  # every length, by a sum of one-hot rows
    got = []
    for src, n in enumerate(lengths.tolist()):
        slot = x.clone() if src == rank else torch.empty(n, dtype=x.dtype)
        dist.broadcast(slot, src=src)  # each rank's tensor in turn, from its owner
        got.append(slot)
    return got
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
