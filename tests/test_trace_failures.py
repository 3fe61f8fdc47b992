"""Mismatched calls made on purpose on a real 2-rank cluster: each is named, in the trace, in the
diagram and in the hang report; and a trace reaches the notebook when a cell raises or hangs."""

from __future__ import annotations

import os

import pytest

import ddp_magics
from ddp_magics import mismatches as trace_module
from ddp_magics.errors import DistributedCellError
from tests.conftest import run_cell

HANGS = {
    "missing": (
        "t = torch.ones(2)\nif rank == 0:\n    dist.all_reduce(t)",
        trace_module.MISSING_CALL,
        "collective #1 on ranks 0,1: rank 0 called all_reduce at line 3; rank 1 never called it",
        "rank 0 still running after 2 s (rank 0 in all_reduce SUM on ranks 0,1 at cell line 3)",
    ),
    "different ops": (
        "t = torch.ones(2)\nif rank == 0:\n    dist.all_reduce(t)\nelse:\n    dist.broadcast(t, src=1)",
        trace_module.DIFFERENT_OPS,
        "collective #1 on ranks 0,1: rank 0 called all_reduce at line 3, rank 1 called broadcast at line 5",
        None,
    ),
    "different shapes": (
        "t = torch.ones(2 + rank)\ndist.all_reduce(t)",
        trace_module.DIFFERENT_SHAPES,
        "collective #1 on ranks 0,1 (all_reduce): different shapes or dtypes: "
        "rank 0 shape (2,) float32, rank 1 shape (3,) float32",
        None,
    ),
    "different roots": (
        "t = torch.ones(2)\ndist.broadcast(t, src=rank)",
        trace_module.DIFFERENT_ROOTS,
        "collective #1 on ranks 0,1 (broadcast): different roots: rank 0 root rank 0, rank 1 root rank 1",
        None,
    ),
    "send without recv": (
        "if rank == 0:\n    dist.send(torch.ones(2), dst=1)",
        trace_module.SEND_WITHOUT_RECV,
        "rank 0 sends to rank 1 at line 2, but rank 1 posts no matching recv",
        "rank 0 still running after 2 s (rank 0 in send to rank 1 at cell line 2)",
    ),
    "recv without send": (
        "t = torch.zeros(2)\nif rank == 1:\n    dist.recv(t, src=0)",
        trace_module.RECV_WITHOUT_SEND,
        "rank 1 receives from rank 0 at line 3, but rank 0 never sends to it",
        "rank 1 still running after 2 s (rank 1 in recv from rank 0 at cell line 3)",
    ),
}


@pytest.mark.parametrize("case", list(HANGS))
def test_mismatch_that_hangs_is_named_in_trace_diagram_and_report(ip, healthy, case):
    cell, kind, message, summary = HANGS[case]
    captured, error = run_cell(ip, "--timeout 2 --diagram --trace tr", cell)

    assert isinstance(error, DistributedCellError)
    trace = ip.user_ns["tr"]
    assert not trace.complete
    assert [(m.kind, m.message) for m in trace.mismatches] == [(kind, message)]
    if summary is not None:
        assert str(error) == summary
    report = error._render_traceback_()
    assert f"Mismatch: {message}" in report
    # Each rank still running is placed in its traced call.
    for blocked in error.blocked:
        event = trace.in_progress(blocked.rank)
        assert event is not None and blocked.traced_call == event.call()
        assert f"[rank {blocked.rank}] still running, in {event.call()} at cell line {event.line}" in report
    # Stack lines name files without this machine's directories, ddp_magics' own tracing wrapper included.
    report_text = "\n".join(report)
    assert 'File "ddp_magics/engine/recorder.py"' in report_text and 'File "<cell>"' in report_text
    assert os.path.dirname(os.path.dirname(ddp_magics.__file__)) not in report_text
    # The diagram was shown before the error, with the mismatch in its text and in red on the figure.
    assert f"Mismatch: {message}" in captured.outputs[-1].data["text/plain"]
    assert trace.draw().gids("mismatch:")


