"""The one-host suite's features and failures with ranks on two hosts, the failing rank on the
"remote" one. Run by tests/test_two_hosts.py inside network namespace a of a TwoHosts (with an
sshd on both hosts); collected only when named, and skipped outside that fixture.

Hosts: a (10.203.0.1, the notebook's) runs ranks 0 and 1, b (10.203.0.2) ranks 2 and 3.
"""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import tempfile
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import psutil
import pytest
from IPython.core.error import UsageError
from IPython.utils.capture import capture_output
from jupyter_client.manager import start_new_kernel

from ddp_magics.errors import DistributedCellError
from tests.conftest import assert_gone, current_magics, run_cell, shown_text
from tests.two_hosts import HOST_A, HOST_B

SSH_CONFIG_ENV = "DDP_MAGICS_TEST_SSH_CONFIG"
LINK_ENV = "DDP_MAGICS_TEST_LINK"  # "ns_a/veth_a ns_b/veth_b": each host's end of the link
NOWHERE_MAC = "02:00:00:00:00:01"  # a locally administered address no interface here has
pytestmark = pytest.mark.skipif(SSH_CONFIG_ENV not in os.environ, reason="run by tests/test_two_hosts.py")
HOSTS = f"{HOST_A}:2,{HOST_B}:2"
ZYGOTE_ON_HOST = ["ddp_magics.engine.zygote", "--host"]


@pytest.fixture(scope="module")
def ssh(ip):
    config = os.environ[SSH_CONFIG_ENV]
    ip.run_line_magic("config", f"DistributedMagics.ssh_command = ['ssh', '-F', {config!r}]")


def test_bad_hosts_start_nothing(ip, magics, ssh):
    children_before = {p.pid for p in psutil.Process().children(recursive=True)}
    with pytest.raises(UsageError, match=f"cannot start engines on {HOST_B}:2222: .*refused"):
        ip.run_line_magic("dist_start", f"--hosts {HOST_A}:2,{HOST_B}:2222:2")  # no sshd on that port
    no_gpu = f"nccl needs a GPU per rank: {HOST_A} runs 2 ranks and has 0 GPUs"
    with pytest.raises(UsageError, match=no_gpu):
        ip.run_line_magic("dist_start", f"--hosts {HOSTS} --backend nccl")
    assert magics.cluster is None
    assert {p.pid for p in psutil.Process().children(recursive=True)} <= children_before
    # host a answered and was prepared before b failed: its directory went with the failed start
    assert not list((Path(tempfile.gettempdir()) / f"ddp_magics-{os.geteuid()}").glob("host-*"))


def test_each_host_keeps_the_engines_files_private_and_cleans_what_ended_kernels_left(ip, magics, ssh):
    """Engines on a host keep their files in that host's own private directory; a directory left
    there by a kernel that vanished (its engines gone, nothing running of it) goes at the next
    start on that host."""
    root = Path(tempfile.gettempdir()) / f"ddp_magics-{os.geteuid()}"
    leftover = root / "host-cluster-of-a-vanished-kernel"
    (leftover / "profile" / "log").mkdir(parents=True)
    an_hour_ago = time.time() - 3600
    os.utime(leftover, (an_hour_ago, an_hour_ago))
    with capture_output():
        ip.run_line_magic("dist_start", f"--hosts {HOST_A}:1,{HOST_B}:1 --backend gloo")
    cluster = current_magics(ip).cluster
    try:
        assert not leftover.exists()
        captured, error = run_cell(ip, "", "import os\nprint(os.environ['DDP_MAGICS_CLUSTER_DIR'])")
        assert error is None
        directories = [Path(line) for line in shown_text(captured).splitlines() if line.startswith("/")]
        assert len(set(directories)) == 2 and all(d.name.startswith("host-cluster-") for d in directories)
        assert {stat.S_IMODE(d.stat().st_mode) for d in directories} == {0o700}
        processes = cluster.processes()
    finally:
        with capture_output():
            ip.run_line_magic("dist_stop", "")
    assert_gone(processes)
    assert not [d for d in directories if d.exists()]


