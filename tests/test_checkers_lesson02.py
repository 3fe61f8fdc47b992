"""Lesson 02's exercise checkers refuse wrong answers and wrong methods and accept other right answers
(tests/checker_harness.py says how)."""

from __future__ import annotations

from tests.checker_harness import assert_checker, assert_run_all, check, lesson_cell, on_ranks
from tests.conftest import running_cluster

# lesson 02: point-to-point only (setup: section 5's p2p group and device)

P2P_WRONG = {
    1: """
def on_demand(n_jobs, work):
    if rank == 0:
        return [work(job) for job in range(n_jobs)]  # rank 0 runs every job itself: nothing handed out
    return []
""",
    2: """
def exchange_all(pieces):
    got = [torch.empty_like(p) for p in pieces]
    dist.all_to_all(got, list(pieces))  # the right values, by a collective
    return got
""",
    3: """
def pipeline(batches, stage):
    stacked = torch.stack(list(batches))
    if rank > 0:
        dist.recv(stacked, src=rank - 1)  # every batch in one message: no stage overlaps another
    out = torch.stack([stage(x) for x in stacked])
    if rank < world_size - 1:
        dist.send(out, dst=rank + 1)
        return None
    return list(out)
""",
}

EXCHANGE_NONBLOCKING = """
def exchange_all(pieces):
    got = [p.clone() for p in pieces]
    requests = [dist.isend(pieces[r], dst=r) for r in range(world_size) if r != rank]
    requests += [dist.irecv(got[r], src=r) for r in range(world_size) if r != rank]
    for req in requests:
        req.wait()
    return got
"""
EXCHANGE_OTHER_ORDER = """
def exchange_all(pieces):
    got = list(pieces)
    pairs = [(a, b) for a in range(world_size) for b in range(a + 1, world_size)]
    pairs.sort(key=lambda pair: (-pair[1], pair[0]))
    for a, b in pairs:  # another order of the pairs, the same on every rank; the higher rank sends first
        if rank in (a, b):
            peer = a + b - rank
            got[peer] = torch.empty_like(pieces[peer])
            if rank == b:
                dist.send(pieces[peer], dst=peer)
                dist.recv(got[peer], src=peer)
            else:
                dist.recv(got[peer], src=peer)
                dist.send(pieces[peer], dst=peer)
    return got
"""
PIPELINE_BY_BROADCAST = """
def pipeline(batches, stage):
    outputs = []
    for slot in batches:
        x = slot.clone()
        for r in range(world_size):  # each stage in turn, its output broadcast to everyone: a collective
            if rank == r:
                x = stage(x)
            dist.broadcast(x, src=r)
        outputs.append(x)
    return outputs if rank == world_size - 1 else None
"""
PIPELINE_STORE_AND_FORWARD = """
def pipeline(batches, stage):
    held = [slot.clone() for slot in batches]
    if rank > 0:
        for x in held:
            dist.recv(x, src=rank - 1)  # every batch first, one message each: all m held at once
    out = [stage(x) for x in held]
    if rank < world_size - 1:
        for y in out:
            dist.send(y, dst=rank + 1)
        return None
    return out
"""
PIPELINE_PAST_DIST = """
def pipeline(batches, stage):
    outputs = []
    for slot in batches:
        x = slot.clone()
        if rank > 0:
            dist.group.WORLD.recv([x], rank - 1, 0).wait()  # the ProcessGroup's own methods: nothing recorded
        y = stage(x)
        if rank < world_size - 1:
            dist.group.WORLD.send([y], rank + 1, 0).wait()
        else:
            outputs.append(y)
    return outputs if rank == world_size - 1 else None
"""
PIPELINE_NONBLOCKING = """
def pipeline(batches, stage):
    last, outputs, pending = world_size - 1, [], []
    for slot in batches:
        x = torch.empty_like(slot)
        if rank == 0:
            x.copy_(slot)
        else:
            dist.irecv(x, src=rank - 1).wait()
        y = stage(x)
        if rank < last:
            pending.append(dist.isend(y, dst=rank + 1))  # y is new each time: safe to keep sending
        else:
            outputs.append(y)
    for req in pending:
        req.wait()
    return outputs if rank == last else None
"""


def test_02_checkers_refuse_wrong_methods_and_accept_other_right_answers(ip):
    """On the lesson's 3 ranks (an odd number: a schedule that only pairs ranks off would stall)."""
    with running_cluster(ip, 3):
        for exercise in (2, 3):
            assert_checker(ip, "02_point_to_point", exercise, P2P_WRONG[exercise], 3)
        assert set(check(ip, "02_point_to_point", 2, EXCHANGE_NONBLOCKING, 3).values()) == {"fail"}
        assert set(check(ip, "02_point_to_point", 3, PIPELINE_BY_BROADCAST, 3).values()) == {"fail"}
        assert set(check(ip, "02_point_to_point", 3, PIPELINE_STORE_AND_FORWARD, 3).values()) == {"fail"}
        assert set(check(ip, "02_point_to_point", 3, PIPELINE_PAST_DIST, 3).values()) == {"fail"}
        assert set(check(ip, "02_point_to_point", 2, EXCHANGE_OTHER_ORDER, 3).values()) == {"pass"}
        assert set(check(ip, "02_point_to_point", 3, PIPELINE_NONBLOCKING, 3).values()) == {"pass"}


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


ON_DEMAND_OTHER_PROTOCOL = """
def on_demand(n_jobs, work):
    message = torch.zeros(3, dtype=torch.int64, device=p2p_device)  # (asker, finished job or -1, its result)
    if rank == 0:
        results, queue, working = [None] * n_jobs, list(range(n_jobs)), world_size - 1
        while working:
            dist.recv(message, group=p2p)  # the asker names itself in the message
            asker, job, result = message.tolist()
            if job >= 0:
                results[job] = result
            go_on = bool(queue)
            reply = torch.tensor([queue.pop(0) if go_on else 0, int(go_on)], device=p2p_device)  # job, go on
            dist.send(reply, dst=asker, group=p2p)
            working -= 0 if go_on else 1
        return results
    ran, reply = [], torch.zeros(2, dtype=torch.int64, device=p2p_device)
    message = torch.tensor([rank, -1, 0], device=p2p_device)
    while True:
        dist.send(message, dst=0, group=p2p)
        dist.recv(reply, src=0, group=p2p)
        job, go_on = reply.tolist()
        if not go_on:
            return ran
        ran.append(job)
        message = torch.tensor([rank, job, work(job)], device=p2p_device)
"""


def test_02_run_all_checks_the_learners_answers(ip, cluster):
    on_ranks(ip, lesson_cell("02_point_to_point", "p2p = None if"))
    assert_checker(ip, "02_point_to_point", 1, ON_DEMAND_RESULTS_WRONG, 2)
    assert set(check(ip, "02_point_to_point", 1, ON_DEMAND_OTHER_PROTOCOL, 2).values()) == {"pass"}
    assert_run_all(ip, "02_point_to_point", P2P_WRONG, 2)
