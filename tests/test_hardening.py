"""A shared machine and ordinary events: a planted state directory, listeners, strangers at the
lifeline and the zygote, a stepped clock, forked random state, a long TMPDIR."""

from __future__ import annotations

import json
import os
import socket
import stat
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import psutil
import pytest
from IPython.core.error import UsageError
from IPython.utils.capture import capture_output

from ddp_magics.cluster.records import HostSpec
from ddp_magics.cluster.strays import CLUSTERS_ROOT_NAME, stop_stray_clusters
from ddp_magics.engine.zygote import SOCKET_NAME
from ddp_magics.lifetime import Lifeline, Owner
from ddp_magics.output import MAX_SHOWN_CHARS, RankOutput, live_html
from ddp_magics.private_files import MAX_UNIX_PATH
from tests.conftest import assert_gone, current_magics, run_cell, running_cluster, shown_text

OTHER_UID = 65534  # nobody
IS_ROOT = os.geteuid() == 0


def _plant(kind: str, temp: Path) -> tuple[Path, Path]:
    """A state root as another user could leave it; returns it and the directory that would
    receive what is written into it."""
    root = temp / CLUSTERS_ROOT_NAME
    target = root
    if kind == "symlink":
        target = temp / "someone-elses"
        target.mkdir(mode=0o700)
        root.symlink_to(target)
    elif kind == "mode-0777":
        root.mkdir()
        root.chmod(0o777)
    elif kind == "other-uid":
        root.mkdir(mode=0o700)
        os.chown(root, OTHER_UID, OTHER_UID)
    elif kind == "file":
        root.write_text("")
    return root, target


@pytest.mark.parametrize(
    ("kind", "refusal"),
    [
        ("symlink", "is a symlink"),
        ("mode-0777", "has mode 0777"),
        pytest.param(
            "other-uid",
            f"is owned by uid {OTHER_UID}",
            marks=pytest.mark.skipif(not IS_ROOT, reason="making a directory another user's needs root"),
        ),
        ("file", "is not a directory"),
    ],
)
def test_a_planted_state_root_is_refused_and_nothing_is_written_into_it(ip, magics, temp_dir, kind, refusal):
    root, target = _plant(kind, temp_dir)
    before = sorted(target.rglob("*")) if target.is_dir() else []
    with capture_output() as captured:
        ip.run_line_magic("unload_ext", "ddp_magics")
        ip.run_line_magic("load_ext", "ddp_magics")  # looks for strays there: silently nothing
    assert captured.stdout == ""
    with pytest.raises(UsageError, match=f"{root} {refusal}") as raised:
        ip.run_line_magic("dist_start", "-n 1 --backend gloo")
    assert "\n" not in str(raised.value)
    assert current_magics(ip).cluster is None
    assert (sorted(target.rglob("*")) if target.is_dir() else []) == before
    assert stop_stray_clusters() == []


def test_a_world_writable_parent_without_sticky_bit_is_refused(ip, magics, temp_dir):
    if not IS_ROOT:
        pytest.skip("needs a parent directory owned by another user")
    parent = temp_dir / "open"
    parent.mkdir()
    parent.chmod(0o777)  # no sticky bit: anyone could rename our directory and put theirs there
    os.chown(parent, OTHER_UID, OTHER_UID)
    tempfile.tempdir = str(parent)
    with pytest.raises(UsageError, match="world-writable, not sticky"):
        ip.run_line_magic("dist_start", "-n 1 --backend gloo")


def test_the_state_root_is_made_private(temp_dir):
    assert stop_stray_clusters() == []
    info = os.lstat(temp_dir / CLUSTERS_ROOT_NAME)
    assert stat.S_ISDIR(info.st_mode) and stat.S_IMODE(info.st_mode) == 0o700
    assert info.st_uid == os.geteuid()


def test_a_long_tmpdir_starts_a_cluster(ip, temp_dir):
    """The zygote's socket path is longer than a Unix socket address can hold."""
    long_temp = temp_dir / ("t" * 60) / ("m" * 60)
    long_temp.mkdir(parents=True)
    tempfile.tempdir = str(long_temp)
    with running_cluster(ip, 2) as magics:
        assert len(os.fsencode(magics.cluster.workdir / SOCKET_NAME)) > MAX_UNIX_PATH
        captured, error = run_cell(ip, "", "t = torch.ones(1); dist.all_reduce(t); print(t.item())")
        assert error is None
        assert "2.0" in shown_text(captured)
        with capture_output():
            ip.run_line_magic("dist_restart", "")
        captured, error = run_cell(ip, "", "print(rank)")
        assert error is None


