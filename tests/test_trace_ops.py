"""Every traced op on a real 4-rank gloo cluster: the recorded events, their matching, the figure.

Each case runs a cell with ``--diagram --trace tr`` whose inputs depend on the rank, then checks
the events by hand (op, peers, shapes, values before and after), checks that the real values
equal what ``simulated_trace`` computes for the same inputs, and inspects the drawn artists.
"""

from __future__ import annotations

import pytest

from ddp_magics.lessons import simulated_trace
from tests.conftest import run_cell, running_cluster, shown_text

WORLD = 4
OTHERS_TO = {dst: [(src, dst) for src in range(WORLD) if src != dst] for dst in range(WORLD)}
FROM = {src: [(src, dst) for dst in range(WORLD) if dst != src] for src in range(WORLD)}
ALL_PAIRS = [(a, b) for a in range(WORLD) for b in range(WORLD) if a != b]


@pytest.fixture(scope="module")
def cluster4(ip):
    with running_cluster(ip, WORLD) as magics:
        yield magics


def traced(ip, cell: str):
    """Run ``cell`` traced; returns (trace, captured output)."""
    captured, error = run_cell(ip, "--diagram --trace tr", cell)
    assert error is None, error
    return ip.user_ns["tr"], captured


def pairs(values):
    return [[10.0 * rank, 10.0 * rank + 1] for rank in range(WORLD)] if values is None else values


# op, cell, simulated op and its keyword arguments, the arrows the figure must have
CASES = {
    "broadcast": (
        "t = torch.tensor([10.0 * rank, 10.0 * rank + 1])\ndist.broadcast(t, src=2)",
        dict(root=2),
        FROM[2],
    ),
    "reduce": (
        "t = torch.tensor([10.0 * rank, 10.0 * rank + 1])\ndist.reduce(t, dst=1)",
        dict(root=1),
        OTHERS_TO[1],
    ),
    "all_reduce": (
        "t = torch.tensor([10.0 * rank, 10.0 * rank + 1])\ndist.all_reduce(t, op=dist.ReduceOp.MAX)",
        dict(reduce_op="MAX"),
        ALL_PAIRS,
    ),
    "gather": (
        "t = torch.tensor([10.0 * rank, 10.0 * rank + 1])\n"
        "out = [torch.zeros(2) for _ in range(world_size)] if rank == 3 else None\n"
        "dist.gather(t, out, dst=3)",
        dict(root=3),
        OTHERS_TO[3],
    ),
    "all_gather": (
        "t = torch.tensor([10.0 * rank, 10.0 * rank + 1])\n"
        "out = [torch.zeros(2) for _ in range(world_size)]\n"
        "dist.all_gather(out, t)",
        {},
        ALL_PAIRS,
    ),
    "all_gather_into_tensor": (
        "t = torch.tensor([10.0 * rank, 10.0 * rank + 1])\n"
        "out = torch.zeros(2 * world_size)\n"
        "dist.all_gather_into_tensor(out, t)",
        {},
        ALL_PAIRS,
    ),
    "all_gather_single": (
        "t = torch.tensor([10.0 * rank, 10.0 * rank + 1])\n"
        "out = torch.zeros(2 * world_size)\n"
        "dist.all_gather_single(out, t)",
        {},
        ALL_PAIRS,
    ),
    "scatter": (
        "chunks = list(torch.arange(8.0).chunk(world_size)) if rank == 0 else None\n"
        "t = torch.zeros(2)\n"
        "dist.scatter(t, chunks, src=0)",
        dict(root=0),
        FROM[0],
    ),
    "reduce_scatter": (
        "parts = list((torch.arange(8.0) + 10 * rank).chunk(world_size))\n"
        "out = torch.zeros(2)\n"
        "dist.reduce_scatter(out, parts)",
        {},
        ALL_PAIRS,
    ),
    "reduce_scatter_tensor": (
        "t = torch.arange(8.0) + 10 * rank\nout = torch.zeros(2)\ndist.reduce_scatter_tensor(out, t)",
        {},
        ALL_PAIRS,
    ),
    "reduce_scatter_single": (
        "t = torch.arange(8.0) + 10 * rank\nout = torch.zeros(2)\ndist.reduce_scatter_single(out, t)",
        {},
        ALL_PAIRS,
    ),
    "all_to_all": (
        "parts = list((torch.arange(4.0) + 10 * rank).chunk(world_size))\n"
        "out = [torch.zeros(1) for _ in range(world_size)]\n"
        "dist.all_to_all(out, parts)",
        {},
        ALL_PAIRS,
    ),
    "all_to_all_single": (
        "t = torch.arange(4.0) + 10 * rank\nout = torch.zeros(4)\ndist.all_to_all_single(out, t)",
        {},
        ALL_PAIRS,
    ),
    "barrier": ("dist.barrier()", {}, []),
}
INPUTS = {
    "scatter": [[float(x) for x in range(8)], [], [], []],
    "reduce_scatter": [[10.0 * rank + i for i in range(8)] for rank in range(WORLD)],
    "reduce_scatter_tensor": [[10.0 * rank + i for i in range(8)] for rank in range(WORLD)],
    "reduce_scatter_single": [[10.0 * rank + i for i in range(8)] for rank in range(WORLD)],
    "all_to_all": [[10.0 * rank + i for i in range(4)] for rank in range(WORLD)],
    "all_to_all_single": [[10.0 * rank + i for i in range(4)] for rank in range(WORLD)],
    "barrier": [[] for _ in range(WORLD)],
}


