"""User mistakes outside a running cluster: one-line UsageErrors, nothing started."""

from __future__ import annotations

import psutil
import pytest
from IPython.core.error import UsageError

from tests.conftest import run_cell


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("-n 0", "needs at least 1 rank"),
        ("-n abc", "invalid int value"),
        ("--backend nccl", "nccl needs one GPU per rank"),
        ("--backend mpi", "invalid choice"),
        ("--timeout -1", "must be more than 0"),
        ("--timeout 0", "must be more than 0"),
        ("--timeout nan", "--timeout nan: must be more than 0 seconds and at most"),
        ("--timeout inf", "--timeout inf: must be more than 0"),
        ("--timeout=-inf", "--timeout -inf: must be more than 0"),
        ("--timeout 1e30", "at most 2.592e\\+06 \\(30 days\\)"),
        ("-n -3", "needs at least 1 rank"),
        ("-n 100000", "more ranks than this machine runs at once"),
        ("--ip 203.0.113.7", "--ip 203.0.113.7: not an address of this machine \\(it has .*127.0.0.1"),
        ("--hosts=-oProxyCommand=touch:1", "is not \\[user@\\]host\\[:port\\]"),
        ("--hosts nodeA;id:1", "'nodeA;id' is not"),
        ("--hosts a&b:1", "'a&b' is not"),
        ("--hosts $(id):1", "'\\$\\(id\\)' is not"),
        ("--hosts nodeA:70000:1", "'nodeA:70000' is not"),
        ("--hosts nodeA:100000", "expected hosts like"),
        ("--frobnicate", "unrecognized arguments"),
        ("--hosts nodeA:2,nodeB:x", "expected hosts like nodeA:2,nodeB:2"),
        ("--hosts nodeA:2,nodea:1", "nodea given twice"),
        ("-n 5 --hosts nodeA:2,nodeB:2", "gives 4 ranks"),
        ("--engines local --hosts nodeA:2", "--hosts goes with --engines ssh or mpi"),
        ("--engines slurm --hosts nodeA:2", "--hosts goes with --engines ssh or mpi"),
        ("--engines ssh", "--engines ssh needs --hosts"),
        ("--ip nodeA", "expected an IPv4 address"),
        ("--hosts no-such-host.invalid:2", "unknown host 'no-such-host.invalid'"),
        ("--engines slurm -n 2", "--engines slurm needs --ip"),
    ],
)
def test_bad_start_arguments_start_nothing(ip, magics, line, message):
    assert magics.cluster is None, "runs outside the cluster fixture"
    children_before = {p.pid for p in psutil.Process().children(recursive=True)}
    with pytest.raises(UsageError, match=message):
        ip.run_line_magic("dist_start", line)
    assert magics.cluster is None
    children_after = {p.pid for p in psutil.Process().children(recursive=True)}
    assert children_after <= children_before


def test_cells_before_start_are_usage_errors(ip, magics):
    assert magics.cluster is None
    _, error = run_cell(ip, "", "print(1)")
    assert isinstance(error, UsageError)
    assert "No cluster is running" in str(error)
    with pytest.raises(UsageError, match="No cluster is running"):
        ip.run_line_magic("dist_status", "")
    with pytest.raises(UsageError, match="No cluster is running"):
        ip.run_line_magic("dist_pull", "x")


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("--timeout nan", "--timeout nan: must be more than 0"),
        ("--timeout inf", "--timeout inf: must be more than 0"),
        ("--timeout 0", "--timeout 0: must be more than 0"),
    ],
)
def test_bad_cell_timeouts_are_refused_before_anything_runs(ip, magics, line, message):
    _, error = run_cell(ip, line, "print(1)")
    assert isinstance(error, UsageError)
    assert message in str(error)
