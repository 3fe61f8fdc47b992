"""The leftover check (tests/leftovers.py) fails a run for what the run left, never for what other
processes of the same user make meanwhile: each case is a real inner pytest run with the plugin."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# The inner tests. A holder is a child process that makes an entry in /dev/shm and keeps it open
# until its stdin closes; the inner test waits until the plugin's watcher has seen the entry.
INNER = '''
import os, subprocess, sys, tempfile, time
from pathlib import Path

HOLD = (
    "import os, sys; fd = os.open(sys.argv[1], os.O_CREAT | os.O_RDWR, 0o600); "
    "print('held', flush=True); sys.stdin.read()"
)


def hold_until_seen(request, path, env, attribute):
    watch = request.config.pluginmanager.get_plugin("leftover-check").shm
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(path)], env=env,
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "held\\n"
        deadline = time.monotonic() + 60
        while Path(path) not in getattr(watch, attribute):
            assert time.monotonic() < deadline, f"{path} never in the watcher's {attribute}"
            time.sleep(0.1)
    finally:
        holder.stdin.close()
        holder.wait(30)


def test_outside(request):
    outside = dict(os.environ, TMPDIR=os.environ["OUTER_TEMP"])
    subprocess.run([sys.executable, "-c", "import sys; open(sys.argv[1], 'w').close()",
                    os.environ["OUTSIDE_FILE"]], env=outside, check=True)
    hold_until_seen(request, os.environ["OUTSIDE_SHM"], outside, "seen")


def test_own_file():
    fd, _ = tempfile.mkstemp(prefix="own-leak-")
    os.close(fd)


def test_own_shm(request):
    hold_until_seen(request, os.environ["OWN_SHM"], dict(os.environ), "ours")
'''


def inner_run(tmp_path: Path, selection: str, env_extra: dict[str, str]) -> subprocess.CompletedProcess:
    test_file = tmp_path / "test_inner.py"
    test_file.write_text(textwrap.dedent(INNER))
    env = dict(os.environ, OUTER_TEMP=tempfile.gettempdir(), **env_extra)
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-o", "addopts=", "-p", "tests.leftovers",
         f"{test_file}::{selection}", "-q"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=240,
    )


def left_section(output: str) -> list[str]:
    _, _, rest = output.partition("left behind by the run")
    return [line for line in rest.splitlines()[1:] if line.startswith("/")]


def test_what_others_make_meanwhile_does_not_fail_the_run(tmp_path):
    outside_file = Path(tempfile.gettempdir()) / f"outside-{os.getpid()}"
    outside_shm = Path("/dev/shm") / f"outside-{os.getpid()}"
    try:
        run = inner_run(
            tmp_path, "test_outside", {"OUTSIDE_FILE": str(outside_file), "OUTSIDE_SHM": str(outside_shm)}
        )
        assert run.returncode == 0, run.stdout + run.stderr
        assert "left behind" not in run.stdout
        assert outside_file.exists() and outside_shm.exists()  # made meanwhile, and not the run's to remove
    finally:
        outside_file.unlink(missing_ok=True)
        outside_shm.unlink(missing_ok=True)


def test_a_file_the_run_leaves_in_its_temp_directory_fails_it_and_is_removed(tmp_path):
    run = inner_run(tmp_path, "test_own_file", {})
    assert run.returncode == 1, run.stdout + run.stderr
    [left] = left_section(run.stdout)
    assert Path(left).name.startswith("own-leak-")
    assert Path(left).parent.name.startswith("ddp-magics-test-run-")
    assert not Path(left).parent.exists()  # the run's temp directory is gone with it


def test_an_entry_the_run_leaves_in_dev_shm_fails_it_and_is_removed(tmp_path):
    own_shm = Path("/dev/shm") / f"own-leak-{os.getpid()}"
    try:
        run = inner_run(tmp_path, "test_own_shm", {"OWN_SHM": str(own_shm)})
        assert run.returncode == 1, run.stdout + run.stderr
        assert left_section(run.stdout) == [str(own_shm)]
        assert not own_shm.exists()
    finally:
        own_shm.unlink(missing_ok=True)
