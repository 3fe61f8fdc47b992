"""Lesson 02's exercise checkers refuse wrong answers and pass the reference solutions
(tests/checker_harness.py says how)."""

from __future__ import annotations

from tests.checker_harness import assert_checker, assert_run_all, lesson_cell, on_ranks

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
