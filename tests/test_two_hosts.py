"""The two-host helper itself: separate network stacks joined by a veth, ssh from a to b, and
nothing left once it exits (tests/two_hosts.py)."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import pytest

from ddp_magics.lifetime import (
    CLUSTER_DIR_ENV,
    KEEPALIVE_SECONDS,
    LIFELINE_ENV,
    OWNER_ENV,
    OWNER_GONE_EXIT_CODE,
)
from tests.leftovers import GIVEN_TEMP_ENV
from tests.two_hosts import HOST_A, HOST_B, TwoHosts, skip_reason
from tests.two_hosts_cases import LINK_ENV, SSH_CONFIG_ENV

ROOT = Path(__file__).resolve().parent.parent
CASES = "tests/two_hosts_cases.py"

pytestmark = pytest.mark.skipif(skip_reason() is not None, reason=skip_reason() or "")

# Listens on HOST_A, prints its port, answers one connection with a line, exits.
SERVER = f"""
import socket
server = socket.create_server(({HOST_A!r}, 0))
print(server.getsockname()[1], flush=True)
connection, _ = server.accept()
connection.sendall(b"hello from a")
connection.close()
"""
CLIENT = f"""
import socket, sys
with socket.create_connection(({HOST_A!r}, int(sys.argv[1])), timeout=5) as s:
    print(s.recv(100).decode())