@pytest.mark.parametrize("op", list(CASES))
def test_collective_is_traced_matched_and_drawn(ip, cluster4, op):
    cell, simulated_options, arrows = CASES[op]
    trace, captured = traced(ip, cell)

    assert trace.complete and not trace.mismatches
    assert [step.op for step in trace.steps] == [op]
    step = trace.steps[0]
    assert step.kind == "collective" and step.group == (0, 1, 2, 3) and step.ranks == [0, 1, 2, 3]
    for rank, event in step.events.items():
        assert (event.rank, event.seq, event.op, event.status) == (rank, 1, op, "done")
        assert event.line == cell.count("\n") + 1  # the last line of the cell made the call
    expected = simulated_trace(op, INPUTS.get(op) or pairs(None), **simulated_options).steps[0]
    if op == "reduce":  # the non-root ranks' tensors are unspecified afterwards (gloo reuses them)
        assert step.lines()[1] == expected.lines()[1] == "rank 1: [10.0, 11.0] -> [60.0, 64.0]"
        assert [line.split(" ->")[0] for line in step.lines()] == [
            line.split(" ->")[0] for line in expected.lines()
        ]
    else:
        assert step.lines() == expected.lines()
    assert sorted(step.flows()) == sorted(arrows)

    diagram = trace.draw()
    assert sorted(diagram.gids("arrow:")) == sorted(f"arrow:{a}->{b}" for a, b in arrows)
    for rank in range(WORLD):
        assert diagram.artists(f"before:{rank}") and diagram.artists(f"after:{rank}")
    # The text nbval compares is the one displayed after the ranks' output.
    assert captured.outputs[-1].data["text/plain"] == diagram.text


def test_values_before_and_after_are_the_real_ones(ip, cluster4):
    trace, _ = traced(ip, "t = torch.tensor([rank + 1.0, 1.0])\ndist.all_reduce(t)")
    events = trace.steps[0].events
    assert [events[rank].before[0].values for rank in range(WORLD)] == [(r + 1.0, 1.0) for r in range(WORLD)]
    assert {events[rank].after[0].values for rank in range(WORLD)} == {(10.0, 4.0)}
    assert events[0].reduce_op == "SUM" and events[0].primary.shape == (2,)
    assert events[0].primary.dtype == "float32"


def test_large_tensors_keep_shape_not_values(ip, cluster4):
    trace, _ = traced(ip, "t = torch.ones(4, 5)\ndist.all_reduce(t)")  # 20 elements > 16
    event = trace.steps[0].events[0]
    assert event.before[0].values is None and event.before[0].shape == (4, 5)
    assert "<4x5 float32> -> <4x5 float32>" in trace.text()
    cluster4.trace_values_limit = 32
    try:
        trace, _ = traced(ip, "t = torch.ones(4, 5)\ndist.all_reduce(t)")
    finally:
        cluster4.trace_values_limit = 16
    assert trace.steps[0].events[0].after[0].values == (4.0,) * 20


def test_send_recv_pairs_and_arrow(ip, cluster4):
    trace, _ = traced(
        ip,
        "t = torch.tensor([rank * 1.0, 7.0])\n"
        "if rank == 1:\n"
        "    dist.send(t, dst=3)\n"
        "elif rank == 3:\n"
        "    sender = dist.recv(t)\n",  # from any rank: the sender is learnt from recv's answer
    )
    assert not trace.mismatches
    (step,) = trace.steps
    assert step.kind == "transfer" and (step.send.rank, step.recv.rank) == (1, 3)
    assert step.send.peer == 3 and step.recv.peer == 1
    assert step.recv.before[0].values == (3.0, 7.0) and step.recv.after[0].values == (1.0, 7.0)
    assert trace.draw().gids("arrow:") == ["arrow:1->3"]


