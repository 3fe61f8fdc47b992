"""%%distributed and friends on a real 2-rank gloo cluster."""

from __future__ import annotations

import pytest
from IPython.core.error import UsageError
from IPython.utils.capture import capture_output

from ddp_magics.errors import DistributedCellError
from tests.conftest import run_cell, shown_text


def test_all_reduce_output_in_rank_order(ip, cluster):
    captured, error = run_cell(
        ip,
        "",
        "t = torch.ones(3) * (rank + 1)\n"
        "dist.all_reduce(t)\n"
        "print(f'rank {rank} of {world_size}: {t.tolist()}')",
    )
    assert error is None
    assert shown_text(captured) == (
        "[rank 0]\nrank 0 of 2: [3.0, 3.0, 3.0]\n[rank 1]\nrank 1 of 2: [3.0, 3.0, 3.0]"
    )


def test_rank_names_are_defined(ip, cluster):
    captured, error = run_cell(
        ip,
        "",
        "import os\n"
        "print(rank, world_size, local_rank, device, dist.get_backend(), os.environ['RANK'],"
        " os.environ['LOCAL_RANK'], os.environ['WORLD_SIZE'], os.environ['MASTER_ADDR'])",
    )
    assert error is None
    assert shown_text(captured) == (
        "[rank 0]\n0 2 0 cpu gloo 0 0 2 127.0.0.1\n[rank 1]\n1 2 1 cpu gloo 1 1 2 127.0.0.1"
    )


def test_identical_output_is_collapsed_and_silent_ranks_have_no_block(ip, cluster):
    captured, _ = run_cell(ip, "", "print('same on every rank')")
    assert shown_text(captured) == "[ranks 0,1]\nsame on every rank"
    captured, _ = run_cell(ip, "", "if rank == 1:\n    print('only rank 1 speaks')")
    assert shown_text(captured) == "[rank 1]\nonly rank 1 speaks"


def test_chosen_ranks_and_state_across_cells(ip, cluster):
    run_cell(ip, "", "counter = 10 * rank")
    captured, error = run_cell(ip, "--ranks 1", "counter += 1\nprint(counter)")
    assert error is None
    assert shown_text(captured) == "[rank 1]\n11"
    captured, _ = run_cell(ip, "--ranks 0-1", "counter")
    assert shown_text(captured) == "[rank 0]\n0\n[rank 1]\n11"


def test_stderr_and_rich_displays_are_shown(ip, cluster):
    captured, error = run_cell(
        ip,
        "",
        "import sys\n"
        "import matplotlib.pyplot as plt\n"
        "print('to stderr', rank, file=sys.stderr)\n"
        "plt.plot([0, rank + 1])\n"
        "plt.show()",
    )
    assert error is None
    images = [output for output in captured.outputs if "image/png" in output.data]
    assert len(images) == 2
    text = shown_text(captured)
    assert text.index("[rank 0]\nto stderr 0") < text.index("[rank 1]\nto stderr 1")


def test_output_is_bounded(ip, cluster, magics):
    captured, error = run_cell(ip, "--ranks 0", "for i in range(100_000):\n    print(i)")
    assert error is None
    lines = shown_text(captured).splitlines()
    assert lines[0] == "[rank 0]"
    assert lines[1] == f"... {100_000 - magics.max_output_lines} earlier lines not shown ..."
    assert lines[-1] == "99999"
    assert len(lines) == magics.max_output_lines + 2


def test_raise_on_one_rank_shows_others_and_fails_the_cell(ip, healthy):
    captured, error = run_cell(
        ip, "", "print('before', rank)\nif rank == 0:\n    raise ValueError('bad input on rank 0')"
    )
    assert isinstance(error, DistributedCellError)
    assert str(error) == "rank 0 raised ValueError: bad input on rank 0"
    assert shown_text(captured) == "[rank 0]\nbefore 0\n[rank 1]\nbefore 1"
    report = "\n".join(error._render_traceback_())
    assert report.splitlines()[1] == "[rank 0]"
    assert "[rank 1] finished" in report
    # Shown once: in the summary, the source line and the traceback's last line.
    assert captured.stdout.count("bad input on rank 0") == 3
    captured, error = run_cell(ip, "", "print('still fine')")
    assert error is None


def test_push_and_pull(ip, cluster):
    ip.user_ns["learning_rate"] = 0.5
    ip.run_line_magic("dist_push", "learning_rate")
    run_cell(ip, "", "scaled = learning_rate * (rank + 1)")
    assert ip.run_line_magic("dist_pull", "scaled") == {0: 0.5, 1: 1.0}


def test_status_lists_ranks(ip, cluster):
    table = ip.run_line_magic("dist_status", "")
    text = repr(table)
    assert text.splitlines()[0] == "backend gloo, world size 2"
    assert [row[0] for row in table.rows] == ["0", "1"]
    assert all(row[3] == "cpu" and row[4] == "alive" for row in table.rows)
    pids = {int(row[2]) for row in table.rows}
    assert pids == {info.pid for info in cluster.cluster.ranks}


@pytest.mark.parametrize("line", ["%dist_status", "%dist_pull rank"])
def test_a_semicolon_silences_status_and_pull_as_for_any_expression(ip, cluster, line):
    with capture_output() as shown:
        ip.run_cell(line)
    with capture_output() as silenced:
        ip.run_cell(line + ";")
    assert (shown.outputs or shown.stdout) and not (silenced.outputs or silenced.stdout)


def test_dist_start_while_running_says_so(ip, cluster):
    before = cluster.cluster
    with capture_output() as captured:
        ip.run_line_magic("dist_start", "-n 2")
    assert "already running" in captured.stdout
    assert cluster.cluster is before


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("--ranks 5", "rank 5 does not exist"),
        ("--ranks x", "expected ranks like"),
        ("--timeout 0", "must be more than 0"),
        ("--bogus", "unrecognized arguments"),
    ],
)
def test_bad_cell_arguments_are_one_line_errors(ip, cluster, line, message):
    _, error = run_cell(ip, line, "print('never runs')")
    assert isinstance(error, UsageError)
    assert message in str(error)
    assert "\n" not in str(error)


def test_pull_of_unknown_name_is_usage_error(ip, cluster):
    with pytest.raises(UsageError, match="not defined on every rank"):
        ip.run_line_magic("dist_pull", "no_such_variable")
    with pytest.raises(UsageError, match="not defined in the notebook"):
        ip.run_line_magic("dist_push", "no_such_variable")


def test_many_quick_cells_each_finish_with_their_output(ip, cluster):
    """A cell can be over (reply and output in) before the notebook side looks at it: every one
    of many quick cells must still be seen finished, with its value."""
    for number in range(150):
        captured, error = run_cell(ip, "--ranks 0", f"{number}")
        assert error is None, f"cell {number}: {error}"
        assert shown_text(captured) == f"[rank 0]\n{number}"
