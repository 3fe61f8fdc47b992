"""Standalone drawings (nothing runs) and the matching of hand-made traces."""

from __future__ import annotations

import re

import pytest

from ddp_magics.diagrams import Trace, draw_trace
from ddp_magics.lessons import draw_op, simulated_trace
from ddp_magics.mismatches import DIFFERENT_OPS
from ddp_magics.protocol import DONE, TraceEvent

INPUTS = [[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [7.0, 8.0, 9.0]]
ALL_PAIRS = [(a, b) for a in range(3) for b in range(3) if a != b]


@pytest.mark.parametrize(
    ("op", "options", "arrows", "after_rank_2"),
    [
        ("broadcast", dict(root=1), [(1, 0), (1, 2)], "[4.0, 5.0, 6.0]"),
        ("reduce", dict(root=2, reduce_op="max"), [(0, 2), (1, 2)], "[7.0, 8.0, 9.0]"),
        ("all_reduce", {}, ALL_PAIRS, "[12.0, 15.0, 18.0]"),
        ("all_reduce", dict(reduce_op="avg"), ALL_PAIRS, "[4.0, 5.0, 6.0]"),
        ("gather", dict(root=0), [(1, 0), (2, 0)], "-"),
        ("all_gather", {}, ALL_PAIRS, "[1.0, 2.0, 3.0]\n[4.0, 5.0, 6.0]\n[7.0, 8.0, 9.0]"),
        ("all_gather_into_tensor", {}, ALL_PAIRS, "[1.0, 2.0, 3.0, 4.0,\n5.0, 6.0, 7.0, 8.0,\n9.0]"),
        ("all_gather_single", {}, ALL_PAIRS, "[1.0, 2.0, 3.0, 4.0,\n5.0, 6.0, 7.0, 8.0,\n9.0]"),
        ("scatter", dict(root=1), [(1, 0), (1, 2)], "[6.0]"),
        ("reduce_scatter", {}, ALL_PAIRS, "[18.0]"),
        ("reduce_scatter_tensor", dict(reduce_op="min"), ALL_PAIRS, "[3.0]"),
        ("reduce_scatter_single", dict(reduce_op="min"), ALL_PAIRS, "[3.0]"),
        ("all_to_all", {}, ALL_PAIRS, "[3.0]\n[6.0]\n[9.0]"),
        ("all_to_all_single", {}, ALL_PAIRS, "[3.0, 6.0, 9.0]"),
        ("barrier", {}, [], "-"),
        ("send", dict(root=2, dst=0), [(2, 0)], "[7.0, 8.0, 9.0]"),
    ],
)
def test_draw_op_arrows_boxes_and_values(op, options, arrows, after_rank_2):
    diagram = draw_op(op, INPUTS, **options)
    assert sorted(diagram.gids("arrow:")) == sorted(f"arrow:{a}->{b}" for a, b in arrows)
    shown = sorted({rank for pair in arrows for rank in pair}) if op == "send" else [0, 1, 2]
    assert sorted(diagram.gids("before:")) == [f"before:{rank}" for rank in shown]
    (after_text,) = diagram.artists("text:after:2")
    assert after_text.get_text() == f"rank 2\n{after_rank_2}"
    assert diagram._repr_png_().startswith(b"\x89PNG")
    assert repr(diagram) == diagram.text == draw_op(op, INPUTS, **options).text  # deterministic


def test_draw_op_text_lists_values_before_and_after():
    assert draw_op("all_reduce", [[1.0], [2.0]]).text == (
        "1. all_reduce SUM on ranks 0,1\n   rank 0: [1.0] -> [3.0]\n   rank 1: [2.0] -> [3.0]"
    )
    assert draw_op("broadcast", [[5], [0], [0], [0]]).text == (
        "1. broadcast from rank 0 on ranks 0-3\n   rank 0: [5] -> [5]\n   ranks 1-3: [0] -> [5]"
    )
    # reduce leaves the other ranks' tensors unspecified
    assert draw_op("reduce", [[1.0], [2.0]]).text.endswith("rank 1: [2.0] -> ?")


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: draw_op("allreduce", INPUTS), "unknown op 'allreduce'"),
        (lambda: draw_op("all_reduce", INPUTS, reduce_op="mean"), "unknown reduce op 'MEAN'"),
        (
            lambda: draw_op("scatter", [[1.0, 2.0], [], []]),
            "scatter: 2 values do not split into 3 equal chunks",
        ),
        (lambda: draw_op("broadcast", INPUTS, root=5), "rank 5 does not exist among 3 ranks"),
        (lambda: draw_op("send", INPUTS, root=1, dst=1), "send: a rank cannot send to itself (rank 1)"),
    ],
)
def test_draw_op_rejects_bad_input_in_plain_words(call, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        call()


def event(rank, seq, op, group=(0, 1, 2, 3), name="world", **fields):
    return TraceEvent(rank=rank, seq=seq, op=op, group=group, group_name=name, status=DONE, **fields)


def test_collectives_in_different_orders_across_groups_fall_back_to_call_order():
    # ranks 0,1 share group A and B but call them in opposite orders: a real deadlock.
    a, b = dict(group=(0, 1), name="A"), dict(group=(0, 1), name="B")
    trace = Trace(
        {
            0: [event(0, 1, "all_reduce", **a), event(0, 2, "broadcast", root=0, **b)],
            1: [event(1, 1, "broadcast", root=0, **b), event(1, 2, "all_reduce", **a)],
        }
    )
    assert not trace.mismatches  # each group's calls agree; only their order differs
    assert {(step.op, tuple(sorted(step.columns.items()))) for step in trace.steps} == {
        ("all_reduce", ((0, 0), (1, 1))),
        ("broadcast", ((0, 1), (1, 0))),
    }
    assert len(trace.draw().gids("event:")) == 4


def test_different_ops_are_not_also_reported_as_different_shapes():
    trace = Trace({0: [event(0, 1, "all_reduce", group=(0, 1))], 1: [event(1, 1, "barrier", group=(0, 1))]})
    assert [m.kind for m in trace.mismatches] == [DIFFERENT_OPS]
    assert trace.steps[0].title() == "all_reduce/barrier on ranks 0,1 (ranks called different collectives)"
    assert trace.steps[0].flows() == []  # no arrows: the ranks did not agree on what moves


def test_simulated_trace_is_a_trace_without_mismatches():
    for op in ("all_reduce", "all_gather", "send"):
        trace = simulated_trace(op, [[1.0, 2.0], [3.0, 4.0]])
        assert len(trace.steps) == 1 and not trace.mismatches


def test_interleaved_groups_in_one_column_get_separate_bands_and_reduce_ops_are_named():
    # ranks 0,2 and ranks 1,3 each all-reduce in their own group, at the same time (one column)
    even, odd = dict(group=(0, 2), name="even"), dict(group=(1, 3), name="odd")
    calls = {0: ("SUM", even), 1: ("MAX", odd), 2: ("SUM", even), 3: ("MAX", odd)}
    trace = Trace(
        {rank: [event(rank, 1, "all_reduce", reduce_op=op, **group)] for rank, (op, group) in calls.items()}
    )
    assert not trace.mismatches and {step.column for step in trace.steps} == {0}
    diagram = draw_trace(trace, timeline=True)
    for number, step in enumerate(trace.steps, 1):
        bands = diagram.artists(f"collective:{number}")
        assert len(bands) == 2  # one band per member lane: lanes are not adjacent
        covered = {round(-(band.get_y() + band.get_height() / 2)) for band in bands}
        assert covered == set(step.group)
    labels = {artist.get_gid(): artist.get_text() for artist in diagram.artists("text:event:")}
    assert labels["text:event:1:1"].splitlines()[0].endswith("all_reduce MAX")  # named unless SUM
    assert labels["text:event:0:1"].splitlines()[0].endswith("all_reduce")


def test_a_step_on_16_ranks_is_one_readable_picture_and_listing():
    """Issue 25: 16 ranks, each with its own value. The listing keeps the first and last ranks and
    names those it leaves out; the picture draws a box for the first and last few ranks, one for
    the run between them, and the all-reduce's data going through one point, not 240 arrows."""
    from ddp_magics.lessons import simulated_trace

    trace = simulated_trace("all_reduce", [[float(rank)] for rank in range(16)])
    lines = trace.steps[0].lines()
    assert lines == [
        "rank 0: [0.0] -> [120.0]",
        "rank 1: [1.0] -> [120.0]",
        "rank 2: [2.0] -> [120.0]",
        "rank 3: [3.0] -> [120.0]",
        "ranks 4-13: one line each, not listed (lines(every_rank=True) lists them)",
        "rank 14: [14.0] -> [120.0]",
        "rank 15: [15.0] -> [120.0]",
    ]
    assert len(trace.steps[0].lines(every_rank=True)) == 16
    diagram = trace.draw()
    assert sorted(diagram.gids("before:")) == sorted(
        ["before:0", "before:1", "before:2", "before:3", "before:14", "before:15", "before:more:4-13"]
    )
    arrows = diagram.gids("arrow:")
    assert len(arrows) == 2 * 6 and "arrow:0->hub" in arrows and "arrow:hub->15" in arrows
    assert diagram.gids("hub") == ["hub"]
    # A rooted op keeps its own arrows, from the root to each rank drawn.
    broadcast = simulated_trace("broadcast", [[float(rank)] for rank in range(16)], root=9).draw()
    assert "before:9" in broadcast.gids("before:") and "arrow:9->0" in broadcast.gids("arrow:")
    assert not broadcast.gids("hub")