"""


def netns_names() -> str:
    return subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout


def assert_all_gone(hosts: TwoHosts) -> None:
    names = netns_names()
    assert hosts.ns_a not in names and hosts.ns_b not in names
    assert hosts.sshd is not None and hosts.sshd.returncode is not None
    assert not psutil.pid_exists(hosts.sshd.pid)
    assert hosts.tmp is not None and not hosts.tmp.exists()


def test_two_network_stacks_joined_by_ssh_and_tcp():
    with TwoHosts() as hosts:
        on_b = hosts.ssh_b("ip -o -4 addr show")
        assert on_b.returncode == 0, on_b.stderr
        assert HOST_B in on_b.stdout and HOST_A not in on_b.stdout
        on_a = subprocess.run(hosts.in_a(["ip", "-o", "-4", "addr", "show"]), capture_output=True, text=True)
        assert HOST_A in on_a.stdout and HOST_B not in on_a.stdout

        python = hosts.ssh_b(f"{sys.executable} -c 'import ddp_magics, socket; print(socket.gethostname())'")
        assert python.returncode == 0, python.stderr
        assert python.stdout.strip()

        server = subprocess.Popen(
            hosts.in_a([sys.executable, "-c", SERVER]), stdout=subprocess.PIPE, text=True
        )
        try:
            port = int(server.stdout.readline())
            reply = hosts.ssh_b(f"{sys.executable} -c {shlex.quote(CLIENT)} {port}")
            assert reply.returncode == 0, reply.stderr
            assert reply.stdout.strip() == "hello from a"
            assert server.wait(timeout=10) == 0
        finally:
            server.kill()
            server.wait()
        assert hosts.leftovers(settle=5) == {hosts.ns_a: [], hosts.ns_b: []}
    assert hosts.killed_at_exit == []
    assert_all_gone(hosts)


def test_exit_kills_what_a_test_left_in_the_namespaces():
    with TwoHosts(exit_grace=0) as hosts:
        sleeper = subprocess.Popen(hosts.in_a(["sleep", "60"]))
        detached = hosts.ssh_b("setsid sleep 61 </dev/null >/dev/null 2>&1 & echo $!")
        assert detached.returncode == 0, detached.stderr
        left = hosts.leftovers(settle=1.0)  # the ssh session ends just after its client
        assert [p.pid for p in left[hosts.ns_a]] == [sleeper.pid]
        assert [p.pid for p in left[hosts.ns_b]] == [int(detached.stdout)]
    killed = sorted(cmdline for _, cmdline in hosts.killed_at_exit)
    assert killed == [["sleep", "60"], ["sleep", "61"]]
    # wait_procs reaped the test's own child (so Popen.wait() finds it gone and reports 0).
    sleeper.wait(timeout=5)
    assert not psutil.pid_exists(sleeper.pid)
    assert not psutil.pid_exists(int(detached.stdout))
    assert_all_gone(hosts)


@pytest.mark.timeout(900)  # the whole two-host suite, run by an inner pytest (about 5 minutes)
def test_ranks_on_two_hosts_through_the_ssh_launcher():
    """tests/two_hosts_cases.py, run by pytest in namespace a (the notebook's host): 2 engines
    there and 2 in namespace b, each started over ssh. Afterwards neither namespace runs
    anything but its sshd."""
    with TwoHosts(exit_grace=0) as hosts:
        environment = {
            **os.environ,
            SSH_CONFIG_ENV: hosts.ssh_config,
            LINK_ENV: f"{hosts.ns_a}/{hosts.veth_a} {hosts.ns_b}/{hosts.veth_b}",
            # The temp directory as the engines that ssh starts see it (sshd passes no TMPDIR on):
            # the cases look for each host's files where that host's engines put them.
            "TMPDIR": os.environ.get(GIVEN_TEMP_ENV, tempfile.gettempdir()),
        }
        # Without the leftover check: the cases check what they leave on each host themselves.
        inner_pytest = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"]
        inner_pytest += ["-p", "no:tests.leftovers"]
        inner = subprocess.run(
            hosts.in_a([*inner_pytest, CASES]),
            capture_output=True,
            text=True,
            env=environment,
            cwd=ROOT,
            timeout=900,
        )
        assert inner.returncode == 0, inner.stdout[-6000:] + inner.stderr[-3000:]
        assert "skipped" not in inner.stdout.splitlines()[-1]
        left = {ns: [(p.pid, p.cmdline()) for p in ps] for ns, ps in hosts.leftovers(settle=5).items()}
        assert left == {hosts.ns_a: [], hosts.ns_b: []}
    assert hosts.killed_at_exit == []
    assert_all_gone(hosts)


# The kernel's end of a lifeline, on host a: prints what engines get in their environment.
LIFELINE_ON_A = """
import sys
from ddp_magics.lifetime import Lifeline
lifeline = Lifeline(sys.argv[1])
print(lifeline.environment_value, flush=True)
sys.stdin.read()
"""
# An engine's watch of its owner, on host b: the owner names another machine, so only the lifeline.
WATCHER_ON_B = """
import os, time
from ddp_magics.lifetime import watch_owner
watch_owner()
print("watching", flush=True)
time.sleep(600)
"""


def test_a_remote_process_goes_soon_after_the_kernels_host_vanishes(tmp_path):
    """The link to the kernel's host goes down (no FIN, no RST: packets just stop): the process on
    host b notices through TCP keepalive within about 30 s, not Linux's default 2 hours."""
    with TwoHosts(exit_grace=0) as hosts:
        owner = subprocess.Popen(
            hosts.in_a([sys.executable, "-c", LIFELINE_ON_A, HOST_A]),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            cwd=ROOT,
        )
        watcher = None
        try:
            environment = {
                **os.environ,
                OWNER_ENV: "1:1:boot-id-of-another-machine",
                CLUSTER_DIR_ENV: str(tmp_path),
                LIFELINE_ENV: owner.stdout.readline().strip(),
            }
            watcher = subprocess.Popen(
                hosts.in_b([sys.executable, "-c", WATCHER_ON_B]),
                env=environment,
                stdout=subprocess.PIPE,
                text=True,
                cwd=ROOT,
            )
            assert watcher.stdout.readline() == "watching\n"
            subprocess.run(hosts.in_a(["ip", "link", "set", hosts.veth_a, "down"]), check=True)
            started = time.monotonic()
            assert watcher.wait(timeout=60) == OWNER_GONE_EXIT_CODE
            assert time.monotonic() - started < KEEPALIVE_SECONDS + 15
        finally:
            for process in (watcher, owner):
                if process is not None and process.poll() is None:
                    process.kill()
                    process.wait()
                if process is not None:
                    process.stdout.close()
            owner.stdin.close()
    assert_all_gone(hosts)
