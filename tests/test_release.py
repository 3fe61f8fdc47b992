"""No rank is left stuck: when a rank ends its part of a cell (it raises, exits, quits its
debugger, or the stop button is pressed), the ranks still waiting in communication are released
as part of the same cell, with their state, and the next cell runs with no command typed. A plain
hang (no rank ended) is only reported. On a real kernel with 4 gloo ranks, answered as a front end."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from tests.conftest import assert_gone, start_kernel_with_cluster
from tests.test_debugging import run_with_answers

STATE = "%%distributed\nmine = torch.tensor([10.0 + rank])"
# The next cell: each rank's state is still there, and a collective works at once. (The cells
# that fail pass other tensors to their collectives: a tensor in a collective that was cut may
# hold a partial result.)
NEXT = (
    "%%distributed\nprint('kept', mine.item())\nt = torch.ones(1)\ndist.all_reduce(t)\nprint('sum', t.item())"
)
RELEASED_3 = (
    "ranks 0,1,3 were waiting in all_reduce at cell line {line} and were released "
    "(state kept, new process group)"
)


@pytest.fixture(scope="module")
def kernel():
    """A real kernel with 4 ranks and a 1 s error grace, its manager (for the stop button)."""
    manager, client, processes, _ = start_kernel_with_cluster(4)
    client.execute_interactive("%config DistributedMagics.error_grace = 1.0", timeout=30)
    yield manager, client
    client.stop_channels()
    manager.shutdown_kernel(now=True)
    assert_gone(processes)


@pytest.fixture
def four(kernel):
    """Every rank holds state of its own (``mine``) before the test's cell."""
    manager, client = kernel
    status, _, text, _ = run_with_answers(client, STATE, [])
    assert status == "ok", text
    return manager, client


def assert_next_cell_runs_with_state_kept(client) -> None:
    status, _, text, error = run_with_answers(client, NEXT, [])
    assert status == "ok", f"{error}\n{text}"
    for rank in range(4):
        assert f"[rank {rank}]\nkept {10.0 + rank}\nsum 4.0" in text, text


def report_of(
    client, cell: str, answers: list[str] | None = None, stop_after: float | None = None, manager=None
):
    """Run ``cell``; its error line and the whole text the front end shows."""
    timer = threading.Timer(stop_after, manager.interrupt_kernel) if stop_after is not None else None
    if timer:
        timer.start()
    try:
        status, _, text, error = run_with_answers(client, cell, answers or [])
    finally:
        if timer:
            timer.cancel()
    assert status == "error", text
    return error, text


def test_an_exception_releases_the_ranks_waiting_in_the_collective(four):
    _, client = four
    cell = "%%distributed\nif rank == 2:\n    raise ValueError('bad input')\ndist.all_reduce(torch.ones(1))"
    error, text = report_of(client, cell)
    assert error == "rank 2 raised ValueError: bad input; " + RELEASED_3.format(line=3), text
    assert "[ranks 0,1,3] released: they were waiting in all_reduce at cell line 3" in text
    assert "%dist_recover" not in text
    assert_next_cell_runs_with_state_kept(client)


def test_sys_exit_on_a_rank_releases_the_others(four):
    _, client = four
    cell = "%%distributed\nimport sys\nif rank == 2:\n    sys.exit(1)\ndist.all_reduce(torch.ones(1))"
    error, text = report_of(client, cell)
    assert error == "rank 2 raised SystemExit: 1; " + RELEASED_3.format(line=4), text
    assert_next_cell_runs_with_state_kept(client)


def test_q_at_a_prompt_releases_the_others(four):
    _, client = four
    cell = "%%distributed\nif rank == 2:\n    breakpoint()\ndist.all_reduce(torch.ones(1))"
    error, _ = report_of(client, cell, ["q"])
    assert error == "rank 2 raised DebuggerQuit: the debugger was quit (q); " + RELEASED_3.format(line=3)
    assert_next_cell_runs_with_state_kept(client)


def test_the_stop_button_at_a_prompt_releases_the_others(four):
    manager, client = four
    cell = "%%distributed\nif rank == 2:\n    breakpoint()\ndist.all_reduce(torch.ones(1))"
    pressed = []

    def stop_button(message):
        pressed.append(message["content"]["prompt"])
        manager.interrupt_kernel()

    reply = client.execute_interactive(cell, timeout=60, allow_stdin=True, stdin_hook=stop_button)
    assert pressed == ["(Pdb rank 2) "]
    assert reply["content"]["status"] == "error"
    assert reply["content"]["evalue"] == (
        "rank 2 raised DebuggerQuit: the debugger was quit (q); " + RELEASED_3.format(line=3)
    )
    assert_next_cell_runs_with_state_kept(client)


def test_the_stop_button_during_a_hang_interrupts_python_and_releases_communication(four):
    """Rank 3 runs Python (interrupted, as before); ranks 0-2 wait in all_reduce for it, which an
    interrupt does not end: they are released once the interrupt grace is over."""
    manager, client = four
    cell = (
        "%%distributed\nimport time\nif rank == 3:\n    while True:\n        time.sleep(0.05)\n"
        "dist.all_reduce(torch.ones(1))"
    )
    error, text = report_of(client, cell, stop_after=3.0, manager=manager)
    assert error == (
        "rank 3 was interrupted; ranks 0-2 were waiting in all_reduce at cell line 5 and were released "
        "(state kept, new process group)"
    ), error
    assert "[ranks 0-2] released" in text
    assert_next_cell_runs_with_state_kept(client)


