"""Two hosts on one machine, for multi-host tests: two network namespaces joined by a veth pair.

``TwoHosts`` creates namespaces ``a`` (address ``HOST_A``) and ``b`` (``HOST_B``), each with its
own loopback and one end of a veth pair, and runs an sshd in ``b`` that a client in ``a`` reaches
by key. Both veth ends are created directly inside the namespaces, so the root namespace's network
configuration is never touched. On exit every process still in either namespace (sshd's sessions,
whatever a test started there) is killed by PID and recorded, and the namespaces, veth and keys
are removed. Needs root, ``ip`` (iproute2), ``/usr/sbin/sshd`` (openssh-server) and ``ssh``
(openssh-client): ``skip_reason()`` says which is missing (``make sshd`` installs them as root).

    with TwoHosts() as hosts:
        hosts.ssh_b("hostname")                                 # from a, over the veth, to b
        subprocess.run(hosts.in_a(["ip", "-o", "-4", "addr"]))  # a local command on host a
    assert not hosts.killed_at_exit
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import os
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import psutil

HOST_A = "10.203.0.1"
HOST_B = "10.203.0.2"
PREFIX_LEN = 24
SSHD = "/usr/sbin/sshd"
# sshd's privilege separation directory (Debian's tmpfiles.d makes it at boot, which a container
# may never run). It is sshd's standard directory, so once made it is left in place.
PRIVSEP_DIR = Path("/run/sshd")
IFNAMSIZ = 15  # longest interface name Linux accepts
START_TIMEOUT = 10.0

_counter = itertools.count()


def _run(argv: list[str], timeout: float = 30) -> subprocess.CompletedProcess:
    """Run a setup command; raise with its output when it fails."""
    result = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed ({result.returncode}): {result.stderr.strip()}")
    return result


@functools.cache
def skip_reason() -> str | None:
    """One line saying why two-host tests cannot run here, or None when they can."""
    if os.geteuid() != 0:
        return "two-host tests need root (network namespaces)"
    if shutil.which("ip") is None:
        return "`ip` missing: install Debian's iproute2 package"
    if not os.access(SSHD, os.X_OK):
        return f"{SSHD} missing: install Debian's openssh-server package"
    for tool in ("ssh", "ssh-keygen", "scp"):
        if shutil.which(tool) is None:
            return f"`{tool}` missing: install Debian's openssh-client package"
    probe = f"ddpm{os.getpid()}p"
    added = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if added.returncode != 0:
        return f"cannot create a network namespace: {added.stderr.strip() or added.returncode}"
    deleted = subprocess.run(["ip", "netns", "delete", probe], capture_output=True, text=True)
    if deleted.returncode != 0:
        return f"cannot delete a network namespace: {deleted.stderr.strip() or deleted.returncode}"
    return None


def _names() -> str:
    """A base for this instance's names, unique per process and instance, short enough that
    ``base + "va"`` fits an interface name."""
    pid, n = os.getpid(), next(_counter)
    for base in (f"ddpm{pid}{n}", f"dm{pid:x}{n}", f"d{pid:x}{n:x}"):
        if len(base) + 2 <= IFNAMSIZ:
            return base
    raise RuntimeError(f"cannot make interface names short enough for pid {pid}, instance {n}")


def _netns_id(path: str) -> tuple[int, int]:
    st = os.stat(path)
    return st.st_dev, st.st_ino


def _alive(process: psutil.Process) -> bool:
    """Running and not a zombie (a zombie has exited; only its parent's wait is missing)."""
    try:
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _describe(process: psutil.Process) -> tuple[int, list[str]]:
    try:
        return process.pid, process.cmdline()
    except psutil.Error:
        return process.pid, []


class TwoHosts:
    """Namespaces ``ns_a`` (HOST_A) and ``ns_b`` (HOST_B) on a veth pair; an sshd listening in
    each (a launcher that starts engines over ssh reaches host a, its own, the same way as b).

    ``exit_grace``: seconds ``close()`` lets processes left in the namespaces (an sshd session
    finishing as the test ends) exit on their own before it kills and records them.
    """

    def __init__(self, exit_grace: float = 2.0) -> None:
        base = _names()
        self.ns_a = f"{base}a"
        self.ns_b = f"{base}b"
        self.veth_a = f"{base}va"
        self.veth_b = f"{base}vb"
        self.exit_grace = exit_grace
        self.tmp: Path | None = None
        self.ssh_config = ""
        self.sshd: subprocess.Popen | None = None
        self.sshd_a: subprocess.Popen | None = None
        self.sshd_log: Path | None = None
        self.killed_at_exit: list[tuple[int, list[str]]] = []
        self._namespaces: list[str] = []
        self._closed = False

    # -- commands ---------------------------------------------------------------------------

    @property
    def ssh_command(self) -> list[str]:
        return ["ssh", "-F", self.ssh_config]

    @property
    def scp_command(self) -> list[str]:
        return ["scp", "-F", self.ssh_config]

    def in_a(self, argv: list[str]) -> list[str]:
        return ["ip", "netns", "exec", self.ns_a, *argv]

    def in_b(self, argv: list[str]) -> list[str]:
        return ["ip", "netns", "exec", self.ns_b, *argv]

    def ssh_b(self, command: str, timeout: float = 30) -> subprocess.CompletedProcess:
        """Run a shell command on host b as root, over ssh from host a."""
        return self.ssh(HOST_B, command, timeout)

    def ssh(self, host: str, command: str, timeout: float = 30) -> subprocess.CompletedProcess:
        """Run a shell command on ``host`` (HOST_A or HOST_B) as root, over ssh from host a."""
        argv = self.in_a([*self.ssh_command, host, command])
        return subprocess.run(argv, capture_output=True, text=True, timeout=timeout)

    # -- processes --------------------------------------------------------------------------

    def processes_in(self, ns: str) -> list[psutil.Process]:
        """Every live process whose network namespace is ``ns`` (zombies have exited)."""
        target = _netns_id(f"/run/netns/{ns}")
        found = []
        for pid in psutil.pids():
            try:
                if _netns_id(f"/proc/{pid}/ns/net") != target:
                    continue
                process = psutil.Process(pid)
                if process.status() != psutil.STATUS_ZOMBIE:
                    found.append(process)
            except (OSError, psutil.Error):
                continue  # vanished, or a zombie whose namespace links are gone
        return found

    def leftovers(self, settle: float = 0.0) -> dict[str, list[psutil.Process]]:
        """Processes in each namespace other than the sshds themselves. With ``settle``, those found
        first get up to that many seconds to exit (an ssh session ends just after its client)."""
        daemons = {daemon.pid for daemon in (self.sshd, self.sshd_a) if daemon is not None}
        found = {ns: [p for p in self.processes_in(ns) if p.pid not in daemons] for ns in self._namespaces}
        deadline = time.monotonic() + settle
        left = [p for ps in found.values() for p in ps]
        while left and time.monotonic() < deadline:
            time.sleep(0.05)  # not this process's children: nothing to wait on but their state
            left = [p for p in left if _alive(p)]
        if settle <= 0:
            return found
        return {ns: [p for p in self.processes_in(ns) if p.pid not in daemons] for ns in self._namespaces}

    # -- lifetime ---------------------------------------------------------------------------

    def __enter__(self) -> TwoHosts:
        try:
            self._network()
            self._keys_and_configs()
            self.sshd = self._start_sshd(self.ns_b, HOST_B)
            self.sshd_a = self._start_sshd(self.ns_a, HOST_A)
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _network(self) -> None:
        for ns in (self.ns_a, self.ns_b):
            _run(["ip", "netns", "add", ns])
            self._namespaces.append(ns)
        # Made inside a with its peer inside b: neither end ever appears in the root namespace.
        _run(["ip", "-n", self.ns_a, "link", "add", self.veth_a, "type", "veth",
              "peer", "name", self.veth_b, "netns", self.ns_b])  # fmt: skip
        for ns, veth, address in ((self.ns_a, self.veth_a, HOST_A), (self.ns_b, self.veth_b, HOST_B)):
            _run(["ip", "-n", ns, "addr", "add", f"{address}/{PREFIX_LEN}", "dev", veth])
            _run(["ip", "-n", ns, "link", "set", "lo", "up"])
            _run(["ip", "-n", ns, "link", "set", veth, "up"])

    def _keys_and_configs(self) -> None:
        self.tmp = tmp = Path(tempfile.mkdtemp(prefix="ddpm-two-hosts-"))  # mode 0700
        for name in ("client_key", "host_key"):
            _run(["ssh-keygen", "-t", "ed25519", "-N", "", "-q", "-C", f"ddpm-{name}", "-f", str(tmp / name)])
        (tmp / "authorized_keys").write_text((tmp / "client_key.pub").read_text())
        host_public = (tmp / "host_key.pub").read_text().strip()
        (tmp / "known_hosts").write_text(f"{HOST_A} {host_public}\n{HOST_B} {host_public}\n")
        # The launcher under test opens many connections at once: raise sshd's limits on
        # unauthenticated connections and sessions per connection. OpenSSH 9's scp speaks SFTP, so
        # the sftp subsystem is needed for scp_command (internal-sftp needs no helper binary).
        (tmp / "sshd_config").write_text(
            f"""\
Port 22
HostKey {tmp}/host_key
AuthorizedKeysFile {tmp}/authorized_keys
PermitRootLogin prohibit-password
PubkeyAuthentication yes
PasswordAuthentication no
KbdInteractiveAuthentication no
UsePAM no
StrictModes no
PrintMotd no
PrintLastLog no
UseDNS no
MaxStartups 100:30:200
MaxSessions 100
Subsystem sftp internal-sftp
"""
        )
        (tmp / "ssh_config").write_text(
            f"""\
Host {HOST_A} {HOST_B}
    User root
    Port 22
    IdentityFile {tmp}/client_key
    IdentitiesOnly yes
    UserKnownHostsFile {tmp}/known_hosts
    GlobalKnownHostsFile /dev/null
    StrictHostKeyChecking yes
    UpdateHostKeys no
    BatchMode yes
    LogLevel ERROR
    ConnectTimeout 5
"""
        )
        self.ssh_config = str(tmp / "ssh_config")

    def _start_sshd(self, ns: str, address: str) -> subprocess.Popen:
        """An sshd in ``ns`` listening on ``address``, once it accepts a login from host a."""
        assert self.tmp is not None
        if not PRIVSEP_DIR.exists():
            PRIVSEP_DIR.mkdir(mode=0o755)
            PRIVSEP_DIR.chmod(0o755)  # whatever the umask: sshd refuses a group/world-writable one
        self.sshd_log = self.tmp / "sshd.log"
        pid_file = self.tmp / f"sshd-{address}.pid"
        with open(self.sshd_log, "ab") as log:
            sshd = subprocess.Popen(
                ["ip", "netns", "exec", ns, SSHD, "-D", "-e", "-f", str(self.tmp / "sshd_config"),
                 "-o", f"ListenAddress={address}", "-o", f"PidFile={pid_file}"],
                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
            )  # fmt: skip
        deadline = time.monotonic() + START_TIMEOUT
        while True:
            if sshd.poll() is not None:
                raise RuntimeError(f"sshd exited ({sshd.returncode}):\n{self._log()}")
            try:
                probe = self.ssh(address, "true", timeout=START_TIMEOUT)
                if probe.returncode == 0:
                    break
                error = probe.stderr.strip()
            except subprocess.TimeoutExpired:
                error = "ssh timed out"
            if time.monotonic() > deadline:
                sshd.kill()
                sshd.wait()
                raise RuntimeError(f"sshd in {ns} refused ssh ({error}):\n{self._log()}")
            time.sleep(0.05)
        # `ip netns exec` execs its command, so the Popen's PID is sshd's own (and the one in the
        # pid file): stopping it by that PID stops the listener.
        process = psutil.Process(sshd.pid)
        recorded = pid_file.read_text().strip()
        if process.exe() != SSHD or recorded != str(sshd.pid):
            raise RuntimeError(f"PID {sshd.pid} is {process.exe()}, pid file says {recorded}")
        return sshd

    def _log(self) -> str:
        try:
            return self.sshd_log.read_text(errors="replace") if self.sshd_log else ""
        except OSError:
            return ""

    def close(self) -> None:
        """Stop sshd, kill (and record) what is left in the namespaces, delete them and the keys.
        Idempotent; every step runs even when one before it failed (the first error is raised)."""
        if self._closed:
            return
        self._closed = True
        errors: list[BaseException] = []
        for sshd in (self.sshd, self.sshd_a):
            if sshd is None or sshd.poll() is not None:
                continue
            try:
                sshd.terminate()
                try:
                    sshd.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    sshd.kill()
                    sshd.wait(timeout=5)
            except Exception as error:
                errors.append(error)
        try:
            self._kill_leftovers()
        except Exception as error:
            errors.append(error)
        for ns in reversed(self._namespaces):  # deleting a namespace removes its veth end too
            try:
                _run(["ip", "netns", "delete", ns])
            except Exception as error:
                errors.append(error)
        self._namespaces.clear()
        if self.tmp is not None:
            shutil.rmtree(self.tmp, ignore_errors=True)
            if self.tmp.exists():
                errors.append(RuntimeError(f"could not remove {self.tmp}"))
        if errors:
            raise errors[0]

    def _kill_leftovers(self) -> None:
        """Whatever is still in the namespaces can only be this test's (sshd's sessions, processes
        a test started there): give it ``exit_grace`` to finish, then SIGKILL it by PID."""
        left = [p for ps in self.leftovers(settle=self.exit_grace).values() for p in ps]
        for process in left:
            self.killed_at_exit.append(_describe(process))
            with contextlib.suppress(psutil.NoSuchProcess):
                process.send_signal(signal.SIGKILL)
        _, alive = psutil.wait_procs(left, timeout=5)
        alive = [p for p in alive if _alive(p)]
        if alive:
            raise RuntimeError(f"still running after SIGKILL: {[_describe(p) for p in alive]}")
