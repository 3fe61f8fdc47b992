"""A one-node Slurm cluster on this machine, for tests of ipyparallel's Slurm launcher.

``OneNodeSlurm`` writes a ``slurm.conf`` into a private temporary directory (node ``localhost`` at
127.0.0.1, daemons listening there only, no cgroups, no accounting, ``auth/none`` so no munge
daemon), starts ``slurmctld`` and ``slurmd`` in the foreground, waits until the node is idle and
sets ``SLURM_CONF`` for this process (and so for ``sbatch``, ``squeue``, ``scancel``). On exit it
cancels what is still queued, stops both daemons by PID, checks that no job step (``slurmstepd``
and what it ran) is left, and removes the directory. Needs root and Debian's ``slurm-wlm``
(``make slurm`` installs it as root): ``skip_reason()`` says what is missing.
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import psutil

from tests.ports import unused_port

SLURMCTLD = "/usr/sbin/slurmctld"
SLURMD = "/usr/sbin/slurmd"
START_TIMEOUT = 20.0
# The node claims more CPUs than this machine has, so a job of several engines fits on it
# (slurmd then only logs that its hardware differs: SlurmdParameters=config_overrides).
NODE_CPUS = 8

CONFIG = """\
ClusterName=ddpmtest
SlurmctldHost=localhost
SlurmUser=root
SlurmdUser=root
AuthType=auth/none
CredType=cred/none
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
CommunicationParameters=NoInAddrAny,NoCtldInAddrAny
StateSaveLocation={tmp}/state
SlurmdSpoolDir={tmp}/spool
SlurmctldPidFile={tmp}/slurmctld.pid
SlurmdPidFile={tmp}/slurmd.pid
SlurmctldLogFile={tmp}/slurmctld.log
SlurmdLogFile={tmp}/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MpiDefault=none
SwitchType=switch/none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
ReturnToService=2
SlurmdParameters=config_overrides
MailProg=/bin/true
NodeName=localhost NodeAddr=127.0.0.1 CPUs={cpus} RealMemory=2000 State=UNKNOWN
PartitionName=debug Nodes=localhost Default=YES MaxTime=INFINITE State=UP
"""


@functools.cache
def skip_reason() -> str | None:
    if os.geteuid() != 0:
        return "the one-node Slurm test needs root (slurmd runs jobs as their user)"
    for program in (SLURMCTLD, SLURMD):
        if not Path(program).exists():
            return f"{program} missing: install Debian's slurm-wlm (make slurm does as root)"
    for program in ("sbatch", "scancel", "sinfo"):
        if shutil.which(program) is None:
            return f"{program} missing: install Debian's slurm-client (make slurm does as root)"
    return None


class OneNodeSlurm:
    def __init__(self) -> None:
        self.tmp: Path | None = None
        self.daemons: list[subprocess.Popen] = []
        self.left_at_exit: list[tuple[int, list[str]]] = []
        self._previous_conf = os.environ.get("SLURM_CONF")

    def __enter__(self) -> OneNodeSlurm:
        try:
            self._start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _start(self) -> None:
        self.tmp = tmp = Path(tempfile.mkdtemp(prefix="ddpm-slurm-"))
        (tmp / "state").mkdir()
        (tmp / "spool").mkdir()
        self.conf = tmp / "slurm.conf"
        self.conf.write_text(
            CONFIG.format(tmp=tmp, ctld_port=unused_port(), slurmd_port=unused_port(), cpus=NODE_CPUS)
        )
        os.environ["SLURM_CONF"] = str(self.conf)
        with open(tmp / "daemons.log", "ab") as log:
            controller = [SLURMCTLD, "-D", "-f", str(self.conf)]
            node = [SLURMD, "-D", "-N", "localhost", "-f", str(self.conf)]
            for argv in (controller, node):
                self.daemons.append(
                    subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)
                )
        deadline = time.monotonic() + START_TIMEOUT
        while self._node_state() != "idle":
            for daemon in self.daemons:
                if daemon.poll() is not None:
                    raise RuntimeError(f"{daemon.args[0]} exited ({daemon.returncode}):\n{self.log()}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"the Slurm node did not become idle:\n{self.log()}")
            time.sleep(0.1)

    def _node_state(self) -> str:
        answer = subprocess.run(["sinfo", "-h", "-o", "%T"], capture_output=True, text=True, timeout=10)
        return answer.stdout.strip()

    def jobs(self) -> list[str]:
        """Ids of the jobs queued or running."""
        answer = subprocess.run(["squeue", "-h", "-o", "%i"], capture_output=True, text=True, timeout=10)
        return answer.stdout.split()

    def time_limits(self) -> list[str]:
        answer = subprocess.run(["squeue", "-h", "-o", "%l"], capture_output=True, text=True, timeout=10)
        return answer.stdout.split()

    def log(self) -> str:
        if self.tmp is None:
            return ""
        parts = []
        for name in ("daemons.log", "slurmctld.log", "slurmd.log"):
            path = self.tmp / name
            if path.exists():
                parts.append(f"--- {name}\n" + path.read_text(errors="replace")[-3000:])
        return "\n".join(parts)

    def job_processes(self) -> list[psutil.Process]:
        """What slurmd started (job steps and what they run), by parentage from slurmd's PID."""
        if len(self.daemons) < 2:
            return []
        try:
            return psutil.Process(self.daemons[1].pid).children(recursive=True)
        except psutil.NoSuchProcess:
            return []

    def close(self) -> None:
        """Cancel the jobs left, stop the daemons by PID, record (and kill) any job process left."""
        if self.daemons and all(daemon.poll() is None for daemon in self.daemons):
            for job in self.jobs():
                subprocess.run(["scancel", job], capture_output=True, timeout=10)
        steps = self.job_processes()
        for process in psutil.wait_procs(steps, timeout=10)[1]:
            self.left_at_exit.append((process.pid, process.cmdline()))
            process.kill()
        for daemon in reversed(self.daemons):
            if daemon.poll() is None:
                daemon.terminate()
                try:
                    daemon.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    daemon.kill()
                    daemon.wait()
        self.daemons = []
        if self._previous_conf is None:
            os.environ.pop("SLURM_CONF", None)
        else:
            os.environ["SLURM_CONF"] = self._previous_conf
        if self.tmp is not None:
            shutil.rmtree(self.tmp, ignore_errors=True)
            self.tmp = None
