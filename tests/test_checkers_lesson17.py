"""Lesson 17's checkers fail wrong answers and wrong methods, and pass the reference and other right answers.

As in tests/test_checkers.py: on a real gloo cluster of 2 ranks, with the lesson's set-up cell run on every
rank (``attend``, ``NEG_INF``, ``F``, the sequence), the lesson's own checker cell runs after a wrong solution
(every rank must print ``not yet``) and after the lesson's reference solution (every rank ``pass``).
Both checkers count what the answer sends or receives, on the 2 ranks.
"""

from __future__ import annotations

import pytest

from tests.checker_harness import assert_checker, assert_run_all, check, lesson_cell, on_ranks
from tests.conftest import running_cluster

LESSON = "17_context_parallel"
WORLD = 2


@pytest.fixture(scope="module")
def lesson_ranks(ip):
    """2 ranks holding the lesson's set-up: ``attend`` and ``NEG_INF``."""
    with running_cluster(ip, WORLD) as magics:
        on_ranks(ip, lesson_cell(LESSON, '"""Lesson 17\'s set-up'))
        yield magics


# exercise 1: causal attention on the plain split, each rank receiving only the blocks before it

NEEDED_WRONG = {
    "the ring of section 3: every block to every rank (right values)": """
def causal_attention_needed_only(q, k, v):
    world, me = dist.get_world_size(), dist.get_rank()
    mine = torch.stack([k, v]).contiguous()
    blocks, current = {me: mine}, mine
    for step in range(1, world):
        arriving = torch.empty_like(mine)
        requests = [dist.isend(current, (me + 1) % world), dist.irecv(arriving, (me - 1) % world)]
        for request in requests:
            request.wait()
        blocks[(me - step) % world] = current = arriving
    kv = torch.cat([blocks[r] for r in range(world)], dim=3)
    s = q.shape[2]
    seen = torch.arange(me * s, (me + 1) * s)[:, None] >= torch.arange(kv.shape[3])[None, :]
    return F.scaled_dot_product_attention(q, kv[0], kv[1], attn_mask=seen)
""",
    "keys and values all-gathered (right values)": """
def causal_attention_needed_only(q, k, v):
    world, me = dist.get_world_size(), dist.get_rank()
    mine = torch.stack([k, v]).contiguous()
    blocks = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(blocks, mine)
    kv = torch.cat(blocks, dim=3)
    s = q.shape[2]
    seen = torch.arange(me * s, (me + 1) * s)[:, None] >= torch.arange(kv.shape[3])[None, :]
    return F.scaled_dot_product_attention(q, kv[0], kv[1], attn_mask=seen)
""",
    "the ring of section 3 with isend/irecv imported from torch.distributed (right values)": """
def causal_attention_needed_only(q, k, v):
    from torch.distributed import irecv, isend
    world, me = dist.get_world_size(), dist.get_rank()
    mine = torch.stack([k, v]).contiguous()
    blocks, current = {me: mine}, mine
    for step in range(1, world):
        arriving = torch.empty_like(mine)
        requests = [isend(current, (me + 1) % world), irecv(arriving, (me - 1) % world)]
        for request in requests:
            request.wait()
        blocks[(me - step) % world] = current = arriving
    kv = torch.cat([blocks[r] for r in range(world)], dim=3)
    s = q.shape[2]
    seen = torch.arange(me * s, (me + 1) * s)[:, None] >= torch.arange(kv.shape[3])[None, :]
    return F.scaled_dot_product_attention(q, kv[0], kv[1], attn_mask=seen)
""",
    "no communication (this rank's own keys only)": """
def causal_attention_needed_only(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)
""",
    "the earlier blocks received, the mask forgotten": """
def causal_attention_needed_only(q, k, v):
    world, me = dist.get_world_size(), dist.get_rank()
    mine = torch.stack([k, v])
    sends = [dist.isend(mine, later) for later in range(me + 1, world)]
    blocks = [torch.empty_like(mine) for _ in range(me)]
    for earlier, block in enumerate(blocks):
        dist.recv(block, earlier)
    for request in sends:
        request.wait()
    kv = torch.cat(blocks + [mine], dim=3)
    return F.scaled_dot_product_attention(q, kv[0], kv[1])
""",
}


@pytest.mark.parametrize("wrong", list(NEEDED_WRONG))
def test_17_causal_attention_must_receive_only_the_blocks_before(ip, lesson_ranks, wrong):
    assert_checker(ip, LESSON, 1, NEEDED_WRONG[wrong], WORLD)


