"""Lesson 07's exercise checkers refuse wrong answers and pass the reference solutions
(tests/checker_harness.py says how)."""

from __future__ import annotations

from tests.checker_harness import assert_run_all

# lesson 07: the sampler's indices, a new order every epoch

SAMPLER_WRONG = {
    1: """
import math


def my_indices(n, rank, world_size):
    per_rank = math.ceil(n / world_size)
    return list(range(rank * per_rank, min(n, (rank + 1) * per_rank)))  # blocks, not strided
""",
    2: """
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

data_ex2 = TensorDataset(torch.arange(24))
loader_ex2 = DataLoader(data_ex2, batch_size=6 // world_size, sampler=DistributedSampler(data_ex2, seed=7))


def epoch_order(epoch):
    return [i for (batch,) in loader_ex2 for i in batch.tolist()]  # no set_epoch: the same order every epoch
""",
}


def test_07_run_all_checks_the_learners_answers(ip, cluster):
    assert_run_all(ip, "07_data_loading", SAMPLER_WRONG, 2)
