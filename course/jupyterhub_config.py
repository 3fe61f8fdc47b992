# The course hub's configuration: JupyterHub, its proxy and one Jupyter server per learner, each
# run as the learner's own Unix user. Started by `python -m course.serve` (which sets the
# DDP_COURSE_* variables read below); see docs/course.md.
import os
import sys
from pathlib import Path

c = get_config()  # noqa: F821 (JupyterHub's config loader provides it)

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

# ---- What the instructor sets once ---------------------------------------------------------
# Learners: local Unix users (create them with useradd; their homes are made private, 0700, and
# the lessons copied in, as each one's server first starts). They log in with their Unix password.
c.Authenticator.allowed_users = set()  # e.g. {"alice", "bob"}; or let admins add them in the hub
c.Authenticator.admin_users = set()  # e.g. {"instructor"}
c.Authenticator.allow_existing_users = True  # users the admin adds in the hub's admin page may log in

c.CourseSpawner.ranks_per_learner = 4  # what %dist_start starts without -n
c.CourseSpawner.max_local_ranks = 4  # the most ranks one learner's %dist_start runs
c.CourseSpawner.mem_limit = "3G"  # a learner's server, kernels and ranks together (a memory cgroup)
c.CourseSpawner.lessons_folder = "lessons"  # ~/lessons/NN_*.ipynb
# ---------------------------------------------------------------------------------------------

from course.spawner import CourseSpawner  # noqa: E402

STATE = Path(os.environ.get("DDP_COURSE_STATE", "."))
PORT = int(os.environ.get("DDP_COURSE_PORT", "8000"))

c.JupyterHub.bind_url = f"http://127.0.0.1:{PORT}"
c.JupyterHub.hub_ip = "127.0.0.1"
c.JupyterHub.hub_port = int(os.environ.get("DDP_COURSE_HUB_PORT", str(PORT + 81)))
c.ConfigurableHTTPProxy.api_url = f"http://127.0.0.1:{os.environ.get('DDP_COURSE_PROXY_API_PORT', PORT + 1)}"
c.ConfigurableHTTPProxy.command = [
    os.environ.get("DDP_COURSE_NODE", "node"),
    str(REPO / "course" / "proxy" / "node_modules" / "configurable-http-proxy" / "bin"
        / "configurable-http-proxy"),
]
c.ConfigurableHTTPProxy.pid_file = str(STATE / "proxy.pid")
c.JupyterHub.db_url = f"sqlite:///{STATE / 'jupyterhub.sqlite'}"
c.JupyterHub.cookie_secret_file = str(STATE / "jupyterhub_cookie_secret")
c.JupyterHub.pid_file = str(STATE / "jupyterhub.pid")
# The hub's event-loop metric wakes it every 50 ms: 0.43 % of a core, idle, with no learner.
c.PeriodicMetricsCollector.event_loop_interval_enabled = False
c.JupyterHub.cleanup_servers = True  # stopping the hub stops every learner's server (and their clusters)

c.JupyterHub.authenticator_class = "pam"
c.JupyterHub.spawner_class = CourseSpawner
c.Spawner.ip = "127.0.0.1"
c.Spawner.cmd = [str(Path(sys.executable).parent / "jupyterhub-singleuser")]
c.Spawner.default_url = "/lab"
c.Spawner.notebook_dir = "~"
c.Spawner.start_timeout = 300  # a class logging in at once on a small server
c.Spawner.http_timeout = 300
c.Spawner.env_keep = ["LANG", "LC_ALL", "TZ"]  # not the hub's PATH or PYTHONPATH
c.Spawner.environment = {"PATH": f"{Path(sys.executable).parent}:/usr/local/bin:/usr/bin:/bin"}
c.Spawner.args = [
    # kernels on Unix sockets in the learner's private runtime directory, not loopback ports
    "--KernelManager.transport=ipc",
    "--ServerApp.shutdown_no_activity_timeout=0",
]

# An API token for scripts (tests, benchmarks/course.py): a service with the admin role.
_admin_token = os.environ.get("DDP_COURSE_ADMIN_TOKEN")
if _admin_token:
    c.JupyterHub.services = [{"name": "course-admin", "api_token": _admin_token}]
    c.JupyterHub.load_roles = [{"name": "admin", "services": ["course-admin"]}]
