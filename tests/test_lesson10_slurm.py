"""Lesson 10's sbatch recipe, submitted for real to the one-node Slurm of the tests.

The test takes the lesson's own ``train.sbatch`` and ``train.py`` (found by their ``%%writefile`` cells),
submits the script with ``sbatch --wait --nodes=1`` (the recipe asks for 2 nodes; command-line options win
over ``#SBATCH`` lines) and checks the training's output: the losses of lessons 05/06, from 2 workers of one
torchrun on the one node, with ``MASTER_ADDR`` taken from the job's node list. Needs root and slurm-wlm.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from tests.checker_harness import lesson_cell
from tests.one_node_slurm import OneNodeSlurm, skip_reason
from tests.ports import unused_port

pytestmark = pytest.mark.skipif(skip_reason() is not None, reason=skip_reason() or "")

LESSON = "10_torchrun_multinode"


def written_file(marker: str) -> str:
    """The body of the lesson's ``%%writefile NAME`` cell."""
    first, _, body = lesson_cell(LESSON, marker).partition("\n")
    assert first.startswith("%%writefile"), first
    return body + "\n"


def test_lesson10_sbatch_recipe_trains_on_a_one_node_slurm():
    workdir = Path(tempfile.mkdtemp(prefix="lesson10-slurm-"))
    try:
        (workdir / "train.py").write_text(written_file("%%writefile train.py"))
        (workdir / "train.sbatch").write_text(written_file("%%writefile train.sbatch"))
        venv_bin = str(Path(sys.executable).parent)  # torchrun of this environment first on PATH
        with OneNodeSlurm() as slurm:  # sets SLURM_CONF in this process's environment
            path = venv_bin + os.pathsep + os.environ["PATH"]
            # torchrun makes a log folder in the temp directory when not given --log-dir, and never
            # removes it: the job's temp directory is the test's own.
            env = dict(os.environ, PATH=path, MASTER_PORT=str(unused_port()), TMPDIR=str(workdir))
            submitted = subprocess.run(
                ["sbatch", "--parsable", "--wait", "--nodes=1", f"--chdir={workdir}", "train.sbatch"],
                cwd=workdir,
                env=env,
                capture_output=True,
                text=True,
                timeout=240,
            )
            job = submitted.stdout.strip().split(";")[0]
            output = workdir / f"train-{job}.out"
            shown = output.read_text() if output.exists() else "(no output file)"
            assert submitted.returncode == 0, f"{submitted.stderr}\n{shown}\n{slurm.log()}"
            assert slurm.jobs() == []
            assert slurm.job_processes() == []
        assert slurm.left_at_exit == []

        lines = shown.splitlines()
        assert "attempt 0: 2 ranks, starting at step 0" in lines, shown
        for expected in ("step  0   full-batch loss 4.0368", "step 19   full-batch loss 0.0959"):
            assert expected in lines, shown
        envs = [json.loads((workdir / "out" / f"env_rank{r}.json").read_text()) for r in (0, 1)]
        for r, env in enumerate(envs):
            assert (env["RANK"], env["LOCAL_RANK"], env["GROUP_RANK"]) == (str(r), str(r), "0")
            assert (env["WORLD_SIZE"], env["GROUP_WORLD_SIZE"]) == ("2", "1")
            assert env["SLURM_JOB_ID"] == job
            assert env["MASTER_ADDR"] == "localhost"  # the one node, from scontrol show hostnames
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