def test_17_causal_attention_forwarded_down_a_chain_passes(ip, lesson_ranks):
    """Another right method: the blocks go down a chain, each rank passing on the earlier ones and its own."""
    chain = """
def causal_attention_needed_only(q, k, v):
    world, me = dist.get_world_size(), dist.get_rank()
    mine = torch.stack([k, v]).contiguous()
    blocks = []
    for _ in range(me):
        block = torch.empty_like(mine)
        dist.recv(block, me - 1)
        if me + 1 < world:
            dist.send(block, me + 1)
        blocks.append(block)
    if me + 1 < world:
        dist.send(mine, me + 1)
    kv = torch.cat(blocks + [mine], dim=3)
    s = q.shape[2]
    seen = torch.arange(me * s, (me + 1) * s)[:, None] >= torch.arange(kv.shape[3])[None, :]
    return F.scaled_dot_product_attention(q, kv[0], kv[1], attn_mask=seen)
"""
    assert set(check(ip, LESSON, 1, chain, WORLD).values()) == {"pass"}


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
    "keys and values all-gathered, attention of my queries (right values, not Ulysses)": """
def ulysses_attention(q, k, v, causal):
    world = dist.get_world_size()
    ks, vs = [torch.empty_like(k) for _ in range(world)], [torch.empty_like(v) for _ in range(world)]
    dist.all_gather(ks, k.contiguous())
    dist.all_gather(vs, v.contiguous())
    k_all, v_all = torch.cat(ks, dim=2), torch.cat(vs, dim=2)
    s = q.shape[2]
    start = dist.get_rank() * s
    allowed = torch.arange(start, start + s)[:, None] >= torch.arange(world * s)[None, :]
    return F.scaled_dot_product_attention(q, k_all, v_all, attn_mask=allowed if causal else None)
""",
    "keys and values all-gathered by a from-imported all_gather (right values, not all-to-alls)": """
def ulysses_attention(q, k, v, causal):
    from torch.distributed import all_gather
    world = dist.get_world_size()
    ks, vs = [torch.empty_like(k) for _ in range(world)], [torch.empty_like(v) for _ in range(world)]
    all_gather(ks, k.contiguous())
    all_gather(vs, v.contiguous())
    k_all, v_all = torch.cat(ks, dim=2), torch.cat(vs, dim=2)
    s = q.shape[2]
    start = dist.get_rank() * s
    allowed = torch.arange(start, start + s)[:, None] >= torch.arange(world * s)[None, :]
    return F.scaled_dot_product_attention(q, k_all, v_all, attn_mask=allowed if causal else None)
""",
    "everything all-to-all'ed twice (right values, twice the bytes)": """
def ulysses_attention(q, k, v, causal):
    world = dist.get_world_size()
    b, h, s, d = q.shape

    def there_and_back_again(x):
        pieces = x.reshape(b, world, h // world, s, d).transpose(0, 1).contiguous()
        received = torch.empty_like(pieces)
        dist.all_to_all_single(received, pieces)
        again = torch.empty_like(received)
        dist.all_to_all_single(again, pieces)
        return received.permute(1, 2, 0, 3, 4).reshape(b, h // world, world * s, d)

    out = F.scaled_dot_product_attention(*(there_and_back_again(x) for x in (q, k, v)), is_causal=causal)
    pieces = out.reshape(b, h // world, world, s, d).permute(2, 0, 1, 3, 4).contiguous()
    received = torch.empty_like(pieces)
    dist.all_to_all_single(received, pieces)
    return received.transpose(0, 1).reshape(b, h, s, d)
""",
}


@pytest.mark.parametrize("wrong", list(ULYSSES_WRONG))
def test_17_ulysses_must_attend_over_the_whole_sequence(ip, lesson_ranks, wrong):
    assert_checker(ip, LESSON, 2, ULYSSES_WRONG[wrong], WORLD)


def test_17_ulysses_with_q_k_v_in_one_all_to_all_passes(ip, lesson_ranks):
    """Another right answer: q, k and v stacked and sent in one all-to-all (two collectives in all)."""
    stacked = """
def ulysses_attention(q, k, v, causal):
    world = dist.get_world_size()
    b, h, s, d = q.shape
    qkv = torch.stack([q, k, v])                                          # (3, b, h, s, d)
    pieces = qkv.reshape(3, b, world, h // world, s, d).permute(2, 0, 1, 3, 4, 5).contiguous()
    received = torch.empty_like(pieces)
    dist.all_to_all_single(received, pieces)                              # received[i]: rank i's tokens
    q2, k2, v2 = received.permute(1, 2, 3, 0, 4, 5).reshape(3, b, h // world, world * s, d)
    out = F.scaled_dot_product_attention(q2, k2, v2, is_causal=causal)
    back = out.reshape(b, h // world, world, s, d).permute(2, 0, 1, 3, 4).contiguous()
    home = torch.empty_like(back)
    dist.all_to_all_single(home, back)
    return home.transpose(0, 1).reshape(b, h, s, d)
"""
    assert set(check(ip, LESSON, 2, stacked, WORLD).values()) == {"pass"}


def test_17_run_all_checks_the_learners_answers(ip, lesson_ranks):
    wrong = {
        1: NEEDED_WRONG["the ring of section 3: every block to every rank (right values)"],
        2: ULYSSES_WRONG["attention over my own tokens only (no all-to-all)"],
    }
    assert_run_all(ip, LESSON, wrong, WORLD)
