"""Lesson 01's exercise checkers refuse wrong answers and pass the reference solutions
(tests/checker_harness.py says how)."""

from __future__ import annotations

from tests.checker_harness import assert_checker, assert_run_all, lesson_cell, on_ranks
from tests.conftest import running_cluster

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