def test_stop_after_a_hang_across_hosts_is_quiet_and_leaves_nothing(ip, magics, ssh):
    """Issue 25: %dist_stop of a cluster whose ranks hang says one line (nothing of ipyparallel's
    or ssh's), and leaves no process of it and no directory on either host."""
    root = Path(tempfile.gettempdir()) / f"ddp_magics-{os.geteuid()}"
    with capture_output():
        ip.run_line_magic("dist_start", f"--hosts {HOST_A}:1,{HOST_B}:1 --backend gloo")
    cluster = current_magics(ip).cluster
    _, error = run_cell(ip, "--timeout 1", "if rank == 0:\n    dist.recv(torch.zeros(1), src=1)")
    assert isinstance(error, DistributedCellError)
    processes = cluster.processes() + [psutil.Process(info.pid) for info in cluster.ranks]
    assert len(list(root.glob("host-*"))) == 2
    with capture_output() as captured:
        ip.run_line_magic("dist_stop", "")
    assert (captured.stdout, captured.stderr) == ("Stopped 2 ranks.\n", "")
    assert_gone(processes, timeout=5)
    assert not list(root.glob("host-*"))


@pytest.fixture(scope="module")
def two_hosts(ip, ssh):
    with capture_output() as captured:
        ip.run_line_magic("dist_start", f"--hosts {HOSTS} --backend gloo")
    assert captured.stdout.strip() == "4 ranks ready: backend gloo, world size 4, devices cpu x4"
    magics = current_magics(ip)
    yield magics
    processes = magics.cluster.processes() if magics.cluster else []
    with capture_output():
        ip.run_line_magic("dist_stop", "")
    assert_gone(processes)


@pytest.fixture
def healthy(ip, two_hosts):
    yield two_hosts
    if two_hosts.cluster.dead_ranks() or two_hosts.cluster.busy_ranks():
        with capture_output():
            ip.run_line_magic("dist_restart", "")


def test_ranks_come_host_by_host_with_torchrun_variables(ip, healthy):
    table = ip.run_line_magic("dist_status", "")
    assert table.columns == ("rank", "host", "address", "pid", "device", "state")
    assert [row[2] for row in table.rows] == [HOST_A, HOST_A, HOST_B, HOST_B]
    assert [row[-1] for row in table.rows] == ["alive"] * 4
    names = ["LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE", "MASTER_ADDR"]
    captured, error = run_cell(ip, "", f"import os\nprint(rank, *[os.environ[n] for n in {names}])")
    assert error is None
    assert shown_text(captured) == "\n".join(
        f"[rank {rank}]\n{rank} {rank % 2} 2 {rank // 2} 2 {HOST_A}" for rank in range(4)
    )
    # The connection files (the controller's keys) are the user's alone, in a directory only the
    # user can enter.
    workdir = healthy.cluster.workdir
    files = sorted((workdir / "profile" / "security").glob("ipcontroller-*.json"))
    assert len(files) == 2 and {stat.S_IMODE(path.stat().st_mode) for path in files} == {0o600}
    assert stat.S_IMODE(workdir.stat().st_mode) == stat.S_IMODE(workdir.parent.stat().st_mode) == 0o700
    # gloo talks over the veth, not over the address the host name resolves to.
    captured, _ = run_cell(ip, "", "print(os.environ['GLOO_SOCKET_IFNAME'].endswith(('va', 'vb')))")
    assert shown_text(captured) == "[ranks 0-3]\nTrue"


def test_each_host_has_one_zygote_whose_secrets_are_on_no_command_line(ip, healthy):
    """Issue 25: every engine of a host is forked by that host's zygote, started over one ssh
    session; the lifeline's secret reaches it over the session, never in an argument list."""
    # Engines and nannies forked by a zygote keep its command line: the zygotes are the first.
    forked = [p for p in psutil.process_iter(["cmdline"]) if (p.info["cmdline"] or [])[-2:] == ZYGOTE_ON_HOST]
    zygotes = [p for p in forked if p.ppid() not in {other.pid for other in forked}]
    assert len(zygotes) == 2
    for info in healthy.cluster.ranks:  # one PID namespace: the test sees host b's processes
        assert psutil.Process(info.pid).ppid() in {zygote.pid for zygote in zygotes}
    secret = healthy.cluster._processes.lifeline.environment_value.partition("/")[2]
    assert len(secret) >= 16
    arguments = [" ".join(process.info["cmdline"] or []) for process in psutil.process_iter(["cmdline"])]
    assert not [line for line in arguments if secret in line]