def test_send_and_recv_of_different_sizes_is_named_without_a_hang(ip, healthy):
    _, error = run_cell(
        ip,
        "--timeout 10 --trace tr",
        "if rank == 0:\n    dist.send(torch.ones(2), dst=1)\nelse:\n    dist.recv(torch.zeros(3), src=0)",
    )
    trace = ip.user_ns["tr"]
    assert [m.kind for m in trace.mismatches] == [trace_module.SIZE_MISMATCH]
    assert trace.mismatches[0].message == (
        "rank 0 sends shape (2,) float32 at line 2, but rank 1 receives into shape (3,) float32 at line 4"
    )
    assert error is None or "Mismatch: " + trace.mismatches[0].message in error._render_traceback_()


def test_trace_reaches_the_notebook_when_a_rank_raises(ip, healthy):
    _, error = run_cell(
        ip,
        "--trace tr",
        "t = torch.tensor([rank + 1.0])\n"
        "dist.all_reduce(t)\n"
        "if rank == 1:\n"
        "    raise ValueError('after the sum')",
    )
    assert isinstance(error, DistributedCellError) and str(error) == "rank 1 raised ValueError: after the sum"
    trace = ip.user_ns["tr"]
    assert trace.complete and not trace.mismatches
    (step,) = trace.steps
    assert {event.after[0].values for event in step.events.values()} == {(3.0,)}


def test_calls_before_a_hang_are_complete_in_the_trace(ip, healthy):
    _, error = run_cell(
        ip,
        "--timeout 2 --trace tr",
        "t = torch.tensor([rank + 1.0])\ndist.all_reduce(t)\nif rank == 0:\n    dist.recv(t, src=1)",
    )
    assert isinstance(error, DistributedCellError)
    trace = ip.user_ns["tr"]
    first, second = trace.steps
    assert first.op == "all_reduce" and {e.status for e in first.events.values()} == {"done"}
    assert {e.after[0].values for e in first.events.values()} == {(3.0,)}
    assert second.events[0].status == "running" and second.events[0].call() == "recv from rank 1"
    assert "(cell not finished)" in trace.text()


def test_trace_name_must_be_an_identifier(ip, healthy):
    _, error = run_cell(ip, "--trace 1st", "x = 1")
    assert type(error).__name__ == "UsageError"
    assert str(error) == "--trace '1st': expected a variable name"


def test_a_rank_that_died_is_not_said_to_have_skipped_a_call(ip, healthy):
    """Its calls died with it: the trace says it died, and no mismatch blames it."""
    _, error = run_cell(
        ip,
        "--timeout 5 --diagram --trace tr",
        "import os\nt = torch.ones(2)\nif rank == 1:\n    os._exit(1)\ndist.all_reduce(t)",
    )
    assert isinstance(error, DistributedCellError) and error.dead == [1]
    trace = ip.user_ns["tr"]
    assert trace.lost == {1} and trace.mismatches == []
    assert "never called" not in trace.text()
    assert "rank 1 died: its calls are unknown" in trace.text()
    (step,) = trace.steps
    assert "rank 1: died before its calls were reported" in step.lines()
    assert "Mismatch" not in "\n".join(error._render_traceback_())


def test_a_call_blocked_inside_the_backend_is_in_the_hang_report(ip, healthy):
    # monitored_barrier waits inside the backend's op (as a first NCCL call creating its
    # communicator does), before the op returns: the call is recorded once it returns, so the
    # report reads it from the rank's stack meanwhile.
    _, error = run_cell(
        ip,
        "--timeout 2 --trace tr",
        "from datetime import timedelta\n"
        "if rank == 0:\n"
        "    dist.monitored_barrier(timeout=timedelta(seconds=4))",
    )
    call = "barrier on ranks 0,1 (monitored_barrier)"
    assert isinstance(error, DistributedCellError)
    assert str(error) == f"rank 0 still running after 2 s (rank 0 in {call} at cell line 3)"
    event = ip.user_ns["tr"].in_progress(0)
    assert event is not None and (event.op, event.line, event.status) == ("barrier", 3, "running")
    assert f"[rank 0] still running, in {call} at cell line 3" in error._render_traceback_()
