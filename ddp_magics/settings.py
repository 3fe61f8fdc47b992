"""The magics' settings, each with its default and validated beside it: ``%config
DistributedMagics.cell_timeout = 120``. :class:`~ddp_magics.magics.DistributedMagics` is a
:class:`Settings`; the cluster is configured from them (:func:`ddp_magics.arguments.start_config`)."""

from __future__ import annotations

import os
import sys

from traitlets import Bool, Dict, Enum, Float, Integer, List, TraitError, Unicode, default, validate
from traitlets.config import Configurable

from ddp_magics import arguments
from ddp_magics.cluster.records import BACKENDS, IDLE_PARK_SECONDS, LAUNCHERS
from ddp_magics.protocol import DEFAULT_VALUES_LIMIT


def _set_by_course(variable: str) -> int | None:
    """A default the course hub's spawner sets for every learner (course/spawner.py), if set."""
    value = os.environ.get(variable, "")
    return int(value) if value.isdigit() and int(value) > 0 else None


class Settings(Configurable):
    """Defaults of %dist_start and %%distributed, and how cells are waited for and shown."""

    default_world_size = Integer(
        None,
        allow_none=True,
        config=True,
        help="Ranks %dist_start starts without -n (default: visible GPUs, else 2).",
    )
    backend = Enum(BACKENDS, "auto", config=True, help="Backend %dist_start uses without --backend.")
    cell_timeout = Float(
        60.0, config=True, help="Seconds a %%distributed cell may run before its ranks are reported."
    )
    process_group_timeout = Float(
        1800.0, config=True, help="torch.distributed timeout for collectives (seconds)."
    )
    error_grace = Float(
        5.0,
        config=True,
        help=(
            "After a rank raises, seconds to wait for the other ranks before reporting where they are "
            "(none after q at a rank's debugger prompt: it ended the cell on purpose)."
        ),
    )
    interrupt_grace = Float(
        3.0,
        config=True,
        help="Seconds interrupted ranks get to stop before being reported (during a recovery, more while "
        "their stacks show them ending or do not come: up to 30 s plus a second per rank per core).",
    )
    collapse_identical = Bool(
        True, config=True, help="Show ranks with identical output as one block ([ranks 0-3])."
    )
    max_output_lines = Integer(
        200, config=True, help="Lines kept per rank and stream; earlier ones are counted, not shown."
    )
    live_view_after = Float(
        1.0, config=True, help="Seconds after which a running cell shows its ranks' progress."
    )
    heartbeat_ms = Integer(
        1000,
        config=True,
        help="ipyparallel heartbeat period (ms); an engine silent for 3 s is dead whatever the period. "
        "New engines are confirmed at their first answer whatever the period (the controller pings a "
        "heart as it subscribes); a shorter one costs the idle cluster more CPU.",
    )
    park_idle_after = Float(
        IDLE_PARK_SECONDS,
        allow_none=True,
        config=True,
        help="Seconds a cluster on this machine may go unused before its ranks are parked (stopped: "
        "no CPU, memory and state kept; the next use continues them). None: never.",
    )
    link_loss_tolerance = Float(
        30.0,
        config=True,
        help="Seconds ranks on other hosts may go unheard (a network blip) before they count as dead "
        "(their lifeline to the kernel ends them after about 30 s without a link anyway).",
    )
    trace_values_limit = Integer(
        DEFAULT_VALUES_LIMIT,
        config=True,
        help="Traced tensors with at most this many elements keep their values.",
    )
    max_local_ranks = Integer(
        config=True,
        help="Most ranks %dist_start runs on this machine (local engines), each a Python process with torch.",
    )
    engines = Enum(
        LAUNCHERS,
        "local",
        config=True,
        help="ipyparallel engine launcher %dist_start uses without --engines: local, ssh, mpi, slurm.",
    )
    controller_ip = Unicode(
        None,
        allow_none=True,
        config=True,
        help="Address the controller listens on without --ip (default: 127.0.0.1 for local "
        "engines, else the address of this host that the hosts are reached from).",
    )
    ssh_command = List(Unicode(), ["ssh"], config=True, help="ssh command (and options) for --engines ssh.")
    remote_python = Unicode(
        config=True,
        help="Python that runs the engines on other hosts (by default this one's path).",
    )
    launcher_settings = Dict(
        config=True,
        help="ipyparallel launcher settings, by class: "
        "{'SlurmEngineSetLauncher': {'account': 'proj', 'timelimit': '1:00:00'}}.",
    )
    mpi_command = List(
        Unicode(), [], config=True, help="mpiexec command for --engines mpi (default: the mpi extra's MPICH)."
    )

    @default("default_world_size")
    def _course_world_size(self) -> int | None:
        return _set_by_course("DDP_MAGICS_DEFAULT_WORLD_SIZE")

    @default("max_local_ranks")
    def _eight_per_core(self) -> int:
        return _set_by_course("DDP_MAGICS_MAX_LOCAL_RANKS") or max(64, 8 * (os.cpu_count() or 1))

    @default("remote_python")
    def _this_python(self) -> str:
        return sys.executable

    @validate("cell_timeout", "process_group_timeout", "link_loss_tolerance")
    def _usable_timeout(self, proposal):
        return self._checked(proposal, arguments.timeout_problem(proposal.value))

    @validate("error_grace", "interrupt_grace", "live_view_after")
    def _usable_wait(self, proposal):
        return self._checked(proposal, arguments.wait_problem(proposal.value))

    @validate("park_idle_after")
    def _usable_park_time(self, proposal):
        if proposal.value is None:
            return None
        return self._checked(proposal, arguments.wait_problem(proposal.value))

    @validate(*arguments.COUNT_LIMITS)
    def _count_in_range(self, proposal):
        return self._checked(proposal, arguments.count_problem(proposal.trait.name, proposal.value))

    @staticmethod
    def _checked(proposal, problem: str | None):
        if problem:
            raise TraitError(f"DistributedMagics.{proposal.trait.name} = {proposal.value!r}: {problem}")
        return proposal.value