def test_isend_irecv_ring_is_a_timeline(ip, cluster4):
    trace, _ = traced(
        ip,
        "right, left = (rank + 1) % world_size, (rank - 1) % world_size\n"
        "inbox = torch.zeros(1)\n"
        "send = dist.isend(torch.tensor([float(rank)]), right)\n"
        "recv = dist.irecv(inbox, left)\n"
        "send.wait()\n"
        "recv.wait()\n",
    )
    assert not trace.mismatches
    transfers = [step for step in trace.steps if step.kind == "transfer"]
    assert sorted((s.send.rank, s.recv.rank) for s in transfers) == [(0, 1), (1, 2), (2, 3), (3, 0)]
    for step in transfers:
        assert step.recv.after[0].values == (float(step.send.rank),)
        assert step.columns[step.recv.rank] >= step.columns[step.send.rank]
    waits = [event for events in trace.events.values() for event in events if event.op == "wait"]
    assert len(waits) == 2 * WORLD and all(event.status == "done" for event in waits)
    assert {(w.rank, w.waited_op, w.waits_for) for w in waits if w.rank == 0} == {
        (0, "isend", 1),
        (0, "irecv", 2),
    }

    diagram = trace.draw()  # more than one step: a timeline
    assert len(diagram.gids("event:")) == 4 * WORLD
    numbers = {step.send.rank: n for n, step in enumerate(trace.steps, 1) if step.kind == "transfer"}
    assert sorted(diagram.gids("arrow:")) == sorted(
        f"arrow:{s}->{(s + 1) % WORLD}:{numbers[s]}" for s in range(WORLD)
    )


def test_async_collective_records_its_wait(ip, cluster4):
    trace, _ = traced(
        ip,
        "t = torch.tensor([float(rank)])\nwork = dist.all_reduce(t, async_op=True)\nwork.wait()",
    )
    collective, waits = trace.steps
    assert collective.op == "all_reduce" and all(e.async_op for e in collective.events.values())
    assert {e.after[0].values for e in collective.events.values()} == {(6.0,)}
    assert waits.title() == "wait for all_reduce SUM on ranks 0-3" and waits.ranks == [0, 1, 2, 3]
    assert {e.line for e in collective.events.values()} == {2} and {
        e.line for e in waits.events.values()
    } == {3}


def test_subgroup_collectives_are_matched_per_group(ip, cluster4):
    trace, _ = traced(
        ip,
        "low, high = dist.new_group([0, 1]), dist.new_group([2, 3])\n"
        "t = torch.tensor([float(rank)])\n"
        "dist.all_reduce(t, group=low if rank < 2 else high)\n"
        "dist.barrier()\n",
    )
    assert not trace.mismatches
    groups = sorted(step.group for step in trace.steps if step.op == "all_reduce")
    assert groups == [(0, 1), (2, 3)]
    by_group = {step.group: step for step in trace.steps if step.op == "all_reduce"}
    assert {e.after[0].values for e in by_group[(2, 3)].events.values()} == {(5.0,)}
    timeline = trace.draw()
    assert len(timeline.gids("collective:")) == 3  # two subgroup all_reduces and the barrier


def test_a_long_loop_is_listed_and_drawn_once_with_its_count(ip, cluster4):
    trace, _ = traced(ip, "t = torch.ones(1)\nfor _ in range(40):\n    dist.all_reduce(t)")
    assert len(trace.steps) == 40
    text = trace.text()
    assert "  1. all_reduce SUM on ranks 0-3\n" in text and "  2. " not in text
    assert "  2-40. step 1 again, 39 more times (the same calls; their values not listed)" in text
    diagram = trace.draw()
    assert len(diagram.gids("collective:")) == 1
    labels = [artist.get_text() for artist in diagram.artists("text:event:")]
    assert labels and all(label.startswith("1 x40 all_reduce") for label in labels)
    notes = [artist.get_text() for artist in diagram.artists("note:")]
    assert notes == ["Repeated steps drawn once: 'N xT' is step N of the listing, T times in a row"]


def test_a_loop_of_two_calls_is_grouped_by_its_period(ip, cluster4):
    cell = "t = torch.ones(1)\nfor _ in range(25):\n    dist.all_reduce(t)\n    dist.broadcast(t, 1)"
    trace, _ = traced(ip, cell)
    text = trace.text()
    assert "  1. all_reduce SUM on ranks 0-3\n" in text
    assert "  2. broadcast from rank 1 on ranks 0-3\n" in text
    assert "  3-50. steps 1-2 again, 24 more times" in text
    assert len(trace.draw().gids("collective:")) == 2


def test_a_long_trace_without_repeats_is_cut_and_says_so(ip, cluster4):
    # Roots 0-3 against an all_reduce every third call: a period of 12, longer than grouped.
    loop = "for i in range(40):\n    dist.broadcast(t, i % 4) if i % 3 else dist.all_reduce(t)"
    cell = f"t = torch.ones(1)\n{loop}"
    trace, _ = traced(ip, cell)
    assert len(trace.steps) == 40 and not trace.repeats()
    assert "... 10 more steps: 14 x all_reduce, 26 x broadcast" in trace.text()
    diagram = trace.draw()
    assert len(diagram.gids("collective:")) == 16  # the first 16 columns are drawn
    notes = [artist.get_text() for artist in diagram.artists("note:")]
    assert notes == ["... 24 more steps not drawn; all steps: 14 x all_reduce, 26 x broadcast"]