def test_ranks_listen_on_loopback_only(ip, cluster):
    """Rendezvous store, gloo, controller, engines: nothing of a one-host cluster listens on
    another address than 127.0.0.1 (an `ss -ltn` of the cluster's processes)."""
    captured, error = run_cell(ip, "", "import os; print(os.environ['GLOO_SOCKET_IFNAME'])")
    assert error is None and "lo" in shown_text(captured)
    cluster_pids = {process.pid for process in cluster.cluster.processes()}
    listening = [
        (connection.pid, connection.laddr)
        for connection in psutil.net_connections("inet")
        if connection.status == psutil.CONN_LISTEN and connection.pid in cluster_pids
    ]
    store_port = int(_on_ranks(ip, "import os; print(os.environ['MASTER_PORT'])")[0])
    assert store_port in {address.port for _, address in listening}
    assert [(pid, address) for pid, address in listening if address.ip != "127.0.0.1"] == []


def _on_ranks(ip, code: str) -> list[str]:
    captured, error = run_cell(ip, "", code)
    assert error is None, error
    return [line for line in shown_text(captured).splitlines() if not line.startswith("[rank")]


def test_each_rank_draws_its_own_random_numbers_until_a_seed_is_set(ip, healthy):
    with capture_output():
        ip.run_line_magic("dist_restart", "")  # fresh ranks: their first draws
    draws = (
        "import random, numpy; "
        "print(json.dumps([torch.rand(4).tolist(), random.random(), numpy.random.rand(), "
        "torch.initial_seed()]))"
    )
    captured, error = run_cell(ip, "", f"import json\n{draws}")
    assert error is None
    text = shown_text(captured)
    assert "[ranks 0,1]" not in text  # identical output would be shown once
    lines = [json.loads(line) for line in text.splitlines() if line.startswith("[[")]
    assert len(lines) == 2
    for drawn_by_0, drawn_by_1 in zip(*lines):
        assert drawn_by_0 != drawn_by_1
    captured, error = run_cell(ip, "", f"torch.manual_seed(1); random.seed(1); numpy.random.seed(1)\n{draws}")
    assert error is None
    assert "[ranks 0,1]" in shown_text(captured)