def test_output_ranks_push_pull_and_collectives_across_hosts(ip, healthy):
    ip.user_ns["scale"] = 10.0
    ip.run_line_magic("dist_push", "scale")
    cell = "t = torch.tensor([rank * scale])\ndist.all_reduce(t)\nprint(t.item())"
    captured, error = run_cell(ip, "", cell)
    assert error is None
    assert shown_text(captured) == "[ranks 0-3]\n60.0"
    captured, error = run_cell(ip, "--ranks 2-3", "print('on b', rank)")
    assert error is None
    assert shown_text(captured) == "[rank 2]\non b 2\n[rank 3]\non b 3"
    pulled = ip.run_line_magic("dist_pull", "t")
    assert {rank: t.item() for rank, t in pulled.items()} == dict.fromkeys(range(4), 60.0)
    assert ip.run_line_magic("dist_pull", "rank") == {0: 0, 1: 1, 2: 2, 3: 3}


def test_trace_of_a_transfer_between_hosts(ip, healthy):
    cell = "t = torch.tensor([float(rank)])\nif rank == 3:\n    dist.send(t, dst=0)\n"
    cell += "if rank == 0:\n    dist.recv(t, src=3)"
    captured, error = run_cell(ip, "--trace tr --diagram", cell)
    assert error is None
    trace = ip.user_ns["tr"]
    assert [step.title() for step in trace.steps] == ["send/recv rank 3 -> rank 0"]
    # The diagram (its text form here: the test's shell shows no images) draws that transfer.
    assert "send/recv rank 3 -> rank 0" in shown_text(captured)
    assert trace.draw().gids("arrow:") == ["arrow:3->0"]


def test_profile_across_hosts_states_each_clock_offset(ip, healthy, tmp_path):
    """--profile with ranks on two hosts: each rank's clock offset is measured (one machine's
    clock seen from two network stacks: zero within the measurement's bound) and stated, and the
    ranks' all-reduces line up on the merged clock. And %dist_status's memory of remote ranks."""
    cell = "t = torch.ones(1000)\nfor _ in range(5):\n    dist.all_reduce(t)"
    captured, error = run_cell(ip, "--profile prof", cell)
    assert error is None, error
    profile = ip.user_ns["prof"]
    assert profile.ranks == [0, 1, 2, 3]
    offsets = {rank: row["clock_offset"] for rank, row in profile.summary().items()}
    bounds = {rank: row["clock_offset_bound"] for rank, row in profile.summary().items()}
    # One machine's clock: each offset measured within its bound, so taken as none.
    assert offsets == dict.fromkeys(range(4), 0.0) and all(0 < bound < 0.05 for bound in bounds.values())
    text = captured.stdout
    assert all(
        f"rank {rank}: its clock" in text and "ms from the notebook's (measured, ± " in text
        for rank in range(4)
    )
    reduces = {
        rank: [
            s
            for s in profile.spans[rank]
            if s.kind == "communication" and (s.label or "").startswith("all_reduce")
        ]
        for rank in range(4)
    }
    assert {len(spans) for spans in reduces.values()} == {5}
    for index in range(5):
        same = [reduces[rank][index] for rank in range(4)]
        assert max(s.start for s in same) <= min(s.end for s in same) + 0.002, same
    saved = json.loads(profile.save(tmp_path / "hosts.json").read_text())
    assert set(saved["otherData"]["clock_offsets_seconds"]) == {"0", "1", "2", "3"}
    # %dist_status asks each host's ranks for their memory (none of them on this machine's stack).
    memory = ip.run_line_magic("dist_status", "").memory
    assert all(memory[rank] is not None and memory[rank].resident > 50 << 20 for rank in range(4))


