"""Lesson 10's checkers refuse wrong answers (right on some layouts, by a wrong method) and pass right ones.

Both exercises run in the notebook's own namespace: exercise 1 with section 4's run as the lesson records it,
exercise 2 in a temporary folder (the lesson's fake Slurm tools made there, as the lesson does). No cluster
is needed.
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
    return [(host, local) for host, pid, count in agents for local in range(count)]
""",
    "names sorted as numbers (node2 before node10)": """
import re
def ranks_by_host(agents):
    key = lambda agent: ([int(t) if t.isdigit() else t for t in re.split(r"(\\d+)", agent[0])], agent[1])
    return [(host, local) for host, pid, count in sorted(agents, key=key) for local in range(count)]
""",
    "RANK = GROUP_RANK x nproc + LOCAL_RANK with the first agent's nproc": """
def ranks_by_host(agents):
    hosts, nproc = [h for h, _, _ in sorted(agents)], agents[0][2]
    total = sum(count for _, _, count in agents)
    return [(hosts[min(r // nproc, len(hosts) - 1)], r % nproc) for r in range(total)]
""",
    "GROUP_RANK in place of the host": """
def ranks_by_host(agents):
    return [(node, local) for node, (host, pid, count) in enumerate(sorted(agents)) for local in range(count)]
""",
    "host names only: two agents of one host in arrival order": """
def ranks_by_host(agents):
    ordered = sorted(agents, key=lambda agent: agent[0])
    return [(host, local) for host, pid, count in ordered for local in range(count)]
""",
    "PIDs compared as text": """
def ranks_by_host(agents):
    ordered = sorted(agents, key=lambda agent: (agent[0], str(agent[1])))
    return [(host, local) for host, pid, count in ordered for local in range(count)]
""",
}

RANKS_RIGHT_OTHERWISE = """
import itertools
def ranks_by_host(agents):
    ordered = sorted(agents, key=lambda agent: (agent[0], agent[1]))
    starts = [0, *itertools.accumulate(count for _, _, count in ordered)]
    return {start + local: [host, local]
            for (host, _, count), start in zip(ordered, starts) for local in range(count)}
"""

ENV_RIGHT_BUT = """
import re
def torch_env(slurm):
    counts = []
    for count, repeat in re.findall(r"(\\d+)(?:\\(x(\\d+)\\))?", slurm["SLURM_TASKS_PER_NODE"]):
        counts += [int(count)] * int(repeat or 1)
    node, local = int(slurm["SLURM_NODEID"]), int(slurm["SLURM_LOCALID"])
    return {"RANK": @RANK@, "WORLD_SIZE": slurm["SLURM_NTASKS"], "LOCAL_RANK": local,
            "LOCAL_WORLD_SIZE": @LOCAL_WORLD_SIZE@, "GROUP_RANK": node, "device": @DEVICE@}
"""
RIGHT_PARTS = {"RANK": 'slurm["SLURM_PROCID"]', "LOCAL_WORLD_SIZE": "counts[node]",
               "DEVICE": '"cuda:0" if "SLURM_GPUS_PER_TASK" in slurm else f"cuda:{local}"'}


def env_answer(**parts):
    """The reference's method with some parts replaced by wrong ones."""
    code = ENV_RIGHT_BUT
    for name, right in RIGHT_PARTS.items():
        code = code.replace(f"@{name}@", parts.get(name, right))
    return code


ENV_WRONG = {
    "LOCAL_WORLD_SIZE as the average over nodes": env_answer(
        LOCAL_WORLD_SIZE='int(slurm["SLURM_NTASKS"]) // int(slurm["SLURM_NNODES"])'),
    "LOCAL_WORLD_SIZE from the list split at commas": """
def torch_env(slurm):
    local = int(slurm["SLURM_LOCALID"])
    return {"RANK": slurm["SLURM_PROCID"], "WORLD_SIZE": slurm["SLURM_NTASKS"], "LOCAL_RANK": local,
            "LOCAL_WORLD_SIZE": slurm["SLURM_TASKS_PER_NODE"].split(",")[int(slurm["SLURM_NODEID"])],
            "GROUP_RANK": slurm["SLURM_NODEID"],
            "device": "cuda:0" if "SLURM_GPUS_PER_TASK" in slurm else f"cuda:{local}"}
""",
    "LOCAL_WORLD_SIZE of the first node": env_answer(LOCAL_WORLD_SIZE="counts[0]"),
    "device cuda:LOCAL_RANK under --gpus-per-task too": env_answer(DEVICE='f"cuda:{local}"'),
    "RANK from node and local id (wrong under cyclic distribution and uneven nodes)": env_answer(
        RANK="sum(counts[:node]) + local"),
}

# a different right answer: the compressed list expanded by hand, the device from the GPUs the task sees
ENV_RIGHT_OTHERWISE = """
def torch_env(slurm):
    counts = []
    for part in slurm["SLURM_TASKS_PER_NODE"].split(","):
        count, _, times = part.rstrip(")").partition("(x")
        counts.extend([int(count)] * (int(times) if times else 1))
    local = int(slurm["SLURM_LOCALID"])
    visible_one = int(slurm.get("SLURM_GPUS_PER_TASK", 0)) > 0
    return {"RANK": int(slurm["SLURM_PROCID"]), "WORLD_SIZE": int(slurm["SLURM_NTASKS"]), "LOCAL_RANK": local,
            "LOCAL_WORLD_SIZE": counts[int(slurm["SLURM_NODEID"])], "GROUP_RANK": int(slurm["SLURM_NODEID"]),
            "device": "cuda:0" if visible_one else "cuda:%d" % local}
"""


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


def test_10_torch_env_accepts_a_hand_parser(namespace):
    assert notebook_verdict(namespace, 2, ENV_RIGHT_OTHERWISE) == "pass"


def test_10_run_all_checks_the_learners_answers(namespace):
    """The exercise cells in the lesson's order: wrong answers fail, then the references pass."""
    from tests.checker_harness import assert_run_all

    wrong = {1: RANKS_WRONG["arrival order, not names"], 2: ENV_WRONG["LOCAL_WORLD_SIZE of the first node"]}
    assert_run_all(namespace, LESSON, wrong, 1)