def test_a_pythonpath_set_after_start_reaches_restarted_ranks(ip, healthy, tmp_path, monkeypatch):
    (tmp_path / "ddpm_added_later.py").write_text("WHERE = 'found'\n")
    monkeypatch.setenv("PYTHONPATH", f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    with capture_output():
        ip.run_line_magic("dist_restart", "")
    assert _on_ranks(ip, "import ddpm_added_later; print(ddpm_added_later.WHERE)") == ["found"]
    monkeypatch.delenv("PYTHONPATH")
    with capture_output():
        ip.run_line_magic("dist_restart", "")


# ------------------------------------------------------------------------ the clock steps
def test_a_clock_step_leaves_a_running_cluster_alone(ip, healthy, monkeypatch):
    """An NTP step moves the boot time that wall-clock create times are computed from (the
    kernel's /proc/stat btime); boot-relative start times do not move."""
    cluster = healthy.cluster
    owner = Owner.parse((cluster.workdir / "owner").read_text().splitlines()[0])
    linux = sys.modules["psutil._pslinux"]
    booted = linux.boot_time()
    monkeypatch.setattr(linux, "boot_time", lambda: booted + 3600)
    assert psutil.Process().create_time() > time.time()  # the step, as psutil sees it
    assert owner.alive()
    pidfd = owner.pidfd()
    try:
        import select

        assert select.select([pidfd], [], [], 0)[0] == []  # not "gone"
    finally:
        os.close(pidfd)
    swept = stop_stray_clusters()  # other workers' clusters share this root: only ours matters
    assert not [report for report in swept if cluster.workdir.name in report]
    assert cluster.workdir.exists() and not cluster.dead_ranks()
    assert _on_ranks(ip, "print(rank)") == ["0", "1"]


# -------------------------------------------------------------------- strangers at the door
def _recv_closed(connection: socket.socket, within: float) -> bool:
    """Whether the other end closes ``connection`` within ``within`` seconds."""
    connection.settimeout(within)
    try:
        return connection.recv(1) == b""
    except TimeoutError:
        return False
    except ConnectionResetError:
        return True


def test_the_lifeline_admits_only_its_engines():
    lifeline = Lifeline("127.0.0.1", auth_seconds=0.5)
    address, port = lifeline.address.rsplit(":", 1)
    secret = lifeline.environment_value.rsplit("/", 1)[1]
    try:
        wrong = socket.create_connection((address, int(port)))
        wrong.sendall(b"not-the-secret\n")
        silent = socket.create_connection((address, int(port)))
        right = socket.create_connection((address, int(port)))
        right.sendall(secret.encode() + b"\n")
        with wrong, silent, right:
            assert _recv_closed(wrong, within=2)
            assert _recv_closed(silent, within=3)
            assert not _recv_closed(right, within=1)
            lifeline.close()
            lifeline = None
            assert _recv_closed(right, within=2)
    finally:
        if lifeline is not None:
            lifeline.close()


LIFELINE_WITH_FEW_FILES = textwrap.dedent(
    """
    import resource, sys
    from ddp_magics.lifetime import Lifeline
    resource.setrlimit(resource.RLIMIT_NOFILE, (40, 40))
    lifeline = Lifeline("127.0.0.1", auth_seconds=60)
    print(lifeline.environment_value, flush=True)
    sys.stdin.read()
    lifeline.close()
    """
)


def test_the_lifeline_survives_running_out_of_file_descriptors():
    server = subprocess.Popen(
        [sys.executable, "-c", LIFELINE_WITH_FEW_FILES],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    clients = []
    try:
        endpoint, _ = server.stdout.readline().strip().split("/")
        address, port = endpoint.rsplit(":", 1)
        for _ in range(60):  # more than it may open: its accept fails with EMFILE
            clients.append(socket.create_connection((address, int(port))))
        time.sleep(0.5)
        for client in clients:
            client.close()
        clients = []
        wrong = socket.create_connection((address, int(port)))
        wrong.sendall(b"guess\n")
        clients.append(wrong)
        assert _recv_closed(wrong, within=5)  # still served
        assert server.poll() is None
    finally:
        for client in clients:
            client.close()
        server.stdin.close()
        server.wait(timeout=10)
        server.stdout.close()


def _ask_zygote(zygote_socket: Path, payload: bytes, close_early: bool = False) -> bytes:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as client:
        client.connect(str(zygote_socket))
        client.sendall(payload)
        if close_early:
            return b""
        client.settimeout(5)
        try:
            return client.recv(100)
        except ConnectionResetError:
            return b""


def test_bad_clients_cannot_stop_the_zygote(ip, healthy):
    cluster = healthy.cluster
    zygote_socket = cluster.workdir / SOCKET_NAME
    assert _ask_zygote(zygote_socket, b"{not json\n") == b""
    assert _ask_zygote(zygote_socket, b'["a list"]\n') == b""
    assert _ask_zygote(zygote_socket, b'{"nanny": "x"}\n') == b""  # without its two descriptors
    assert _ask_zygote(zygote_socket, b'{"engine": {"argv"', close_early=True) == b""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as silent:
        silent.connect(str(zygote_socket))  # sends nothing: dropped after a timeout
        with capture_output():
            ip.run_line_magic("dist_restart", "")  # forks from the same zygote
    assert cluster.restartable_in_place
    assert _on_ranks(ip, "print(rank)") == ["0", "1"]
    assert "refused a request" in (cluster.workdir / "zygote.log").read_text()


def test_the_zygote_forks_for_no_other_user(ip, healthy, tmp_path):
    if not IS_ROOT:
        pytest.skip("acting as another user needs root")
    cluster = healthy.cluster
    zygote_socket = cluster.workdir / SOCKET_NAME
    # As if the directory's protection were lost: only the zygote's own check is left.
    opened = (cluster.workdir.parent, cluster.workdir, zygote_socket)
    modes = {path: stat.S_IMODE(path.stat().st_mode) for path in opened}
    request = json.dumps({"engine": {"argv": [], "env": {}, "cwd": "/", "output": os.devnull}})
    stranger = textwrap.dedent(
        f"""
        import os, socket
        os.setgid({OTHER_UID}); os.setuid({OTHER_UID})
        client = socket.socket(socket.AF_UNIX)
        client.connect({str(zygote_socket)!r})
        client.settimeout(5)
        try:  # refused: closed at once, perhaps before the request is all sent
            client.sendall({request!r}.encode() + b"\\n")
            print(repr(client.recv(100)))
        except (BrokenPipeError, ConnectionResetError):
            print(repr(b""))
        """
    )
    try:
        for path in opened:
            path.chmod(0o777 if path == zygote_socket else 0o711)
        answer = subprocess.run(
            [sys.executable, "-c", stranger], capture_output=True, text=True, timeout=30
        )
    finally:
        for path, mode in modes.items():
            path.chmod(mode)
    assert answer.stdout.strip() == "b''", answer.stderr
    assert f"uid {OTHER_UID} is not this cluster's user" in (cluster.workdir / "zygote.log").read_text()
    assert _on_ranks(ip, "print(rank)") == ["0", "1"]


# ------------------------------------------------------------- what a rank started ends with it
def test_what_a_rank_started_ends_when_its_engine_is_killed(ip, healthy):
    """A subprocess of a rank (a DataLoader worker, say) goes with the rank's engine, killed by
    anyone; the engine's nanny kills what is left of the engine's process group."""
    cell = "import subprocess\nchild = subprocess.Popen(['sleep', '600'])\nprint(child.pid)"
    children = [psutil.Process(int(line)) for line in _on_ranks(ip, cell)]
    victim = healthy.cluster.ranks[1]
    os.kill(victim.pid, 9)
    assert_gone([children[1]], timeout=5)
    assert children[0].is_running()
    with capture_output():
        ip.run_line_magic("dist_restart", "")
    assert_gone([children[0]], timeout=5)


# ------------------------------------------------------------------------------ a flood of output
def test_a_cell_printing_50_mb_shows_a_bounded_tail(ip, healthy):
    captured, error = run_cell(ip, "", "print(('x' * 99 + '\\n') * 500_000 if rank == 1 else 'small')")
    assert error is None
    shown = shown_text(captured)
    assert len(shown) < MAX_SHOWN_CHARS + 1000
    assert "[rank 0]\nsmall" in shown
    assert "... 499801 earlier lines not shown ..." in shown  # 500,001 lines, the last 200 kept
    captured, error = run_cell(ip, "", "print('y' * 50_000_000 if rank == 1 else 'small')")
    assert error is None
    shown = shown_text(captured)
    assert len(shown) < MAX_SHOWN_CHARS + 1000
    assert f"... {50_000_001 - MAX_SHOWN_CHARS:,} earlier characters not shown ..." in shown


def test_the_live_view_of_a_huge_output_is_bounded():
    huge = RankOutput(rank=0, stdout="z" * 50_000_000)
    html = live_html([huge, RankOutput(rank=1, stdout="ok\n")], {0}, 3.0, tail_lines=12)
    assert len(html) < MAX_SHOWN_CHARS + 2000
    assert "earlier output not shown" in html


# ------------------------------------------------------------ strays of other machines and boots
def _cluster_dir_owned_by(temp: Path, name: str, owner: Owner, host: str) -> Path:
    workdir = temp / CLUSTERS_ROOT_NAME / name
    workdir.mkdir(parents=True)
    (temp / CLUSTERS_ROOT_NAME).chmod(0o700)
    (workdir / "owner").write_text(f"{owner}\n{host}\n")
    return workdir


def test_strays_of_another_machine_are_left_and_of_an_earlier_boot_removed(temp_dir):
    """A temp directory shared over the network holds clusters of kernels on other machines:
    their PIDs mean nothing here. One of this machine's earlier boot cannot be running."""
    elsewhere = _cluster_dir_owned_by(
        temp_dir, "cluster-elsewhere", Owner(os.getpid(), 1, "boot-of-another-machine"), "another-host"
    )
    earlier_boot = _cluster_dir_owned_by(
        temp_dir, "cluster-earlier-boot", Owner(os.getpid(), 1, "an-earlier-boot"), socket.gethostname()
    )
    assert stop_stray_clusters() == []
    assert elsewhere.exists()
    assert not earlier_boot.exists()


def test_ssh_reads_no_host_as_an_option():
    assert HostSpec("ada@node-1:2222", 2).ssh_target == ["-p", "2222", "--", "ada@node-1"]
    assert HostSpec("node-1", 1).ssh_target == ["--", "node-1"]
