"""How ``make test`` shares the tests and lessons out among pytest-xdist's workers.

With ``--dist loadscope`` a worker gets whole scopes: a test module (its tests share the module's
cluster), a lesson (nbval runs its cells in order, in one kernel), or a single test of a module
listed in ``SPREAD`` (each of its tests starts all it needs). A free worker takes the longest
scope left, by the seconds recorded in ``scope_seconds.json`` beside this file (scopes not
recorded: by their number of tests, after the recorded ones), so that no long scope starts last
and runs alone while the other workers have nothing to do. The order changes how long the run
takes, never what it checks. Record the seconds anew after a change of much weight:

    .venv/bin/python -m pytest -n 3 --dist loadscope tests notebooks --nbval --nbval-current-env \\
        --record-scope-seconds tests/scope_seconds.json

(xdist's own ``loadgroup`` would read groups from marks, but under pytest 9 its worker can no
longer rename a test's node id, so its groups are lost; scopes here come from node ids alone.)
Loaded by ``-p tests.scheduling`` (pyproject.toml's addopts).
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

import pytest

RECORDED = Path(__file__).with_name("scope_seconds.json")
# Modules whose tests share no module fixture: each test is a scope of its own.
SPREAD = ("tests/test_lessons_untraced.py",)


def scope_of(nodeid: str) -> str:
    """The scope a test runs in: its file, or the test itself in a ``SPREAD`` module."""
    path = nodeid.split("::", 1)[0]
    return nodeid if path in SPREAD else path


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--record-scope-seconds",
        metavar="PATH",
        help="write each scope's seconds (its tests' setup, call and teardown) to PATH as JSON",
    )


def pytest_configure(config: pytest.Config) -> None:
    path = config.getoption("record_scope_seconds")
    if path and not hasattr(config, "workerinput"):  # the controller, or a run without xdist
        config.pluginmanager.register(_SecondsRecorder(Path(path)))


@pytest.hookimpl(optionalhook=True)  # a hook of pytest-xdist's: without it, never called
def pytest_xdist_make_scheduler(config: pytest.Config, log):
    if config.getoption("dist") != "loadscope":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class LongestFirst(LoadScopeScheduling):
        recorded = json.loads(RECORDED.read_text()) if RECORDED.exists() else {}

        def _split_scope(self, nodeid: str) -> str:
            return scope_of(nodeid)

        def _assign_work_unit(self, node) -> None:
            longest = max(self.workqueue, key=lambda s: (self.recorded.get(s, 0.0), len(self.workqueue[s])))
            self.workqueue.move_to_end(longest, last=False)
            super()._assign_work_unit(node)

    return LongestFirst(config, log)


class _SecondsRecorder:
    def __init__(self, path: Path) -> None:
        self.path = path
        self.seconds: dict[str, float] = defaultdict(float)

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        self.seconds[scope_of(report.nodeid)] += report.duration

    def pytest_sessionfinish(self) -> None:
        longest_first = sorted(self.seconds.items(), key=lambda item: -item[1])
        self.path.write_text(json.dumps({scope: round(s, 1) for scope, s in longest_first}, indent=1) + "\n")
