"""At 32 ranks on this machine's cores, recovery and release hold: a hang is recovered and a raise
releases the ranks waiting for it, each followed by a cell that works on every rank with its
state; a rank that ignores interrupts makes the recovery fail cleanly, every later cell refused in
one line until %dist_restart. (32 fresh engines on 2 cores were what made a fixed grace fail.)"""

from __future__ import annotations

import pytest
from IPython.core.error import UsageError
from IPython.utils.capture import capture_output

from ddp_magics.errors import DistributedCellError
from tests.conftest import run_cell, running_cluster, shown_text

WORLD = 32
EVERY_RANK = f"[ranks 0-{WORLD - 1}]"


@pytest.fixture(scope="module")
def many(ip):
    with running_cluster(ip, WORLD) as magics:
        run_cell(ip, "", "kept = rank * 10")
        yield magics


def next_cell_works(ip) -> None:
    captured, error = run_cell(
        ip, "", "t = torch.ones(1)\ndist.all_reduce(t)\nprint(int(t.item()), kept == rank * 10)"
    )
    assert error is None, f"{error}\n{shown_text(captured)}"
    assert shown_text(captured) == f"{EVERY_RANK}\n{WORLD} True"


def test_a_hang_at_32_ranks_is_recovered_and_the_next_cell_works(ip, many):
    hang = "t = torch.zeros(1)\nif rank == 3:\n    dist.recv(t, src=0)\nelse:\n    dist.barrier()"
    _, error = run_cell(ip, "--timeout 2", hang)
    assert isinstance(error, DistributedCellError), error
    assert error.summary().startswith(f"ranks 0-{WORLD - 1} still running after 2 s"), error.summary()
    with capture_output() as captured:
        ip.run_line_magic("dist_recover", "")
    assert captured.stdout.startswith(f"Recovered: a new gloo process group of {WORLD} ranks"), (
        captured.stdout
    )
    next_cell_works(ip)


def test_a_raise_at_32_ranks_releases_the_others_and_the_next_cell_works(ip, many):
    many.error_grace = 1.0
    try:
        raising = "if rank == 5:\n    raise ValueError('bad input')\ndist.all_reduce(torch.ones(1))"
        _, error = run_cell(ip, "", raising)
    finally:
        many.error_grace = 5.0
    assert isinstance(error, DistributedCellError), error
    others = f"ranks 0-4,6-{WORLD - 1}"
    assert error.summary() == (
        f"rank 5 raised ValueError: bad input; {others} were waiting in all_reduce at cell line 3 and "
        "were released (state kept, new process group)"
    ), error.summary()
    assert many.cluster.busy_ranks() == []
    next_cell_works(ip)


def test_a_rank_ignoring_interrupts_fails_the_recovery_cleanly_at_32_ranks(ip, many):
    """Rank 7 ignores SIGINT while the others wait in a barrier: the recovery cuts the group,
    cannot stop rank 7, and says so; no cell runs on the half-made group until %dist_restart."""
    stuck = (
        "import signal, time\nif rank == 7:\n    signal.signal(signal.SIGINT, signal.SIG_IGN)\n"
        "    time.sleep(3600)\nelse:\n    dist.barrier()"
    )
    run_cell(ip, "--timeout 2", stuck)
    with pytest.raises(UsageError) as refused:
        ip.run_line_magic("dist_recover", "")
    assert str(refused.value).startswith("%dist_recover failed: rank 7 did not stop within "), refused.value
    assert "The ranks are left without a process group: %dist_restart" in str(refused.value)
    _, error = run_cell(ip, "", "dist.barrier()")
    assert isinstance(error, UsageError), error
    assert str(error).startswith("The ranks are not one process group since a recovery failed: rank 7"), error
    with capture_output():
        ip.run_line_magic("dist_restart", "")
    run_cell(ip, "", "kept = rank * 10")
    next_cell_works(ip)