def test_hang_on_the_remote_host_is_reported_with_its_line_call_and_trace(ip, healthy):
    cell = "t = torch.zeros(1)\nprint('waiting', rank)\nif rank == 3:\n    dist.recv(t, src=1)"
    _, error = run_cell(ip, "--timeout 3 --trace tr", cell)
    assert isinstance(error, DistributedCellError)
    assert str(error) == "rank 3 still running after 3 s (rank 3 in recv from rank 1 at cell line 4)"
    report = error._render_traceback_()
    assert "    line 4: dist.recv(t, src=1)" in report
    assert any(line.startswith('      File "torch/distributed/distributed_c10d.py"') for line in report)
    assert ip.user_ns["tr"].in_progress(3).call() == "recv from rank 1"
    with capture_output():
        ip.run_line_magic("dist_restart", "")
    _, error = run_cell(ip, "", "dist.barrier()\nprint('back', rank)")
    assert error is None


def test_remote_rank_raising_while_the_others_wait_in_all_reduce(ip, healthy, magics):
    magics.error_grace = 1.0
    try:
        cell = "t = torch.ones(1)\nif rank == 2:\n    raise RuntimeError('rank 2 gave up')\n"
        cell += "dist.all_reduce(t)"
        _, error = run_cell(ip, "", cell)
    finally:
        magics.error_grace = 5.0
    assert isinstance(error, DistributedCellError)
    assert str(error) == (
        "rank 2 raised RuntimeError: rank 2 gave up; ranks 0,1,3 were waiting in all_reduce at cell "
        "line 4 and were released (state kept, new process group)"
    )
    report = "\n".join(error._render_traceback_())
    assert "[ranks 0,1,3] released: they were waiting in all_reduce at cell line 4" in report
    # Released with their state (t is still defined), across hosts: the next cell runs at once.
    next_cell = "u = torch.ones(1)\ndist.all_reduce(u)\nprint(type(t).__name__, u.item())"
    captured, error = run_cell(ip, "", next_cell)
    assert error is None
    assert shown_text(captured) == "[ranks 0-3]\nTensor 4.0"


def test_kill_9_of_a_remote_engine(ip, healthy):
    victim = healthy.cluster.ranks[3]
    assert victim.address == HOST_B
    engine = psutil.Process(victim.pid)
    os.kill(victim.pid, signal.SIGKILL)  # one PID namespace: the test can reach host b's processes
    assert_gone([engine], timeout=5)  # SIGKILL is delivered asynchronously: the cell must find it dead
    _, error = run_cell(ip, "", "print('hello')")
    assert isinstance(error, UsageError) and "rank 3 died" in str(error)
    assert [row[-1] for row in ip.run_line_magic("dist_status", "").rows] == ["alive"] * 3 + ["dead"]
    with capture_output():
        ip.run_line_magic("dist_restart", "")
    _, error = run_cell(ip, "", "dist.barrier()\nprint(rank)")
    assert error is None
    assert healthy.cluster.ranks[3].pid != victim.pid


def test_interrupt_reaches_the_remote_ranks(ip, healthy):
    timer = threading.Timer(2.0, os.kill, (os.getpid(), signal.SIGINT))
    timer.start()
    try:
        _, error = run_cell(ip, "", "import time\nwhile True:\n    time.sleep(0.01)")
    finally:
        timer.cancel()
    assert isinstance(error, DistributedCellError)
    assert str(error) == "ranks 0-3 were interrupted"
    _, error = run_cell(ip, "", "dist.barrier()\nprint('after', rank)")
    assert error is None


def test_what_a_remote_rank_started_ends_with_its_engine(ip, healthy):
    """A subprocess (a DataLoader worker, say) of a rank on host b ends when a restart kills that
    rank's engine, as on the notebook's host."""
    cell = "import subprocess\nchild = subprocess.Popen(['sleep', '600'])\nprint(child.pid)"
    captured, error = run_cell(ip, "--ranks 2-3", cell)
    assert error is None
    children = [psutil.Process(int(line)) for line in shown_text(captured).splitlines() if line.isdigit()]
    assert len(children) == 2
    with capture_output():
        ip.run_line_magic("dist_restart", "")
    assert_gone(children, timeout=5)


