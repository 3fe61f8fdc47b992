"""Lesson 04's exercise checkers refuse wrong answers and wrong methods and accept other right answers
(tests/checker_harness.py says how)."""

from __future__ import annotations

from tests.checker_harness import assert_run_all, check, lesson_cell, on_ranks, reference_answer
from tests.conftest import running_cluster

# lesson 04: the ring, not a built-in collective nor sends of one's own

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
    (1, "src as a global rank on the subgroup"): """
def ring_broadcast(tensor, src, group=None):
    me, n = dist.get_rank(group), dist.get_world_size(group)
    if group is not None and src in dist.get_process_group_ranks(group):
        src = dist.get_group_rank(group, src)  # src read as a global rank: wrong on a subgroup
    chunks = tensor.view(-1).tensor_split(n)
    idle = torch.zeros(1, dtype=tensor.dtype)
    hop = (me - src) % n
    for step in range(2 * (n - 1)):
        forward, take = step - hop, step - hop + 1
        outgoing = chunks[forward] if 0 <= forward < n and hop < n - 1 else idle
        incoming = chunks[take] if 0 <= take < n and hop > 0 else idle
        pass_right(outgoing, incoming, group)
""",
    (1, "the whole tensor at each of 2(n-1) steps"): """
def ring_broadcast(tensor, src, group=None):
    me, n = dist.get_rank(group), dist.get_world_size(group)
    hop = (me - src) % n
    incoming = torch.empty_like(tensor)
    for step in range(2 * (n - 1)):  # the right number of steps, each sending everything
        pass_right(tensor, incoming, group)
        if hop == step + 1:
            tensor.copy_(incoming)
""",
    (2, "built-in all_gather"): """
def ring_segmented_sum(tensor, starts, group=None):
    me = dist.get_rank(group)
    everyone = [torch.zeros_like(tensor) for _ in range(dist.get_world_size(group))]
    flags = [torch.zeros(1) for _ in everyone]
    dist.all_gather(everyone, tensor, group=group)
    dist.all_gather(flags, torch.tensor([float(starts or me == 0)]), group=group)
    first = max(i for i in range(me + 1) if flags[i].item())
    tensor.copy_(sum(everyone[first : me + 1]))
""",
    (2, "the prefix sum by the naive ring, starts ignored"): """
def ring_segmented_sum(tensor, starts, group=None):
    me, n = dist.get_rank(group), dist.get_world_size(group)
    travelling, arrived = tensor.clone(), torch.empty_like(tensor)
    for step in range(1, n):  # every rank's tensor goes round; keep what started at a lower rank
        pass_right(travelling, arrived, group)
        if step <= me:
            tensor += arrived
        travelling, arrived = arrived, travelling
""",
    (2, "a send and recv of its own, beside pass_right"): """
def ring_segmented_sum(tensor, starts, group=None):
    me, n = dist.get_rank(group), dist.get_world_size(group)
    incoming = torch.empty_like(tensor)
    for step in range(1, n):
        pass_right(tensor, incoming, group)
        if me == step and not starts:
            tensor += incoming
    if n > 1 and me == 0:  # an extra message outside the ring's steps
        dist.send(tensor, group=group, group_dst=1)
    elif n > 1 and me == 1:
        dist.recv(incoming, group=group, group_src=0)
""",
    (2, "the whole group's tensors in every step"): """
def ring_segmented_sum(tensor, starts, group=None):
    me, n = dist.get_rank(group), dist.get_world_size(group)
    rows = torch.zeros(n, tensor.numel() + 1)
    rows[me, :-1], rows[me, -1] = tensor, float(starts or me == 0)
    arrived = torch.empty_like(rows)
    for step in range(1, n):  # a growing table of every rank's tensor and flag: n tensors a step
        pass_right(rows, arrived, group)
        rows = torch.where(rows.abs().sum(1, keepdim=True) > 0, rows, arrived)
    first = max(i for i in range(me + 1) if rows[i, -1])
    tensor.copy_(rows[first : me + 1, :-1].sum(0))
""",
    (3, "built-in all_to_all"): """
def ring_all_to_all(pieces, group=None):
    got = [torch.empty_like(p) for p in pieces]
    dist.all_to_all(got, list(pieces), group=group)
    return got
""",
    (3, "every piece carried all the way round"): """
def ring_all_to_all(pieces, group=None):
    me, n = dist.get_rank(group), dist.get_world_size(group)
    got = [None] * n
    travelling = torch.stack(list(pieces))  # all n pieces, every step: (n-1) n pieces sent, not n(n-1)/2
    for step in range(1, n):
        arrived = torch.empty_like(travelling)
        pass_right(travelling, arrived, group)
        got[(me - step) % n] = arrived[me].clone()
        travelling = arrived
    got[me] = pieces[me].clone()
    return got
""",
}

SEGMENTS_BY_RELAY = """
def ring_segmented_sum(tensor, starts, group=None):
    me, n = dist.get_rank(group), dist.get_world_size(group)
    begins = starts or me == 0
    travelling = torch.cat([tensor.flatten(), torch.tensor([float(begins)])])  # the values, and "starts here"
    arrived = torch.empty_like(travelling)
    adding = not begins  # no start yet between the sender and this rank
    for step in range(1, n):  # every rank's tensor goes round; at step k the one of rank me - k arrives
        pass_right(travelling, arrived, group)
        if adding and step <= me:
            tensor += arrived[:-1].view_as(tensor)
            adding = arrived[-1].item() == 0.0
        travelling, arrived = arrived, travelling
"""
ALL_TO_ALL_FARTHEST_FIRST = """
def ring_all_to_all(pieces, group=None):
    me, n = dist.get_rank(group), dist.get_world_size(group)
    got = {me: pieces[me].clone()}
    bundle = torch.stack([pieces[(me - k) % n] for k in range(1, n)])  # farthest destination first
    for step in range(1, n):
        arrived = torch.empty_like(bundle)
        pass_right(bundle, arrived, group)
        got[(me - step) % n] = arrived[-1].clone()
        bundle = arrived[:-1].clone()
    return [got[r] for r in range(n)]
"""


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
        for exercise, right in ((2, SEGMENTS_BY_RELAY), (3, ALL_TO_ALL_FARTHEST_FIRST)):
            assert set(check(ip, "04_ring_allreduce", exercise, right, 4).values()) == {"pass"}, exercise
        first_wrong = {exercise: RING_WRONG[exercise, name] for exercise, name in reversed(RING_WRONG)}
        assert_run_all(ip, "04_ring_allreduce", first_wrong, 4)