def test_tracing_is_off_unless_asked_and_leaves_nothing_after_the_cell(ip, cluster4):
    """Traced or not, torch.distributed's functions stay torch's own (code that holds them or
    checks them, as P2POp does, runs unchanged); our kernels on the dispatcher and the wait of
    handles are there for the traced cell only."""
    check = (
        "from torch.distributed import distributed_c10d as c10d\n"
        "print(dist.all_reduce is c10d.all_reduce, dist.isend is c10d.isend,\n"
        "      torch._C._dispatch_has_kernel_for_dispatch_key('c10d::allreduce_', 'BackendSelect'),\n"
        "      type(c10d.Work.wait).__name__ == 'instancemethod')"  # pybind's, not ours
    )
    untraced = "True True False True"
    for line, expected in (("", untraced), ("--trace during", "True True True False"), ("", untraced)):
        captured, error = run_cell(ip, line, check)
        assert error is None and shown_text(captured) == f"[ranks 0-3]\n{expected}"


def test_functions_imported_before_the_trace_and_p2p_ops_are_traced(ip, cluster4):
    """What holds torch.distributed's functions themselves: names imported before the traced
    cell, and batch_isend_irecv's P2POp (which checks it was given dist.isend itself)."""
    run_cell(ip, "", "from torch.distributed import all_reduce as reduce_early")
    cell = (
        "t = torch.tensor([float(rank)])\n"
        "reduce_early(t)\n"
        "right, left = (rank + 1) % world_size, (rank - 1) % world_size\n"
        "got = torch.zeros(1)\n"
        "ops = [dist.P2POp(dist.isend, t, right), dist.P2POp(dist.irecv, got, left)]\n"
        "for request in dist.batch_isend_irecv(ops):\n"
        "    request.wait()\n"
        "print(t.item(), got.item())"
    )
    captured, error = run_cell(ip, "--trace early", cell)
    assert error is None, error
    assert shown_text(captured) == "[ranks 0-3]\n6.0 6.0"
    trace = ip.user_ns["early"]
    assert not trace.mismatches
    paired = [step.op for step in trace.steps if step.kind != "solo"]
    assert paired == ["all_reduce"] + ["isend/irecv"] * WORLD
    assert {e.line for step in trace.steps for e in step.events.values() if e.op == "all_reduce"} == {2}
    transfers = [step for step in trace.steps if step.kind == "transfer"]
    ring = [(r, (r + 1) % WORLD) for r in range(WORLD)]
    assert sorted((s.send.rank, s.recv.rank) for s in transfers) == ring
    assert all(s.recv.after[0].values == (6.0,) for s in transfers)


def test_a_traced_cell_keeps_no_reference_to_its_groups(ip, cluster4):
    run_cell(ip, "", "import gc, weakref\npair = dist.new_group([0, 1])\nt = torch.ones(1)")
    captured, error = run_cell(ip, "--trace used", "if rank < 2:\n    dist.all_reduce(t, group=pair)")
    assert error is None and ip.user_ns["used"].steps[0].op == "all_reduce"
    check = (
        "alive = weakref.ref(pair)\ndist.destroy_process_group(pair)\n"
        "del pair\ngc.collect()\nprint(alive() is None)"
    )
    captured, error = run_cell(ip, "--ranks 0,1", check)  # the members: elsewhere pair is a placeholder
    assert error is None and shown_text(captured) == "[ranks 0,1]\nTrue"


def test_diagram_of_a_cell_without_calls_says_so(ip, cluster4):
    captured, error = run_cell(ip, "--diagram", "x = 1")
    assert error is None
    assert "the cell made no torch.distributed calls" in captured.stdout


def test_tensors_reused_or_replaced_are_described_per_call(ip, cluster4):
    trace, _ = traced(
        ip,
        "t = torch.ones(1)\n"
        "dist.all_reduce(t)\n"
        "dist.all_reduce(t)\n"  # the same small tensor: new values each call
        "for n in (20, 30):\n"
        "    big = torch.ones(n)\n"  # a new tensor, possibly at the old one's address
        "    dist.all_reduce(big)\n",
    )
    first, second, third, fourth = (step.events[0] for step in trace.steps)
    assert (first.before[0].values, first.after[0].values) == ((1.0,), (4.0,))
    assert (second.before[0].values, second.after[0].values) == ((4.0,), (16.0,))
    assert (third.primary.shape, fourth.primary.shape) == ((20,), (30,))
