"""The course hub's spawner: JupyterHub's ``LocalProcessSpawner`` (a learner's server runs as
that learner's Unix user) with what a course needs before the server starts:

- the learner's home made private (owned by the learner, mode 0700), whatever ``useradd`` made
  it: notebooks and IPython's history (``~/.ipython/profile_default/history.sqlite``) are then
  the learner's alone, and the server runs with umask 077;
- the lessons copied into ``~/<lessons_folder>/`` (a lesson already there is left as it is: it
  may hold the learner's work);
- the limits the instructor sets once in the hub's config: ``ranks_per_learner`` (what
  ``%dist_start`` starts without ``-n``), ``max_local_ranks`` and ``mem_limit``. The memory
  limit is a memory cgroup per learner under the hub's own (cgroup v1 or v2), so the learner's
  server, kernels and ranks share it and one learner cannot exhaust the machine; where cgroups
  cannot be written, the hub logs that the limit is not enforced.
"""

from __future__ import annotations

import os
import pwd
import shutil
from pathlib import Path

from jupyterhub.spawner import LocalProcessSpawner
from traitlets import Integer, Unicode

CGROUP_ROOT = Path("/sys/fs/cgroup")


def _own_memory_cgroup() -> Path | None:
    """The memory cgroup this process is in, as a writable directory, or None."""
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(","):
            where = CGROUP_ROOT / "memory" / path.lstrip("/")  # cgroup v1
            break
    else:
        path = next(
            (line.split(":", 2)[2] for line in Path("/proc/self/cgroup").read_text().splitlines()
             if line.startswith("0::")),
            None,
        )
        if path is None or not (CGROUP_ROOT / "cgroup.controllers").exists():
            return None
        where = CGROUP_ROOT / path.lstrip("/")  # cgroup v2
    return where if os.access(where, os.W_OK) else None


class CourseSpawner(LocalProcessSpawner):
    lessons_dir = Unicode(
        str(Path(__file__).resolve().parent.parent / "notebooks"),
        config=True,
        help="The lessons copied into each learner's home.",
    )
    lessons_folder = Unicode("lessons", config=True, help="Folder in the learner's home the lessons go to.")
    ranks_per_learner = Integer(
        4, config=True, help="Ranks %dist_start starts without -n (DistributedMagics.default_world_size)."
    )
    max_local_ranks = Integer(
        4, config=True, help="Most ranks %dist_start runs (DistributedMagics.max_local_ranks)."
    )

    zygote_preload = Unicode(
        "torch._dynamo",
        config=True,
        help="Modules each learner's zygote imports once for all its ranks (comma-separated): "
        "torch._dynamo, which every rank imports as it makes its first DistributedDataParallel.",
    )

    def get_env(self):
        env = super().get_env()
        if self.zygote_preload:
            env["DDP_MAGICS_ZYGOTE_PRELOAD"] = self.zygote_preload
        env["DDP_MAGICS_DEFAULT_WORLD_SIZE"] = str(self.ranks_per_learner)
        env["DDP_MAGICS_MAX_LOCAL_RANKS"] = str(self.max_local_ranks)
        return env

    def make_preexec_fn(self, name):
        set_user = super().make_preexec_fn(name)
        procs = self._memory_cgroup(create=False)

        def preexec() -> None:
            if procs is not None:  # before the uid changes: the learner cannot leave it
                (procs / "cgroup.procs").write_text("0\n")
            os.umask(0o077)
            set_user()

        return preexec

    async def start(self):
        self._prepare_home()
        self._memory_cgroup(create=True)
        return await super().start()

    async def stop(self, now=False):
        await super().stop(now=now)
        cgroup = self._memory_cgroup(create=False)
        if cgroup is not None:
            try:
                cgroup.rmdir()
            except OSError as error:  # a process of the learner's still in it
                self.log.warning("memory cgroup %s not removed: %s", cgroup, error)

    def _prepare_home(self) -> None:
        user = pwd.getpwnam(self.user.name)
        home = Path(user.pw_dir)
        if not home.is_dir():
            raise RuntimeError(f"learner {self.user.name} has no home directory {home}")
        if home.is_symlink() or home.stat().st_uid != user.pw_uid:
            raise RuntimeError(f"{home} is not a directory owned by {self.user.name}")
        home.chmod(0o700)
        lessons = home / self.lessons_folder
        if not lessons.exists():
            lessons.mkdir(mode=0o700)
            os.chown(lessons, user.pw_uid, user.pw_gid)
        for lesson in sorted(Path(self.lessons_dir).glob("*.ipynb")):
            copy = lessons / lesson.name
            if not copy.exists():
                shutil.copyfile(lesson, copy)
                copy.chmod(0o600)
                os.chown(copy, user.pw_uid, user.pw_gid)

    def _memory_cgroup(self, create: bool) -> Path | None:
        if not self.mem_limit:
            return None
        parent = _own_memory_cgroup()
        if parent is None:
            if create:
                self.log.warning("mem_limit for %s not enforced: no writable memory cgroup", self.user.name)
            return None
        cgroup = parent / f"ddp-course-{self.user.name}"
        if create:
            cgroup.mkdir(exist_ok=True)
            if (cgroup / "memory.max").exists():
                (cgroup / "memory.max").write_text(f"{self.mem_limit}\n")
            else:
                (cgroup / "memory.limit_in_bytes").write_text(f"{self.mem_limit}\n")
        return cgroup if cgroup.is_dir() else None
