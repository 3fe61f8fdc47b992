"""Lesson 10's checkers refuse wrong answers (right on some layouts, by a wrong method) and pass right ones.

Both exercises run in the notebook's own namespace: exercise 1 with section 4's run as the lesson records it,
exercise 2 with the lesson's fake ``scontrol`` on ``PATH``, in a temporary folder. No cluster is needed.
"""

from __future__ import annotations

import pytest
from IPython.utils.capture import capture_output

from tests.checker_harness import lesson_cell, reference_answer

LESSON = "10_torchrun_multinode"

# Section 4: agents "localhost" (arrived first) and "127.0.0.1", two workers each; ranks by host name.
RUN3 = [("127.0.0.1", 0), ("127.0.0.1", 1), ("localhost", 0), ("localhost", 1)]

RANKS_WRONG = {
    "arrival order, not names": """
def ranks_by_host(agents):
    return [(host, local) for host, count in agents for local in range(count)]
""",
    "names sorted as numbers (node2 before node10)": """
import re
def ranks_by_host(agents):
    key = lambda agent: [int(t) if t.isdigit() else t for t in re.split(r"(\\d+)", agent[0])]
    return [(host, local) for host, count in sorted(agents, key=key) for local in range(count)]
""",
    "RANK = GROUP_RANK x nproc + LOCAL_RANK with the first agent's nproc": """
def ranks_by_host(agents):
    hosts, nproc = sorted(h for h, _ in agents), agents[0][1]
    total = sum(count for _, count in agents)
    return [(hosts[min(r // nproc, len(hosts) - 1)], r % nproc) for r in range(total)]
""",
    "GROUP_RANK in place of the host": """
def ranks_by_host(agents):
    return [(node, local) for node, (host, count) in enumerate(sorted(agents)) for local in range(count)]
""",
}

RANKS_RIGHT_OTHERWISE = """
import itertools
def ranks_by_host(agents):
    ordered = sorted(agents, key=lambda agent: agent[0])
    starts = [0, *itertools.accumulate(count for _, count in ordered)]
    return {start + local: [host, local]
            for (host, count), start in zip(ordered, starts) for local in range(count)}
"""

ENV_WRONG = {
    "one port for every job": """
import subprocess
def torch_env(slurm):
    hosts = subprocess.run(["scontrol", "show", "hostnames", slurm["SLURM_JOB_NODELIST"]],
                           capture_output=True, text=True, check=True).stdout.split()
    return {"RANK": slurm["SLURM_PROCID"], "WORLD_SIZE": slurm["SLURM_NTASKS"],
            "LOCAL_RANK": slurm["SLURM_LOCALID"], "LOCAL_WORLD_SIZE": slurm["SLURM_NTASKS_PER_NODE"],
            "GROUP_RANK": slurm["SLURM_NODEID"], "MASTER_ADDR": hosts[0], "MASTER_PORT": 29500}
""",
    "RANK from node and local id (wrong under cyclic distribution)": """
import re
def torch_env(slurm):
    prefix, ranges = re.match(r"([^,\\[]+)(?:\\[([^\\]]*)\\])?", slurm["SLURM_JOB_NODELIST"]).groups()
    n = int(slurm["SLURM_NTASKS_PER_NODE"])
    return {"RANK": int(slurm["SLURM_NODEID"]) * n + int(slurm["SLURM_LOCALID"]),
            "WORLD_SIZE": slurm["SLURM_NTASKS"], "LOCAL_RANK": slurm["SLURM_LOCALID"], "LOCAL_WORLD_SIZE": n,
            "GROUP_RANK": slurm["SLURM_NODEID"],
            "MASTER_ADDR": prefix + (ranges.split(",")[0].split("-")[0] if ranges else ""),
            "MASTER_PORT": 29500}
""",
    "MASTER_ADDR cut at the first comma": """
def torch_env(slurm):
    return {"RANK": slurm["SLURM_PROCID"], "WORLD_SIZE": slurm["SLURM_NTASKS"],
            "LOCAL_RANK": slurm["SLURM_LOCALID"], "LOCAL_WORLD_SIZE": slurm["SLURM_NTASKS_PER_NODE"],
            "GROUP_RANK": slurm["SLURM_NODEID"], "MASTER_ADDR": slurm["SLURM_JOB_NODELIST"].split(",")[0],
            "MASTER_PORT": 29500}
""",
    "a port per task": """
import subprocess
def torch_env(slurm):
    hosts = subprocess.run(["scontrol", "show", "hostnames", slurm["SLURM_JOB_NODELIST"]],
                           capture_output=True, text=True, check=True).stdout.split()
    return {"RANK": slurm["SLURM_PROCID"], "WORLD_SIZE": slurm["SLURM_NTASKS"],
            "LOCAL_RANK": slurm["SLURM_LOCALID"], "LOCAL_WORLD_SIZE": slurm["SLURM_NTASKS_PER_NODE"],
            "GROUP_RANK": slurm["SLURM_NODEID"], "MASTER_ADDR": hosts[0],
            "MASTER_PORT": 29500 + int(slurm["SLURM_PROCID"])}
""",
}

