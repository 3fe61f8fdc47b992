"""Lesson 07's exercise checkers refuse wrong answers and pass the reference solutions
(tests/checker_harness.py says how)."""

from __future__ import annotations

import pytest

from tests.checker_harness import assert_checker, assert_run_all, lesson_cell, on_ranks

# lesson 07: how often the sampler reads each sample; an IterableDataset sharded by whole files

COUNTS_WRONG = {
    "pads with indices[: total - n] (wrong when the padding exceeds n)": """
def reads_per_sample(n, world_size, drop_last, shuffle, seed, epoch):
    per_rank = n // world_size if drop_last else -(-n // world_size)
    total = per_rank * world_size
    indices = torch.randperm(n, generator=torch.Generator().manual_seed(seed + epoch)).tolist() if shuffle \\
        else list(range(n))
    if total <= n:
        indices = indices[:total]
    else:
        indices += indices[: total - n]
    return [indices.count(i) for i in range(n)]
""",
    "asks DistributedSampler instead of computing": """
from torch.utils.data import DistributedSampler, TensorDataset


def reads_per_sample(n, world_size, drop_last, shuffle, seed, epoch):
    counts = [0] * n
    for r in range(world_size):
        sampler = DistributedSampler(TensorDataset(torch.arange(n)), num_replicas=world_size, rank=r,
                                     shuffle=shuffle, seed=seed, drop_last=drop_last)
        sampler.set_epoch(epoch)
        for i in sampler:
            counts[i] += 1
    return counts
""",
    "ignores drop_last": """
def reads_per_sample(n, world_size, drop_last, shuffle, seed, epoch):
    total = -(-n // world_size) * world_size
    return [total // n + (i < total % n) for i in range(n)]
""",
    "ignores the shuffle: pads and drops from the unshuffled list": """
def reads_per_sample(n, world_size, drop_last, shuffle, seed, epoch):
    per_rank = n // world_size if drop_last else -(-n // world_size)
    total = per_rank * world_size
    full, rest = divmod(total, n)
    return [full + (i < rest) for i in range(n)]
""",
    "the epoch left out of the seed": """
def reads_per_sample(n, world_size, drop_last, shuffle, seed, epoch):
    gen = torch.Generator().manual_seed(seed)
    order = torch.randperm(n, generator=gen).tolist() if shuffle else list(range(n))
    total = (n // world_size if drop_last else -(-n // world_size)) * world_size
    dealt = (order * (total // n + 1))[:total]
    return [dealt.count(i) for i in range(n)]
""",
}

COUNTS_RIGHT_OTHER = """
def reads_per_sample(n, world_size, drop_last, shuffle, seed, epoch):
    import math
    total = (n // world_size if drop_last else math.ceil(n / world_size)) * world_size
    if not shuffle:
        return [total // n + (i < total % n) for i in range(n)]
    gen = torch.Generator()
    gen.manual_seed(seed + epoch)
    order = torch.randperm(n, generator=gen)
    counts = torch.full((n,), total // n)
    counts[order[: total % n]] += 1  # the first total % n of the permutation are read once more
    return counts.tolist()
"""


@pytest.mark.parametrize("wrong", list(COUNTS_WRONG))
def test_07_reads_per_sample_refuses_wrong_methods(ip, cluster, wrong):
    assert_checker(ip, "07_data_loading", 1, COUNTS_WRONG[wrong], 2)


def test_07_reads_per_sample_accepts_another_right_answer(ip, cluster):
    checker = lesson_cell("07_data_loading", "# Checker for exercise 1")
    text = on_ranks(ip, COUNTS_RIGHT_OTHER + "\n" + checker)
    assert "exercise 1: pass" in text and "not yet" not in text, text


