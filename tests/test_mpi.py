"""Engines started by mpiexec (ipyparallel's MPI launcher, MPICH from the ``mpi`` extra)."""

from __future__ import annotations

import importlib.util
import shutil
import sys
from pathlib import Path

import pytest
from IPython.utils.capture import capture_output

from ddp_magics.errors import DistributedCellError
from ddp_magics.shared_memory import mapped_segments
from tests.conftest import assert_gone, current_magics, run_cell, shown_text

MPIEXEC = Path(sys.executable).parent / "mpiexec"
MPI_RANK = "from mpi4py import MPI\nprint(MPI.COMM_WORLD.Get_rank() == rank)"


def _skip_reason() -> str | None:
    if not MPIEXEC.exists() and shutil.which("mpiexec") is None:
        return "no mpiexec: install the mpi extra (pip install -c constraints.txt -e '.[mpi]')"
    if importlib.util.find_spec("mpi4py") is None:
        return "no mpi4py: install the mpi extra (pip install -c constraints.txt -e '.[mpi]')"
    return None


pytestmark = pytest.mark.skipif(_skip_reason() is not None, reason=_skip_reason() or "")


def test_three_ranks_through_mpiexec_with_output_and_a_hang_report(ip):
    with capture_output() as captured:
        ip.run_line_magic("dist_start", "--engines mpi -n 3 --backend gloo")
    magics = current_magics(ip)
    processes = magics.cluster.processes()
    try:
        assert captured.stdout.strip() == "3 ranks ready: backend gloo, world size 3, devices cpu x3"
        assert any("mpiexec" in " ".join(p.cmdline()) for p in processes)
        cell = "t = torch.tensor([rank + 1.0])\ndist.all_reduce(t)\nprint(rank, t.item())"
        captured, error = run_cell(ip, "", cell)
        assert error is None
        assert shown_text(captured) == "[rank 0]\n0 6.0\n[rank 1]\n1 6.0\n[rank 2]\n2 6.0"
        # MPI's own rank and the process group's agree: engine ids follow mpiexec's ranks.
        captured, _ = run_cell(ip, "", MPI_RANK)
        assert shown_text(captured) == "[ranks 0-2]\nTrue"
        first_job = mapped_segments(p.pid for p in magics.cluster.processes())
        assert len(first_job) == 1  # the one MPICH's three ranks share

        _, error = run_cell(ip, "--timeout 2", "t = torch.zeros(1)\nif rank == 2:\n    dist.recv(t, src=0)")
        assert isinstance(error, DistributedCellError)
        assert str(error) == "rank 2 still running after 2 s (rank 2 in recv at cell line 3)"
        with capture_output():
            ip.run_line_magic("dist_restart", "")
        assert not [segment for segment in first_job if segment.exists()]  # killed, not finalized
        _, error = run_cell(ip, "", "dist.barrier()")
        assert error is None
        captured, _ = run_cell(ip, "", MPI_RANK)
        assert shown_text(captured) == "[ranks 0-2]\nTrue"
        processes += magics.cluster.processes()
        second_job = mapped_segments(p.pid for p in processes)
        assert len(second_job) == 1 and second_job != first_job
    finally:
        with capture_output():
            ip.run_line_magic("dist_stop", "")
    assert_gone(processes)
    assert not [segment for segment in second_job if segment.exists()]
