"""A run leaves nothing behind in the temp directory, in the clusters root or in /dev/shm.

The controller (or a run without xdist) lists this user's entries of those folders as the session
starts and again once the workers are done; entries that are new and still there after
``SETTLE_SECONDS`` (a controller's watcher may still be removing its cluster's directory) are
named in a section of the report and make the run fail. pytest's own temporary folders
(``pytest-of-USER``) are pytest's to keep, and the clusters root is kept by design: what is in it is
checked. Loaded by ``-p tests.leftovers`` (pyproject.toml's addopts).
"""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path

import pytest

from ddp_magics.cluster.strays import CLUSTERS_ROOT_NAME

SETTLE_SECONDS = 10.0
KEPT_PREFIXES = ("pytest-of-", CLUSTERS_ROOT_NAME)


def entries_of_this_user() -> set[Path]:
    temp = Path(tempfile.gettempdir())
    entries = set()
    for folder in (temp, temp / CLUSTERS_ROOT_NAME, Path("/dev/shm")):
        try:
            names = os.listdir(folder)
        except FileNotFoundError:
            continue
        for name in names:
            if folder == temp and name.startswith(KEPT_PREFIXES):
                continue
            try:
                if os.lstat(folder / name).st_uid == os.geteuid():
                    entries.add(folder / name)
            except FileNotFoundError:
                continue  # removed since listed
    return entries


def pytest_configure(config: pytest.Config) -> None:
    if not hasattr(config, "workerinput"):  # the controller, or a run without xdist
        config.pluginmanager.register(_LeftoverCheck(), "leftover-check")


class _LeftoverCheck:
    def __init__(self) -> None:
        self.before = entries_of_this_user()
        self.left: list[Path] = []

    def _new(self) -> list[Path]:
        return sorted(entries_of_this_user() - self.before)

    @pytest.hookimpl(trylast=True)  # after xdist has ended its workers
    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        deadline = time.monotonic() + SETTLE_SECONDS
        while (left := self._new()) and time.monotonic() < deadline:
            time.sleep(0.2)
        if left:
            self.left = left
            session.exitstatus = pytest.ExitCode.TESTS_FAILED

    def pytest_terminal_summary(self, terminalreporter) -> None:
        if self.left:
            terminalreporter.section("left behind by the run", red=True)
            for path in self.left:
                terminalreporter.write_line(str(path))