SHARDS_HEAD = """
import itertools
import heapq
from types import SimpleNamespace

from torch.utils.data import IterableDataset, get_worker_info


class FileShards(IterableDataset):
    def __init__(self, files, lengths, rank, world_size):
        self.files, self.lengths, self.rank, self.world_size = files, lengths, rank, world_size

    def __iter__(self):
        me = get_worker_info() or SimpleNamespace(id=0, num_workers=1)
        readers, reader = self.world_size * me.num_workers, self.rank * me.num_workers + me.id
"""
SHARDS_WRONG = {
    "every R-th file by name, the lesson's striding applied to files": SHARDS_HEAD
    + """
        for name in sorted(self.files)[reader::readers]:
            yield from self.files[name]
""",
    "every reader opens every file, keeps every R-th record": SHARDS_HEAD
    + """
        records = itertools.chain.from_iterable(self.files[name] for name in sorted(self.files))
        return itertools.islice(records, reader, None, readers)
""",
    "balanced, but every file read through items()": SHARDS_HEAD
    + """
        loads, owner = [0] * readers, {}
        for name, records in sorted(self.files.items(), key=lambda item: -len(item[1])):
            owner[name] = min(range(readers), key=lambda k: (loads[k], k))
            loads[owner[name]] += len(records)
        for name in sorted(owner):
            if owner[name] == reader:
                yield from self.files[name]
""",
    "balanced over the ranks, the workers of a rank repeat each other": SHARDS_HEAD
    + """
        loads, owner = [0] * self.world_size, {}
        for name in sorted(self.lengths, key=lambda name: -self.lengths[name]):
            owner[name] = min(range(self.world_size), key=lambda k: (loads[k], k))
            loads[owner[name]] += self.lengths[name]
        for name in sorted(owner):
            if owner[name] == self.rank:
                yield from self.files[name]
""",
    "balanced by the number of files, not of records": SHARDS_HEAD
    + """
        by_length = sorted(self.lengths, key=lambda name: -self.lengths[name])
        for name in by_length[reader::readers]:
            yield from self.files[name]
""",
}

SHARDS_RIGHT_OTHER = SHARDS_HEAD + """
        # a heap of (records so far, reader), the ties to the highest reader number; files longest first
        heap = [(0, -k) for k in range(readers)]
        mine = []
        for name in sorted(self.lengths, key=lambda name: (-self.lengths[name], name)):
            load, negative = heapq.heappop(heap)
            if -negative == reader:
                mine.append(name)
            heapq.heappush(heap, (load + self.lengths[name], negative))
        for name in mine:
            yield from self.files[name]
"""


@pytest.mark.parametrize("wrong", list(SHARDS_WRONG))
def test_07_file_shards_refuses_wrong_methods(ip, cluster, wrong):
    assert_checker(ip, "07_data_loading", 2, SHARDS_WRONG[wrong], 2)


def test_07_file_shards_accepts_another_right_answer(ip, cluster):
    checker = lesson_cell("07_data_loading", "# Checker for exercise 2")
    text = on_ranks(ip, SHARDS_RIGHT_OTHER + "\n" + checker)
    assert "exercise 2: pass" in text and "not yet" not in text, text


def test_07_run_all_checks_the_learners_answers(ip, cluster):
    by_rank_only = SHARDS_WRONG["balanced over the ranks, the workers of a rank repeat each other"]
    wrong = {1: COUNTS_WRONG["ignores drop_last"], 2: by_rank_only}
    assert_run_all(ip, "07_data_loading", wrong, 2)


def test_07_file_shards_bound_is_the_best_whole_file_assignment():
    """The checker's bound: 3 files of 2 records on 2 readers are best read 4 and 2, not 3 and 3."""
    import itertools
    import math

    checker = lesson_cell("07_data_loading", "# Checker for exercise 2")
    code = checker[checker.index("def best_busiest") : checker.index("def check_ex2")]
    space = {"math": math}
    exec(code, space)
    assert space["best_busiest"]([2, 2, 2], 2) == 4
    for sizes, readers in (([7, 5, 4, 4, 3, 1], 3), ([40, 3, 25, 1, 9, 17], 4), ([6, 6, 5, 4, 3, 3, 1], 2)):
        every = itertools.product(range(readers), repeat=len(sizes))
        brute = min(max(sum(s for s, k in zip(sizes, a) if k == r) for r in range(readers)) for a in every)
        assert space["best_busiest"](sizes, readers) == brute