@contextmanager
def link_down(after: float, seconds: float):
    """The link between the hosts down from ``after`` seconds on, for ``seconds``: leaving waits
    until it is up again (at once if the block raised). Down as when a switch between them
    fails: each host goes on sending, to a hardware address nobody has, so what it sends is lost
    on the way (no FIN, no RST, TCP resends with its usual back-off), and each host's own address
    keeps working for its own processes. (Taking an interface down, or dropping in its queue,
    is a local error instead: TCP then gives up on a connection within seconds.)"""
    ends = [end.split("/") for end in os.environ[LINK_ENV].split()]
    peers = {ends[0][0]: HOST_B, ends[1][0]: HOST_A}

    lock = threading.Lock()
    applied: list[str] = []

    def set_link(state: str) -> None:
        with lock:
            if (applied[-1] if applied else "up") == state:
                return
            for namespace, veth in ends:
                if state == "down":
                    lost = ["lladdr", NOWHERE_MAC, "nud", "permanent"]
                    change = ["replace", peers[namespace], *lost, "dev", veth]
                else:
                    change = ["del", peers[namespace], "dev", veth]  # the next packet asks again (ARP)
                subprocess.run(["ip", "-n", namespace, "neigh", *change], check=True)
            applied.append(state)

    down = threading.Timer(after, set_link, ("down",))
    up = threading.Timer(after + seconds, set_link, ("up",))
    down.start()
    up.start()
    try:
        yield
    except BaseException:
        down.cancel()
        up.cancel()
        down.join()
        set_link("up")
        raise
    down.join()
    up.join()


ALL_REDUCES_FOR_10_S = """\
import time
total = torch.zeros(1)
for step in range(100):
    t = torch.ones(1)
    dist.all_reduce(t)
    total += t
    time.sleep(0.1)
print(rank, total.item())
"""


def test_a_network_blip_shorter_than_the_cell_timeout_kills_nobody(ip, healthy):
    """6 s without a link while ranks on both hosts all_reduce: the cell finishes (TCP resends
    what was lost) and every rank is alive (issue 22: such a blip once killed every far rank)."""
    with link_down(after=2.0, seconds=6.0):
        captured, error = run_cell(ip, "--timeout 60", ALL_REDUCES_FOR_10_S)
    assert error is None, shown_text(captured)
    assert (
        shown_text(captured) == "[rank 0]\n0 400.0\n[rank 1]\n1 400.0\n[rank 2]\n2 400.0\n[rank 3]\n3 400.0"
    )
    assert healthy.cluster.dead_ranks() == []


def test_a_partition_past_the_cell_timeout_is_reported_then_recovered_with_state(ip, healthy):
    """The link down longer than the cell's timeout: a hang report; once it is back, %dist_recover
    re-forms the group across the hosts and every rank still has what it had."""
    run_cell(ip, "", "kept = torch.arange(3.0) + rank")
    with link_down(after=1.0, seconds=9.0):
        _, error = run_cell(ip, "--timeout 4", ALL_REDUCES_FOR_10_S)
        assert isinstance(error, DistributedCellError) and "still running after 4 s" in str(error)
    assert healthy.cluster.dead_ranks() == []
    with capture_output() as captured:
        ip.run_line_magic("dist_recover", "")
    assert captured.stdout.startswith("Recovered: a new gloo process group of 4 ranks"), captured.stdout
    captured, error = run_cell(
        ip, "", "t = torch.ones(1)\ndist.all_reduce(t)\nprint(t.item(), kept.tolist())"
    )
    assert error is None
    assert shown_text(captured) == (
        "[rank 0]\n4.0 [0.0, 1.0, 2.0]\n[rank 1]\n4.0 [1.0, 2.0, 3.0]\n"
        "[rank 2]\n4.0 [2.0, 3.0, 4.0]\n[rank 3]\n4.0 [3.0, 4.0, 5.0]"
    )


def test_a_killed_remote_rank_is_replaced_on_its_host(ip, healthy):
    run_cell(ip, "", "kept = rank")
    victim = healthy.cluster.ranks[2]
    os.kill(victim.pid, signal.SIGKILL)  # one PID namespace: the test can reach host b's processes
    assert_gone([psutil.Process(victim.pid)] if psutil.pid_exists(victim.pid) else [], timeout=5)
    with capture_output() as captured:
        ip.run_line_magic("dist_recover", "")
    assert "rank 2 died and was replaced by a new engine" in captured.stdout
    assert healthy.cluster.ranks[2].address == HOST_B and healthy.cluster.ranks[2].pid != victim.pid
    captured, error = run_cell(
        ip, "", "t = torch.ones(1)\ndist.all_reduce(t)\nprint(t.item(), globals().get('kept'))"
    )
    assert error is None
    assert shown_text(captured) == "[rank 0]\n4.0 0\n[rank 1]\n4.0 1\n[rank 2]\n4.0 None\n[rank 3]\n4.0 3"


