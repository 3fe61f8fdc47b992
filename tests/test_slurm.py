"""Engines started as a Slurm job (ipyparallel's Slurm launcher) on a one-node Slurm cluster."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from IPython.utils.capture import capture_output

from ddp_magics.errors import DistributedCellError
from tests.conftest import assert_gone, current_magics, run_cell, shown_text
from tests.one_node_slurm import OneNodeSlurm, skip_reason

pytestmark = pytest.mark.skipif(skip_reason() is not None, reason=skip_reason() or "")


def test_two_ranks_as_a_slurm_job_with_output_a_hang_report_and_stop(ip):
    files_here = set(Path.cwd().iterdir())
    with OneNodeSlurm() as slurm:
        with capture_output() as captured:
            # A setting for ipyparallel's Slurm launcher goes through: the job's time limit.
            settings = {"SlurmEngineSetLauncher": {"timelimit": "0:10:00"}}
            ip.run_line_magic("config", f"DistributedMagics.launcher_settings = {settings!r}")
            ip.run_line_magic("dist_start", "--engines slurm -n 2 --ip 127.0.0.1 --backend gloo")
        magics = current_magics(ip)
        processes = magics.cluster.processes()
        try:
            assert captured.stdout.strip() == "2 ranks ready: backend gloo, world size 2, devices cpu x2"
            assert len(slurm.jobs()) == 1
            assert slurm.time_limits() == ["10:00"]
            cell = "import os\nt = torch.tensor([rank + 1.0])\ndist.all_reduce(t)\n"
            cell += "print(t.item(), os.environ['SLURM_JOB_ID'] != '')"
            captured, error = run_cell(ip, "", cell)
            assert error is None
            assert shown_text(captured) == "[ranks 0,1]\n3.0 True"
            hang = "t = torch.zeros(1)\nif rank == 1:\n    dist.recv(t, src=0)"
            _, error = run_cell(ip, "--timeout 2", hang)
            assert isinstance(error, DistributedCellError)
            assert str(error) == "rank 1 still running after 2 s (rank 1 in recv at cell line 3)"
            processes += [p for p in slurm.job_processes() if p not in processes]
        finally:
            with capture_output():
                ip.run_line_magic("dist_stop", "")
            ip.run_line_magic("config", "DistributedMagics.launcher_settings = {}")
        assert_gone(processes)
        # slurmd tells slurmctld the job ended after its processes did: give the queue a moment.
        deadline = time.monotonic() + 10
        while slurm.jobs() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert slurm.jobs() == []
    assert slurm.left_at_exit == []
    assert set(Path.cwd().iterdir()) == files_here  # the job script went into the cluster's directory
