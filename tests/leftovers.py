"""A run leaves nothing behind: in its temp directory, in its clusters root or in /dev/shm.

The run gets a temp directory of its own: the controller (or a run without xdist) makes one in the
temp directory it was given and sets ``TMPDIR`` to it before any worker, kernel, cluster or browser
starts, so everything the run starts makes its temp files there and nothing anyone else makes lands
in it. Once the workers are done, what is still in it after ``SETTLE_SECONDS`` (a controller's
watcher may still be removing its cluster's directory) is named in a section of the report and
makes the run fail; then the directory is removed, so a failed run litters nothing either.
pytest's own temporary folders (``pytest-of-USER``) stay in the temp directory the run was given
(``PYTEST_DEBUG_TEMPROOT``); the clusters root is kept by design: what is in it is checked. Files
this very process still holds open are not counted: they are its own, closed as it exits
(IPython's test shell keeps its history database open until then).

/dev/shm is shared by every process of the machine, so an entry there is the run's only by
evidence: a watcher thread lists it every ``SHM_POLL_SECONDS`` and, for each new entry of this
user, looks for the processes that hold it open or mapped; the entry is the run's if one of them
runs with the run's ``TMPDIR`` (every process the run starts inherits it). An entry nobody held
when first seen cannot be attributed and is not counted. Loaded by ``-p tests.leftovers``
(pyproject.toml's addopts).
"""

from __future__ import annotations

import atexit
import getpass
import os
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil
import pytest

from ddp_magics.cluster.strays import CLUSTERS_ROOT_NAME

SETTLE_SECONDS = 10.0
SHM_POLL_SECONDS = 0.5
SHM_DIRECTORY = Path("/dev/shm")
KEPT_PREFIXES = ("pytest-of-", CLUSTERS_ROOT_NAME)
RUN_TEMP_PREFIX = "ddp-magics-test-run-"
GIVEN_TEMP_ENV = "DDP_MAGICS_TEST_GIVEN_TMPDIR"  # the temp directory the run was given


def own_entries(folder: Path) -> set[Path]:
    """This user's entries of ``folder`` (none if it does not exist)."""
    try:
        names = os.listdir(folder)
    except FileNotFoundError:
        return set()
    entries = set()
    for name in names:
        try:
            if os.lstat(folder / name).st_uid == os.geteuid():
                entries.add(folder / name)
        except FileNotFoundError:
            continue  # removed since listed
    return entries


def holders(path: Path) -> list[int]:
    """PIDs of this user's processes that have ``path`` open or mapped."""
    target = str(path)
    found = []
    for process in psutil.process_iter(["pid", "uids"]):
        if process.info["uids"] is None or process.info["uids"].real != os.geteuid():
            continue
        proc = Path("/proc") / str(process.info["pid"])
        try:
            mapped = target.encode() in (proc / "maps").read_bytes()
            opened = mapped or any(os.readlink(fd) == target for fd in (proc / "fd").iterdir())
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            continue  # ended (or not ours to read) since listed
        if opened:
            found.append(process.info["pid"])
    return found


def runs_in(pid: int, temp: str) -> bool:
    """Whether process ``pid`` runs with ``TMPDIR`` set to ``temp``."""
    try:
        return psutil.Process(pid).environ().get("TMPDIR") == temp
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return False


class SharedMemoryWatch:
    """Which entries of /dev/shm the run's processes made, decided while they hold them."""

    def __init__(self, run_temp: str, directory: Path = SHM_DIRECTORY) -> None:
        self.run_temp = run_temp
        self.directory = directory
        self.seen = own_entries(directory)
        self.ours: set[Path] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="shm-leftover-watch", daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        while not self._stop.wait(SHM_POLL_SECONDS):
            self.look()

    def look(self) -> None:
        for entry in own_entries(self.directory) - self.seen:
            self.seen.add(entry)
            if any(runs_in(pid, self.run_temp) for pid in holders(entry)):
                self.ours.add(entry)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
        self.look()

    def left(self) -> list[Path]:
        return sorted(entry for entry in self.ours if os.path.lexists(entry))


def open_by_this_process() -> set[Path]:
    return {Path(f.path) for f in psutil.Process().open_files()}


def pytest_configure(config: pytest.Config) -> None:
    if not hasattr(config, "workerinput"):  # the controller, or a run without xdist
        config.pluginmanager.register(_LeftoverCheck(), "leftover-check")


class _LeftoverCheck:
    def __init__(self) -> None:
        self.outer_temp = tempfile.gettempdir()
        self.run_temp = tempfile.mkdtemp(prefix=RUN_TEMP_PREFIX, dir=self.outer_temp)
        # The same permissions as the temp directory it stands in for (/tmp: 1777), so that what runs as
        # another user (test_hardening's) meets the temp directory it would meet without this check.
        os.chmod(self.run_temp, os.stat(self.outer_temp).st_mode & 0o7777)
        # At exit, after what this process closes then (atexit runs the last registered first).
        atexit.register(self.remove_run_temp)
        # pytest's own folders (tmp_path) stay where they were, kept for a look after a failure.
        os.environ.setdefault("PYTEST_DEBUG_TEMPROOT", self.outer_temp)
        # torch's compile cache, made in the temp directory when torch._dynamo is imported (DDP does;
        # torch/_inductor/runtime/cache_dir_utils.py), stays where it was too: a cache runs share.
        inductor_cache = os.path.join(self.outer_temp, f"torchinductor_{getpass.getuser()}")
        os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", inductor_cache)
        # node (the course hub's proxy) would keep its compile cache in the temp directory: none.
        os.environ.setdefault("NODE_DISABLE_COMPILE_CACHE", "1")
        # For what must meet processes that do not inherit TMPDIR (ssh sessions on the two-host tests).
        os.environ[GIVEN_TEMP_ENV] = self.outer_temp
        os.environ["TMPDIR"] = self.run_temp
        tempfile.tempdir = self.run_temp
        self.shm = SharedMemoryWatch(self.run_temp)
        self.left: list[Path] = []

    def _left_in_temp(self) -> list[Path]:
        temp = Path(self.run_temp)
        entries = {entry for entry in own_entries(temp) if not entry.name.startswith(KEPT_PREFIXES)}
        entries |= own_entries(temp / CLUSTERS_ROOT_NAME)
        return sorted(entries - open_by_this_process())

    @pytest.hookimpl(trylast=True)  # after xdist has ended its workers
    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        deadline = time.monotonic() + SETTLE_SECONDS
        while (left := self._left_in_temp()) and time.monotonic() < deadline:
            time.sleep(0.2)
        self.shm.stop()
        left += self.shm.left()
        if left:
            self.left = left
            session.exitstatus = pytest.ExitCode.TESTS_FAILED

    def pytest_unconfigure(self, config: pytest.Config) -> None:
        # After the report: nothing of the run stays, whether it passed or not.
        for entry in self.left:
            if entry.parent == SHM_DIRECTORY:
                entry.unlink(missing_ok=True)

    def remove_run_temp(self) -> None:
        failures: list[str] = []
        shutil.rmtree(self.run_temp, onerror=lambda _f, path, error: failures.append(f"{path}: {error[1]}"))
        for failure in failures:
            print(f"leftover check: could not remove {failure}", file=sys.stderr)

    def pytest_terminal_summary(self, terminalreporter) -> None:
        if self.left:
            terminalreporter.section("left behind by the run", red=True)
            for path in self.left:
                terminalreporter.write_line(str(path))