# a different right answer: scontrol (the fake one, on PATH) expands the node list
ENV_RIGHT_OTHERWISE = ENV_WRONG["a port per task"].replace(
    'int(slurm["SLURM_PROCID"])', 'int(slurm["SLURM_JOB_ID"]) % 1000'
)


def notebook_verdict(ip, exercise: int, solution: str) -> str:
    """Run ``solution`` and the lesson's checker of ``exercise`` in the shell; "pass" or "fail"."""
    for code in (solution, lesson_cell(LESSON, f"# Checker for exercise {exercise}")):
        with capture_output() as captured:
            result = ip.run_cell(code)
        assert result.error_in_exec is None and result.error_before_exec is None, captured.stdout
    lines = [line for line in captured.stdout.splitlines() if line.startswith(f"exercise {exercise}: ")]
    assert len(lines) == 1, captured.stdout
    return "pass" if lines[0] == f"exercise {exercise}: pass" else "fail"


@pytest.fixture
def namespace(ip, tmp_path, monkeypatch):
    """The lesson's fake Slurm tools in ./fake_bin of a temporary folder, and section 4's record."""
    monkeypatch.chdir(tmp_path)
    ip.user_ns["run3"] = RUN3
    for code in ("import json, os, subprocess, sys", lesson_cell(LESSON, "FAKES = {")):
        with capture_output():
            result = ip.run_cell(code)
        assert result.error_in_exec is None
    (tmp_path / "empty.sh").write_text("true\n")
    with capture_output():
        assert ip.run_cell("fake_slurm('empty.sh')").error_in_exec is None  # makes fake_bin
    yield ip
    for name in ("FAKES", "fake_slurm", "run3", "ranks_by_host", "torch_env"):
        ip.user_ns.pop(name, None)


@pytest.mark.parametrize("wrong", list(RANKS_WRONG))
def test_10_ranks_by_host_refuses(namespace, wrong):
    assert notebook_verdict(namespace, 1, RANKS_WRONG[wrong]) == "fail"
    assert notebook_verdict(namespace, 1, reference_answer(LESSON, 1)) == "pass"


def test_10_ranks_by_host_accepts_a_dict_of_lists(namespace):
    assert notebook_verdict(namespace, 1, RANKS_RIGHT_OTHERWISE) == "pass"


@pytest.mark.parametrize("wrong", list(ENV_WRONG))
def test_10_torch_env_refuses(namespace, wrong):
    assert notebook_verdict(namespace, 2, ENV_WRONG[wrong]) == "fail"
    assert notebook_verdict(namespace, 2, reference_answer(LESSON, 2)) == "pass"


def test_10_torch_env_accepts_scontrol(namespace):
    assert notebook_verdict(namespace, 2, ENV_RIGHT_OTHERWISE) == "pass"


def test_10_run_all_checks_the_learners_answers(namespace):
    """The exercise cells in the lesson's order: wrong answers fail, then the references pass."""
    from tests.checker_harness import assert_run_all

    wrong = {1: RANKS_WRONG["arrival order, not names"], 2: ENV_WRONG["MASTER_ADDR cut at the first comma"]}
    assert_run_all(namespace, LESSON, wrong, 1)