READY_LINE = "4 ranks ready: backend gloo, world size 4, devices cpu x4"


def said_by(client, code: str) -> list[tuple[str, str]]:
    """The streams (name, text) a real kernel sent while running ``code``, which must succeed."""
    shown = []
    reply = client.execute_interactive(code, timeout=120, output_hook=shown.append)
    assert reply["content"]["status"] == "ok", shown
    return [(m["content"]["name"], m["content"]["text"]) for m in shown if m["msg_type"] == "stream"]


RESTARTS_ENV = "DDP_MAGICS_TEST_TWO_HOST_RESTARTS"  # a longer run than make test's: e.g. 20


def test_restarts_after_a_hang_in_a_row_across_hosts(ip, healthy):
    """Issue 31: a restart after a hang (rank 0 on host a waiting for rank 3 on host b) works every
    time, and leaves nothing of the old engines on either host."""
    for _ in range(int(os.environ.get(RESTARTS_ENV, "5"))):
        _, error = run_cell(ip, "--timeout 1", "if rank == 0:\n    dist.recv(torch.zeros(1), src=3)")
        assert isinstance(error, DistributedCellError)
        old = [psutil.Process(info.pid) for info in healthy.cluster.ranks]
        with capture_output() as captured:
            ip.run_line_magic("dist_restart", "")
        # Issue 25: nothing of ipyparallel's (its cmd_kill traceback, its logging) reaches the cell.
        assert captured.stdout.strip() == "4 ranks ready: backend gloo, world size 4, devices cpu x4"
        assert captured.stderr == "", captured.stderr
        assert_gone(old, timeout=10)
        captured, error = run_cell(ip, "", "t = torch.ones(1)\ndist.all_reduce(t)\nprint(t.item())")
        assert error is None and shown_text(captured) == "[ranks 0-3]\n4.0"


def test_breakpoint_on_a_remote_rank_is_answered_in_the_front_end(ssh):
    """Issue 23 on two hosts: a real kernel (as JupyterLab runs one) with ranks on a and b; rank 3,
    on b, stops in breakpoint() and its prompt is answered through the kernel's input request."""
    manager, client = start_new_kernel(kernel_name="python3")
    try:
        config = os.environ[SSH_CONFIG_ENV]
        start = (
            f"%load_ext ddp_magics\n%config DistributedMagics.ssh_command = ['ssh', '-F', {config!r}]\n"
            f"%dist_start --hosts {HOSTS} --backend gloo"
        )
        # Issue 25: in a real kernel, where a library's logging would reach the cell, the start and
        # (at the end) a restart after a hang say one line each.
        assert said_by(client, start) == [("stdout", READY_LINE + "\n")]
        answers = iter(["p rank, os.environ['MASTER_ADDR']", "c"])
        prompts, outputs = [], []

        def answer(message):
            prompts.append(message["content"]["prompt"])
            client.input(next(answers))

        cell = "%%distributed\nimport os\nif rank == 3:\n    breakpoint()\n"
        cell += "t = torch.ones(1)\ndist.all_reduce(t)\nprint(t.item())"
        reply = client.execute_interactive(
            cell, timeout=60, allow_stdin=True, stdin_hook=answer, output_hook=outputs.append
        )
        text = "".join(m["content"]["text"] for m in outputs if m["msg_type"] == "stream")
        assert reply["content"]["status"] == "ok", text
        assert prompts == ["(Pdb rank 3) ", "(Pdb rank 3) "]
        assert f"(3, '{HOST_A}')" in text.splitlines()
        hang = "%%distributed --timeout 1\nif rank == 0:\n    dist.recv(torch.zeros(1), src=3)"
        client.execute_interactive(hang, timeout=60)
        assert said_by(client, "%dist_restart") == [("stdout", READY_LINE + "\n")]
        assert client.execute_interactive("%dist_stop", timeout=60)["content"]["status"] == "ok"
    finally:
        client.stop_channels()
        manager.shutdown_kernel(now=True)