def test_a_raise_in_ddp_forward_releases_the_bucket_all_reduce_and_names_the_stale_model(four):
    _, client = four
    set_up = (
        "%%distributed\nimport torch.nn as nn\nfrom torch.nn.parallel import DistributedDataParallel as DDP\n"
        "class Picky(nn.Linear):\n    def forward(self, x):\n        if rank == 1:\n"
        "            raise RuntimeError('rank 1 rejects its batch')\n        return super().forward(x)\n"
        "torch.manual_seed(0)\nmodel = DDP(Picky(4, 2))"
    )
    status, _, text, _ = run_with_answers(client, set_up, [])
    assert status == "ok", text
    step = "%%distributed\nloss = model(torch.ones(3, 4)).sum()\nloss.backward()"
    error, text = report_of(client, step)
    assert error == (
        "rank 1 raised RuntimeError: rank 1 rejects its batch; ranks 0,2,3 were waiting in backward at "
        "cell line 2 and were released (state kept, new process group)"
    ), error
    assert "Stale on ranks 0-3: model (DistributedDataParallel) holds the old process group" in text, text
    assert_next_cell_runs_with_state_kept(client)


def test_a_rank_running_python_is_neither_interrupted_nor_released(four):
    """Where a rank that did not end runs Python, no new group can form: every rank is left where
    it is, and the report says why and what to do."""
    _, client = four
    cell = (
        "%%distributed --timeout 20\nimport time\nif rank == 2:\n    raise ValueError('bad')\n"
        "if rank == 3:\n    time.sleep(4)\ndist.all_reduce(torch.ones(1))"
    )
    error, text = report_of(client, cell)
    assert error.startswith("rank 2 raised ValueError: bad; ranks 0,1,3 still running"), error
    assert "rank 3 is running Python, not waiting in communication, so it was not interrupted" in text
    # Rank 3's step finishes: it joins the all_reduce, which still misses rank 2. %dist_recover.
    status, _, text, _ = run_with_answers(client, "%dist_recover", [])
    assert status == "ok", text
    assert_next_cell_runs_with_state_kept(client)


def test_a_plain_hang_is_only_reported(four):
    """No rank ended: a slow step may still finish, so nothing is released."""
    _, client = four
    error, text = report_of(client, "%%distributed --timeout 2\nif rank == 0:\n    dist.recv(mine, src=1)")
    assert error == "rank 0 still running after 2 s (rank 0 in recv at cell line 2)"
    assert "Run %dist_recover" in text
    status, _, text, error = run_with_answers(client, NEXT, [])
    assert status == "error" and "rank 0 still running an earlier cell" in error
    status, _, text, _ = run_with_answers(client, "%dist_recover", [])
    assert status == "ok", text
    assert_next_cell_runs_with_state_kept(client)


def stop_once_written(manager, client, cell: str, marks: Path, ranks: int, queued: str) -> tuple[dict, dict]:
    """Send ``cell``, then ``queued`` behind it, as Run All does; press the stop button once every
    one of ``ranks`` has written its mark (the ranks that finish, and those about to wait); the
    two replies."""
    first = client.execute(cell)
    second = client.execute(queued)
    deadline = time.monotonic() + 60
    while len(list(marks.glob("rank*"))) < ranks:
        assert time.monotonic() < deadline, f"marks written: {sorted(p.name for p in marks.iterdir())}"
        time.sleep(0.05)
    manager.interrupt_kernel()
    replies = {}
    while len(replies) < 2:
        reply = client.get_shell_msg(timeout=60)
        replies[reply["parent_header"]["msg_id"]] = reply["content"]
    return replies[first], replies[second]


@pytest.mark.parametrize("waiting", ["rank 0", "every rank"])
def test_the_stop_button_with_only_ranks_waiting_in_communication_is_an_error(four, tmp_path, waiting):
    """No rank raises: the waiting ranks are released, and the cell still ends in an error that
    says it was stopped, so the front end drops the cells queued after it."""
    manager, client = four
    waits = "rank == 0" if waiting == "rank 0" else "True"
    cell = (
        f"%%distributed\nfrom pathlib import Path\nPath({str(tmp_path)!r}, f'rank{{rank}}').touch()\n"
        f"if {waits}:\n    dist.recv(torch.zeros(1), src=(rank + 1) % world_size)"
    )
    queued = f"from pathlib import Path\nPath({str(tmp_path)!r}, 'queued cell ran').touch()"
    stopped, after = stop_once_written(manager, client, cell, tmp_path, 4, queued)
    assert stopped["status"] == "error", stopped
    label, were = ("rank 0", "was") if waiting == "rank 0" else ("ranks 0-3", "were")
    assert stopped["evalue"] == (
        f"the cell was stopped; {label} {were} waiting in recv at cell line 4 and {were} released "
        "(state kept, new process group)"
    ), stopped["evalue"]
    assert after["status"] == "aborted", after
    assert not (tmp_path / "queued cell ran").exists()
    assert_next_cell_runs_with_state_kept(client)


def test_q_releases_the_others_without_waiting_for_the_error_grace(four):
    """``q`` ends the rank on purpose: the others are released at once, not after error_grace
    (an hour here; the front end's wait for the reply is a minute)."""
    _, client = four
    status, _, text, _ = run_with_answers(client, "%config DistributedMagics.error_grace = 3600", [])
    assert status == "ok", text
    try:
        cell = "%%distributed\nif rank == 2:\n    breakpoint()\ndist.all_reduce(torch.ones(1))"
        error, _ = report_of(client, cell, ["q"])
        assert error == "rank 2 raised DebuggerQuit: the debugger was quit (q); " + RELEASED_3.format(line=3)
    finally:
        run_with_answers(client, "%config DistributedMagics.error_grace = 1.0", [])
    assert_next_cell_runs_with_state_kept(client)
