"""User mistakes outside a running cluster: one-line UsageErrors, nothing started."""

from __future__ import annotations

import copy
import logging
import re
import time

import psutil
import pytest
from IPython.core.error import UsageError
from IPython.utils.capture import capture_output
from traitlets import TraitError

from tests.conftest import run_cell, running_cluster


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("-n 0", "needs at least 1 rank"),
        ("-n abc", "invalid int value"),
        ("--backend nccl", "--backend nccl: nccl needs a GPU per rank: this machine runs 2 ranks"),
        ("--backend mpi", "invalid choice"),
        ("--timeout -1", "must be more than 0"),
        ("--timeout 0", "must be more than 0"),
        ("--timeout nan", "--timeout nan: must be more than 0 seconds and at most"),
        ("--timeout inf", "--timeout inf: must be more than 0"),
        ("--timeout=-inf", "--timeout -inf: must be more than 0"),
        ("--timeout 1e30", "at most 2592000 \\(30 days\\)"),
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
        ("--hosts nodeA:\u00b2", "expected hosts like"),
        ("--hosts localhost:1,127.0.0.1:1", "localhost and 127.0.0.1 are the same host \\(127.0.0.1\\)"),
        (f"--hosts {'a' * 64}:1", "unknown host 'a{64}': not a valid host name"),
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
    with pytest.raises(UsageError, match="No cluster is running"):
        ip.run_line_magic("dist_recover", "")


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


def test_bad_cell_arguments_come_before_the_missing_cluster(ip, magics):
    assert magics.cluster is None
    _, error = run_cell(ip, "--trace class", "print(1)")
    assert isinstance(error, UsageError)
    assert "--trace 'class': expected a variable name" in str(error)
    with pytest.raises(UsageError, match="%dist_pull '1x': expected a variable name"):
        ip.run_line_magic("dist_pull", "1x")


@pytest.fixture
def settings(ip, magics):
    """The magics, with every setting a test changes put back, and the shell's configuration too
    (%config keeps a refused value there, which the next load of the extension would read)."""
    saved = {name: getattr(magics, name) for name in magics.trait_names(config=True)}
    saved_config = copy.deepcopy(ip.config.get("DistributedMagics"))
    yield magics
    if saved_config is None:
        ip.config.pop("DistributedMagics", None)
    else:
        ip.config["DistributedMagics"] = saved_config
    for name, value in saved.items():
        if getattr(magics, name) != value:
            setattr(magics, name, value)


@pytest.mark.parametrize(
    ("setting", "value", "message"),
    [
        ("cell_timeout", "float('nan')", "cell_timeout = nan: must be more than 0 seconds and at most"),
        ("cell_timeout", "0", "cell_timeout = 0.0: must be more than 0"),
        ("process_group_timeout", "float('inf')", "process_group_timeout = inf: must be more than 0"),
        (
            "process_group_timeout",
            "1e30",
            "process_group_timeout = 1e+30: must be more than 0 seconds and at most 2592000 (30 days)",
        ),
        ("error_grace", "float('nan')", "error_grace = nan: must be from 0 seconds"),
        ("interrupt_grace", "-1.0", "interrupt_grace = -1.0: must be from 0 seconds"),
        ("live_view_after", "float('inf')", "live_view_after = inf: must be from 0 seconds"),
        ("heartbeat_ms", "0", "heartbeat_ms = 0: must be from 10 to 3000"),
        ("heartbeat_ms", "10**9", "heartbeat_ms = 1000000000: must be from 10 to 3000"),
        ("max_output_lines", "-1", "max_output_lines = -1: must be at least 0"),
        ("trace_values_limit", "-5", "trace_values_limit = -5: must be at least 0"),
        ("default_world_size", "0", "default_world_size = 0: must be from 1 to 65536"),
        ("max_local_ranks", "-3", "max_local_ranks = -3: must be from 1 to 65536"),
    ],
)
def test_bad_settings_are_refused_and_leave_the_old_value(ip, settings, caplog, setting, value, message):
    before = getattr(settings, setting)
    with caplog.at_level(logging.ERROR):
        ip.run_line_magic("config", f"DistributedMagics.{setting} = {value}")
    assert getattr(settings, setting) == before
    assert [record.getMessage() for record in caplog.records if "DistributedMagics" in record.getMessage()]
    with pytest.raises(TraitError, match=re.escape(f"DistributedMagics.{message}")):
        setattr(settings, setting, eval(value))


def test_local_ranks_are_counted_wherever_they_start(ip, settings):
    settings.max_local_ranks = 2
    limit = re.escape(
        ": more ranks than this machine runs at once (at most 2; %config DistributedMagics.max_local_ranks"
    )
    for line, asked in [
        ("--engines mpi -n 3", "-n 3"),  # mpiexec without --hosts runs its ranks here
        ("--hosts localhost:3", "--hosts localhost:3"),  # ssh to this machine
    ]:
        with pytest.raises(UsageError, match=f"^{re.escape(asked)}{limit}"):
            ip.run_line_magic("dist_start", line)
    settings.default_world_size = 3
    with pytest.raises(UsageError, match=f"^{re.escape('DistributedMagics.default_world_size = 3')}{limit}"):
        ip.run_line_magic("dist_start", "")
    settings.controller_ip = "203.0.113.7"
    with pytest.raises(UsageError, match=re.escape("DistributedMagics.controller_ip = 203.0.113.7: not an")):
        ip.run_line_magic("dist_start", "-n 2")
    assert settings.cluster is None


def test_rank_specs_outside_the_world_are_refused_quickly(ip):
    with running_cluster(ip, 2):
        for spec, message in [
            ("-1", "rank -1 does not exist; this cluster has ranks 0,1"),
            ("0,-1-1", "rank -1 does not exist"),
            ("''", "expected ranks like 0, 0,2 or 1-3"),
            ("0-99999999", "rank 99999999 does not exist"),
            ("1" * 5000, "expected ranks like"),
        ]:
            started = time.monotonic()
            _, error = run_cell(ip, f"--ranks {spec}", "print(1)")
            assert isinstance(error, UsageError), spec
            assert message in str(error), (spec, str(error))
            assert time.monotonic() - started < 1, spec


def test_a_launch_that_exits_fails_the_start_at_once_with_its_last_line(ip, magics):
    """mpiexec (any launcher whose processes end) exiting before its engines connect fails
    %dist_start at once, saying what it wrote last, not after the 60 s connection timeout."""
    failing_mpiexec = ["sh", "-c", "echo 'mpiexec: host nodeZ unreachable' >&2; exit 3", "sh"]
    magics.mpi_command = failing_mpiexec
    try:
        with capture_output(), pytest.raises(UsageError) as refused:
            ip.run_line_magic("dist_start", "-n 2 --engines mpi")
    finally:
        magics.mpi_command = []
    assert str(refused.value) == (
        "%dist_start failed: only 0 of 2 engines connected: sh exited: mpiexec: host nodeZ unreachable"
    )
    assert magics.cluster is None
