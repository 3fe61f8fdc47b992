"""Lesson 07's exercise checkers refuse wrong answers and pass the reference solutions
(tests/checker_harness.py says how)."""

from __future__ import annotations

import pytest

from tests.checker_harness import assert_checker, assert_run_all, lesson_cell, on_ranks

# lesson 07: how often the sampler reads each sample; an IterableDataset sharded by whole files

COUNTS_WRONG = {
    "pads with indices[: total - n] (wrong when the padding exceeds n)": """
def reads_per_sample(n, world_size, drop_last):
    per_rank = n // world_size if drop_last else -(-n // world_size)
    total = per_rank * world_size
    indices = list(range(n))
    if total <= n:
        indices = indices[:total]
    else:
        indices += indices[: total - n]
    return [indices.count(i) for i in range(n)]
""",
    "asks DistributedSampler instead of computing": """
from torch.utils.data import DistributedSampler, TensorDataset


def reads_per_sample(n, world_size, drop_last):
    counts = [0] * n
    for r in range(world_size):
        for i in DistributedSampler(TensorDataset(torch.arange(n)), num_replicas=world_size, rank=r,
                                    shuffle=False, drop_last=drop_last):
            counts[i] += 1
    return counts
""",
    "ignores drop_last": """
def reads_per_sample(n, world_size, drop_last):
    total = -(-n // world_size) * world_size
    return [total // n + (i < total % n) for i in range(n)]
""",
}

COUNTS_RIGHT_OTHER = """
def reads_per_sample(n, world_size, drop_last):
    import math
    total = (n // world_size if drop_last else math.ceil(n / world_size)) * world_size
    padded = (list(range(n)) * (total // n + 1))[:total]  # the list repeated as often as needed, then cut
    return [padded.count(i) for i in range(n)]
"""


@pytest.mark.parametrize("wrong", list(COUNTS_WRONG))
def test_07_reads_per_sample_refuses_wrong_methods(ip, cluster, wrong):
    assert_checker(ip, "07_data_loading", 1, COUNTS_WRONG[wrong], 2)


def test_07_reads_per_sample_accepts_another_right_answer(ip, cluster):
    checker = lesson_cell("07_data_loading", "# Checker for exercise 1")
    text = on_ranks(ip, COUNTS_RIGHT_OTHER + "\n" + checker)
    assert "exercise 1: pass" in text and "not yet" not in text, text


SHARDS_WRONG = {
    "every reader opens every file, keeps every R-th record": """
import itertools

from torch.utils.data import IterableDataset, get_worker_info


class FileShards(IterableDataset):
    def __init__(self, files):
        self.files = files

    def __iter__(self):
        info = get_worker_info()
        workers, worker = (info.num_workers, info.id) if info else (1, 0)
        readers, reader = dist.get_world_size() * workers, dist.get_rank() * workers + worker
        records = itertools.chain.from_iterable(self.files[name] for name in sorted(self.files))
        return itertools.islice(records, reader, None, readers)
""",
    "every file read through items(), only its own yielded": """
from torch.utils.data import IterableDataset, get_worker_info


class FileShards(IterableDataset):
    def __init__(self, files):
        self.files = files

    def __iter__(self):
        info = get_worker_info()
        workers, worker = (info.num_workers, info.id) if info else (1, 0)
        readers, reader = dist.get_world_size() * workers, dist.get_rank() * workers + worker
        for j, (name, records) in enumerate(sorted(self.files.items())):
            if j % readers == reader:
                yield from records
""",
    "sharded by rank only: the workers of a rank repeat each other": """
from torch.utils.data import IterableDataset


class FileShards(IterableDataset):
    def __init__(self, files):
        self.files = files

    def __iter__(self):
        for name in sorted(self.files)[dist.get_rank()::dist.get_world_size()]:
            yield from self.files[name]
""",
}

SHARDS_RIGHT_OTHER = """
from torch.utils.data import IterableDataset, get_worker_info


class FileShards(IterableDataset):
    '''Contiguous blocks of files per reader; reads the cell's rank and world_size.'''

    def __init__(self, files):
        self.files = files

    def __iter__(self):
        info = get_worker_info()
        workers = info.num_workers if info else 1
        reader = rank * workers + (info.id if info else 0)
        names = sorted(self.files)
        per, extra = divmod(len(names), world_size * workers)
        start = reader * per + min(reader, extra)
        for name in names[start : start + per + (reader < extra)]:
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
    by_rank_only = SHARDS_WRONG["sharded by rank only: the workers of a rank repeat each other"]
    wrong = {1: COUNTS_WRONG["ignores drop_last"], 2: by_rank_only}
    assert_run_all(ip, "07_data_loading", wrong, 2)
