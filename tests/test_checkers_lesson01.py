"""Lesson 01's exercise checkers refuse wrong answers and wrong methods and accept other right answers
(tests/checker_harness.py says how)."""

from __future__ import annotations

from tests.checker_harness import assert_checker, assert_run_all, check, lesson_cell, on_ranks
from tests.conftest import running_cluster

# lesson 01: overlapping subgroups, uneven nodes, a store hosted by another rank

LESSON_01_WRONG = {
    1: """
def neighbourhood_sum(x):
    near = {(rank - 1) % world_size, rank, (rank + 1) % world_size}
    total = torch.zeros(world_size, *x.shape, device=x.device)
    total[rank] = x
    dist.all_reduce(total)  # the whole world, each rank then keeping its neighbours' rows
    return sum(total[r] for r in near)
""",
    2: """
def place(rank, procs_per_node):
    return divmod(rank, procs_per_node[0])  # as if every node had node 0's count


def rank_of(node, local_rank, procs_per_node):
    return node * procs_per_node[0] + local_rank
""",
    3: """
from datetime import timedelta


def form_around(host_rank, port):
    store = dist.TCPStore("127.0.0.1", port, world_size, is_master=rank == 0, timeout=timedelta(seconds=30))
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size)  # the store on rank 0
""",
}
WORLD_ALL_REDUCE_MASKED = """
def neighbourhood_sum(x):
    near = {(rank - 1) % world_size, rank, (rank + 1) % world_size}
    total = torch.zeros(world_size, *x.shape, device=x.device)
    total[rank] = x
    dist.all_reduce(total, group=dist.group.WORLD)  # a world group passed by name is still the world
    return sum(total[r] for r in near)
"""
PAIRS = """
pairs = [dist.new_group(sorted({r, (r + 1) % world_size})) for r in range(world_size)]  # r with its right


def neighbourhood_sum(x):
    sums = {}
    for r, group in enumerate(pairs):  # the same order everywhere
        if rank in (r, (r + 1) % world_size):
            total = x.clone()
            dist.all_reduce(total, group=group)
            sums[r] = total
    return sums[(rank - 1) % world_size] + sums[rank] - x  # (left + me) + (me + right) - me
"""
WORLD_ALL_REDUCE_PAST_DIST = """
def neighbourhood_sum(x):
    near = {(rank - 1) % world_size, rank, (rank + 1) % world_size}
    total = torch.zeros(world_size, *x.shape, device=x.device)
    total[rank] = x
    dist.group.WORLD.allreduce([total]).wait()  # the ProcessGroup's own method: no torch.distributed function
    return sum(total[r] for r in near)
"""
NEIGHBOURS_POINT_TO_POINT = """
def neighbourhood_sum(x):
    left, right = (rank - 1) % world_size, (rank + 1) % world_size
    from_left, from_right = torch.empty_like(x), torch.empty_like(x)
    requests = [dist.isend(x, right), dist.isend(x, left)]
    requests += [dist.irecv(from_left, left), dist.irecv(from_right, right)]
    for request in requests:
        request.wait()
    return x + from_left + from_right
"""
STORE_ON_THE_LAST_RANK = """
from datetime import timedelta


def form_around(host_rank, port):
    last = rank == world_size - 1
    store = dist.TCPStore("127.0.0.1", port, world_size, is_master=last, timeout=timedelta(seconds=30))
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size)  # always the last rank
"""
STORE_BESIDE_THE_MEETING = """
from datetime import timedelta


def form_around(host_rank, port):
    host = rank == host_rank
    store = dist.TCPStore("127.0.0.1", port, world_size, is_master=host, timeout=timedelta(seconds=30))
    globals()["kept_store"] = store
    if rank == host_rank:
        store.set("meet", str(free_port()))
    elsewhere = int(store.get("meet"))  # the ranks meet at another port: the host's store only passed it on
    meeting = f"tcp://127.0.0.1:{elsewhere}"
    dist.init_process_group(backend, init_method=meeting, rank=rank, world_size=world_size)
"""
PLACE_BY_BISECT = """
import bisect
import itertools


def place(rank, procs_per_node):
    ends = list(itertools.accumulate(procs_per_node))
    node = bisect.bisect_right(ends, rank)
    return node, rank - (ends[node - 1] if node else 0)


def rank_of(node, local_rank, procs_per_node):
    return [0, *itertools.accumulate(procs_per_node)][node] + local_rank
"""
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
        assert set(check(ip, "01_process_groups", 1, WORLD_ALL_REDUCE_MASKED, 4).values()) == {"fail"}
        assert set(check(ip, "01_process_groups", 1, WORLD_ALL_REDUCE_PAST_DIST, 4).values()) == {"fail"}
        assert set(check(ip, "01_process_groups", 3, STORE_FROM_URL, 4).values()) == {"fail"}  # rank 0 hosts
        assert set(check(ip, "01_process_groups", 3, STORE_ON_THE_LAST_RANK, 4).values()) == {"fail"}
        assert set(check(ip, "01_process_groups", 3, STORE_BESIDE_THE_MEETING, 4).values()) == {"fail"}
        assert set(check(ip, "01_process_groups", 1, NEIGHBOURS_POINT_TO_POINT, 4).values()) == {"pass"}
        assert set(check(ip, "01_process_groups", 1, PAIRS, 4).values()) == {"pass"}
        assert set(check(ip, "01_process_groups", 2, PLACE_BY_BISECT, 4).values()) == {"pass"}
        assert_run_all(ip, "01_process_groups", LESSON_01_WRONG, 4)
