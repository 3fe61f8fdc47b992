"""Lesson 17's checkers fail the obvious wrong answers and pass the reference solutions.

As in tests/test_checkers.py: on a real gloo cluster of 2 ranks, with the lesson's set-up cell run on every
rank (``attend``, ``NEG_INF``, ``F``, the sequence), the lesson's own checker cell runs after a wrong solution
(every rank must print ``not yet``) and after the lesson's reference solution (every rank ``pass``).
Exercise 2's checker runs the learner's all-to-alls on the 2 ranks.
"""

from __future__ import annotations

import pytest

from tests.checker_harness import assert_checker, assert_run_all, lesson_cell, on_ranks
from tests.conftest import running_cluster

LESSON = "17_context_parallel"
WORLD = 2


@pytest.fixture(scope="module")
def lesson_ranks(ip):
    """2 ranks holding the lesson's set-up: ``attend`` and ``NEG_INF``."""
    with running_cluster(ip, WORLD) as magics:
        on_ranks(ip, lesson_cell(LESSON, '"""Lesson 17\'s set-up'))
        yield magics


# exercise 1: a CP rank's inputs, labels and positions under head-tail sharding

SHARD_WRONG = {
    "sharded first, then shifted inside the shard": """
def cp_shard(ids, rank, world_size):
    chunks = torch.arange(len(ids) - 1).chunk(2 * world_size)
    positions = torch.cat([chunks[rank], chunks[2 * world_size - 1 - rank]])
    mine = ids[positions]
    return mine, torch.cat([mine[1:], ids[-1:]]), positions
""",
    "labels not shifted (the inputs again)": """
def cp_shard(ids, rank, world_size):
    chunks = torch.arange(len(ids) - 1).chunk(2 * world_size)
    positions = torch.cat([chunks[rank], chunks[2 * world_size - 1 - rank]])
    return ids[positions], ids[positions], positions
""",
    "a plain contiguous split": """
def cp_shard(ids, rank, world_size):
    positions = torch.arange(len(ids) - 1).chunk(world_size)[rank]
    return ids[positions], ids[positions + 1], positions
""",
    "positions local to the rank (0, 1, 2, ...)": """
def cp_shard(ids, rank, world_size):
    chunks = torch.arange(len(ids) - 1).chunk(2 * world_size)
    positions = torch.cat([chunks[rank], chunks[2 * world_size - 1 - rank]])
    return ids[positions], ids[positions + 1], torch.arange(len(positions))
""",
    "the whole ids (S + 1 tokens) sharded, the last label lost": """
def cp_shard(ids, rank, world_size):
    chunks = torch.arange(len(ids)).chunk(2 * world_size)
    positions = torch.cat([chunks[rank], chunks[2 * world_size - 1 - rank]])
    return ids[positions], ids[(positions + 1).clamp(max=len(ids) - 1)], positions
""",
}


@pytest.mark.parametrize("wrong", list(SHARD_WRONG))
def test_17_cp_shard_must_shift_then_shard(ip, lesson_ranks, wrong):
    assert_checker(ip, LESSON, 1, SHARD_WRONG[wrong], WORLD)


# exercise 2: Ulysses attention, sequence split -> head split -> sequence split

ULYSSES_WRONG = {
    "attention over my own tokens only (no all-to-all)": """
def ulysses_attention(q, k, v, causal):
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal)
""",
    "the mask ignored": """
def ulysses_attention(q, k, v, causal):
    world = dist.get_world_size()
    b, h, s, d = q.shape

    def to_heads(x):
        pieces = x.reshape(b, world, h // world, s, d).transpose(0, 1).contiguous()
        received = torch.empty_like(pieces)
        dist.all_to_all_single(received, pieces)
        return received.permute(1, 2, 0, 3, 4).reshape(b, h // world, world * s, d)

    out = F.scaled_dot_product_attention(to_heads(q), to_heads(k), to_heads(v))
    pieces = out.reshape(b, h // world, world, s, d).permute(2, 0, 1, 3, 4).contiguous()
    received = torch.empty_like(pieces)
    dist.all_to_all_single(received, pieces)
    return received.transpose(0, 1).reshape(b, h, s, d)
""",
    "the received pieces laid out by rank, not along the sequence": """
def ulysses_attention(q, k, v, causal):
    world = dist.get_world_size()
    b, h, s, d = q.shape

    def to_heads(x):
        pieces = x.reshape(b, world, h // world, s, d).transpose(0, 1).contiguous()
        received = torch.empty_like(pieces)
        dist.all_to_all_single(received, pieces)
        return received.permute(1, 2, 3, 0, 4).reshape(b, h // world, world * s, d)

    out = F.scaled_dot_product_attention(to_heads(q), to_heads(k), to_heads(v), is_causal=causal)
    pieces = out.reshape(b, h // world, s, world, d).permute(3, 0, 1, 2, 4).contiguous()
    received = torch.empty_like(pieces)
    dist.all_to_all_single(received, pieces)
    return received.transpose(0, 1).reshape(b, h, s, d)
""",
    "the output not sent back (my heads' rows of the first tokens)": """
def ulysses_attention(q, k, v, causal):
    world = dist.get_world_size()
    b, h, s, d = q.shape

    def to_heads(x):
        pieces = x.reshape(b, world, h // world, s, d).transpose(0, 1).contiguous()
        received = torch.empty_like(pieces)
        dist.all_to_all_single(received, pieces)
        return received.permute(1, 2, 0, 3, 4).reshape(b, h // world, world * s, d)

    out = F.scaled_dot_product_attention(to_heads(q), to_heads(k), to_heads(v), is_causal=causal)
    return out[:, :, :s].repeat(1, world, 1, 1)
""",
}


@pytest.mark.parametrize("wrong", list(ULYSSES_WRONG))
def test_17_ulysses_must_attend_over_the_whole_sequence(ip, lesson_ranks, wrong):
    assert_checker(ip, LESSON, 2, ULYSSES_WRONG[wrong], WORLD)


def test_17_run_all_checks_the_learners_answers(ip, lesson_ranks):
    wrong = {
        1: SHARD_WRONG["sharded first, then shifted inside the shard"],
        2: ULYSSES_WRONG["attention over my own tokens only (no all-to-all)"],
    }
    assert_run_all(ip, LESSON, wrong, WORLD)
