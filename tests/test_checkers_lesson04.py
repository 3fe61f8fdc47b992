"""Lesson 04's exercise checkers refuse wrong answers and pass the reference solutions
(tests/checker_harness.py says how)."""

from __future__ import annotations

from tests.checker_harness import assert_run_all, check, lesson_cell, on_ranks, reference_answer
from tests.conftest import running_cluster

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
