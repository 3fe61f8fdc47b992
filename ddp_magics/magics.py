"""The magics: each parses its line, makes one call below, and shows what comes back.

Settings are the traits of :class:`DistributedMagics` (``%config DistributedMagics.cell_timeout
= 120``), validated beside them; the cluster is configured from them
(:func:`ddp_magics.arguments.start_config`).
"""

from __future__ import annotations

import atexit
import dataclasses

from IPython.core.magic import (
    Magics,
    cell_magic,
    line_magic,
    magics_class,
    no_var_expand,
    output_can_be_silenced,
)
from IPython.core.magic_arguments import argument, kwds, magic_arguments, parse_argstring

from ddp_magics import arguments, cell_view, lab_comm, reports
from ddp_magics.cell_run import Waits
from ddp_magics.cluster.rank_cluster import RankCluster
from ddp_magics.cluster.records import BACKENDS, LAUNCHERS, ClusterConfig, ClusterError
from ddp_magics.diff import describe_differences
from ddp_magics.errors import usage_error
from ddp_magics.output import StatusTable
from ddp_magics.settings import Settings


@magics_class
class DistributedMagics(Magics, Settings):
    """Run cells on the ranks of a torch.distributed process group."""

    def __init__(self, shell=None, **kwargs) -> None:
        super().__init__(shell=shell, **kwargs)
        self.cluster: RankCluster | None = None
        self._config: ClusterConfig | None = None  # the last %dist_start's, for %dist_restart
        self._restart_failed = False  # the last %dist_restart failed, stopping the cluster
        self.last = reports.LastOutcome()  # what later cells and magics need of earlier ones
        self.channel = lab_comm.ClusterChannel(self)  # the cluster's state for JupyterLab's extension
        self.channel.open()

    @magic_arguments()
    @argument("-n", type=int, default=None, help="number of ranks (default: GPUs, else 2)")
    @argument("--backend", choices=BACKENDS, default=None, help="process group backend")
    @argument("--timeout", type=float, default=None, help="torch.distributed timeout in seconds")
    @argument(
        "--hosts",
        default=None,
        help="ranks per host, in rank order: nodeA:2,nodeB:2 ([user@]host[:ranks]; implies --engines ssh)",
    )
    @argument("--engines", choices=LAUNCHERS, default=None, help="ipyparallel engine launcher")
    @argument("--ip", default=None, help="address the controller listens on (see controller_ip)")
    @line_magic
    def dist_start(self, line: str) -> None:
        """Start a cluster whose engines are the ranks of one process group.

        Example::

            %dist_start -n 4                         # 4 CPU ranks with gloo (one per GPU with nccl)
            %dist_start --hosts nodeA:2,nodeB:2      # 2 ranks on each host, over ssh
        """
        args = parse_argstring(self.dist_start, line)
        if self.cluster is not None:
            print(reports.already_running(self.cluster))
            return
        config = arguments.start_config(args, self)
        reports.stray_clusters_stopped()
        self._start(config)

    def _start(self, config: ClusterConfig) -> None:
        cluster = RankCluster(config)
        cell_view.with_progress("%dist_start", cluster.start, self.shell)
        self._config = config
        self.cluster = cluster
        self._restart_failed = False
        atexit.register(cluster.stop)
        print(reports.start_summary(cluster))

    @magic_arguments()
    @line_magic
    def dist_stop(self, line: str) -> None:
        """Stop the cluster: controller, engines and their files.

        Example::

            %dist_stop
        """
        parse_argstring(self.dist_stop, line)
        if self.cluster is None:
            print("No cluster is running.")
            return
        world_size = self.cluster.n
        self._stop_cluster()
        self._restart_failed = False
        print(f"Stopped {world_size} ranks.")

    def _stop_cluster(self) -> None:
        cluster, self.cluster = self.cluster, None
        self.last = reports.LastOutcome()
        if cluster is not None:
            cluster.stop()
            atexit.unregister(cluster.stop)

    @magic_arguments()
    @line_magic
    def dist_restart(self, line: str) -> None:
        """New engines with the same world size, backend and rank -> device mapping (every rank's
        state is lost; %dist_recover keeps it).

        Example::

            %dist_restart
        """
        parse_argstring(self.dist_restart, line)
        if self.cluster is None and self._config is None:
            raise usage_error("No cluster to restart: start one with %dist_start")
        if self.cluster is not None and self.cluster.restartable_in_place:
            # The controller and the zygote stay: only the engines are new.
            self.last = reports.LastOutcome()
            try:
                cell_view.with_progress("%dist_restart", self.cluster.restart, self.shell)
            finally:
                if not self.cluster.running:  # the restart failed and stopped the cluster
                    self._stop_cluster()
                    self._restart_failed = True
            print(reports.start_summary(self.cluster))
            return
        if self.cluster is not None:
            self._config = dataclasses.replace(self._config, backend=self.cluster.backend)
            self._stop_cluster()
        self._start(self._config)

    @magic_arguments()
    @argument(
        "--shrink",
        action="store_true",
        help="go on without dead ranks (the others renumbered) instead of replacing them",
    )
    @line_magic
    def dist_recover(self, line: str) -> None:
        """Get every rank back after a hang or a dead rank, keeping each living rank's state: the
        old process groups are cut (ending blocked collectives), ranks still running are
        interrupted, dead ranks are replaced (or left out with --shrink), and a new default
        process group forms.

        Example::

            %dist_recover            # replace dead ranks (they start empty)
            %dist_recover --shrink   # go on without them
        """
        args = parse_argstring(self.dist_recover, line)
        if self.cluster is None:
            raise reports.no_cluster_error(self._restart_failed)
        cluster = self.cluster
        done = cell_view.with_progress(
            "%dist_recover",
            lambda progress: cluster.recover(self.interrupt_grace, args.shrink, progress),
            self.shell,
        )
        if done.dropped:
            self._config = dataclasses.replace(self._config, n=done.world_size)
        self.last = self.last.after_recovery(done)
        print(reports.recovery_report(done, cluster.backend))

    @magic_arguments()
    @arguments.ranks_option("ranks to run on, e.g. 0 or 0,2 or 1-3 (default: all)")
    @arguments.cell_timeout_option
    @argument("--diagram", action="store_true", help="draw the torch.distributed calls the cell made")
    @argument("--trace", metavar="NAME", default=None, help="keep the cell's trace in variable NAME")
    @argument("--profile", metavar="NAME", default=None, help="torch.profiler on every rank; keep it in NAME")
    @no_var_expand
    @cell_magic
    def distributed(self, line: str, cell: str) -> None:
        """Run the cell on every rank (or --ranks) and show the output in rank order.

        Example::

            %%distributed --diagram
            t = torch.ones(2) * rank
            dist.all_reduce(t)
            print(t)
        """
        args = parse_argstring(self.distributed, line)
        for option in ("trace", "profile"):
            if getattr(args, option) is not None:
                arguments.variable_name(f"--{option}", getattr(args, option))
        timeout = arguments.timeout_or("--timeout", args.timeout, self.cell_timeout)
        cluster = self._ready_cluster(check_dead=False)  # sending the cell checks
        ranks = arguments.chosen_ranks(args.ranks, cluster.n)
        waits = Waits(timeout, self.error_grace, self.interrupt_grace, self.live_view_after)
        values_limit = self.trace_values_limit if args.diagram or args.trace is not None else None
        profiled = args.profile is not None
        self.channel.cell_started(cell)
        outcome = cell_view.run(
            cluster, cell, ranks, waits, values_limit, profiled, self.shell, on_tick=self.channel.tick
        )
        self.channel.cell_ended(outcome)
        cell_view.show(outcome, self.collapse_identical, self.max_output_lines, args.diagram)
        if args.trace is not None:
            self.shell.user_ns[args.trace] = outcome.trace
        if args.profile is not None:
            self.shell.user_ns[args.profile] = outcome.profile
        if outcome.clean:
            return
        error = reports.cell_error(outcome, self.last)
        self.last = self.last.after_failed_cell(outcome)
        raise error

    def _ready_cluster(self, check_dead: bool = True) -> RankCluster:
        """The running cluster, if every rank can take a new cell."""
        if self.cluster is None:
            raise reports.no_cluster_error(self._restart_failed)
        if self.cluster.broken:
            raise reports.broken_error(self.cluster.broken)
        dead = self.cluster.dead_ranks() if check_dead else []
        if dead:
            raise reports.dead_ranks_error(dead)
        busy = self.cluster.busy_ranks()
        if busy:
            raise reports.busy_error(busy)
        return self.cluster

    @magic_arguments()
    @output_can_be_silenced
    @line_magic
    def dist_status(self, line: str) -> StatusTable:
        """Ranks, hosts, PIDs, devices, backend, whether each rank is alive, and its memory.

        Example::

            %dist_status
        """
        parse_argstring(self.dist_status, line)
        if self.cluster is None:
            raise reports.no_cluster_error(self._restart_failed)
        busy = self.cluster.busy_ranks()
        memory = self.cluster.memory(busy)
        return StatusTable(self.cluster.backend, self.cluster.status(), busy, memory)

    @magic_arguments()
    @argument("names", nargs="+", metavar="NAME", help="notebook variables to copy")
    @line_magic
    def dist_push(self, line: str) -> None:
        """Copy notebook variables to every rank.

        Example::

            learning_rate = 0.1
            %dist_push learning_rate
        """
        names = parse_argstring(self.dist_push, line).names
        missing = [name for name in names if name not in self.shell.user_ns]
        if missing:
            raise usage_error(f"%dist_push: not defined in the notebook: {', '.join(missing)}")
        self._ready_cluster().push({name: self.shell.user_ns[name] for name in names})

    @magic_arguments()
    @argument("name", metavar="NAME", help="the variable to read on every rank")
    @output_can_be_silenced
    @line_magic
    def dist_pull(self, line: str) -> dict:
        """Every rank's value of a variable, as ``{rank: value}``.

        Example::

            values = %dist_pull loss
        """
        name = arguments.variable_name("%dist_pull", parse_argstring(self.dist_pull, line).name)
        cluster = self._ready_cluster()
        try:
            return cluster.pull(name)
        except ClusterError as error:
            raise usage_error(f"%dist_pull: {error}") from None

    @magic_arguments()
    @argument("--rank", type=int, default=None, help="the rank to debug (default: the lowest that raised)")
    @argument("-c", dest="commands", default=None, help="pdb commands separated by ';', run without a prompt")
    @no_var_expand
    @line_magic
    def dist_debug(self, line: str) -> None:
        """pdb post-mortem on a rank where the last failed cell raised, like IPython's %debug:
        at a prompt answered in the notebook, or running ``-c`` commands.

        Example::

            %dist_debug                       # at a (Pdb rank R) prompt
            %dist_debug --rank 1 -c "p x; w"  # commands, no prompt
        """
        args = parse_argstring(self.dist_debug, line)
        cluster = self._ready_cluster()
        if args.rank is None:
            if not self.last.raised:
                raise usage_error("%dist_debug: no rank raised in the last failed cell; name one with --rank")
            rank = self.last.raised[0]
        else:
            rank = arguments.parse_rank_spec(str(args.rank), cluster.n)[0]
        try:
            cell_view.post_mortem(cluster, rank, args.commands)
        except ClusterError as error:
            raise usage_error(f"%dist_debug: {error}") from None

    @magic_arguments()
    @arguments.ranks_option("ranks to compare, e.g. 0-1 (default: all)")
    @kwds(epilog="The rest of the line is EXPR, a Python expression evaluated on each rank, as typed.")
    @no_var_expand
    @line_magic
    def dist_diff(self, line: str) -> None:
        """Evaluate EXPR on every rank (or --ranks) and show where the ranks agree and where they
        differ (tensors, numbers, containers, a module's parameters and buffers, an optimizer's
        state), each rank against the lowest. Options first, as %debug takes them (after EXPR
        also works); EXPR is the rest of the line, as typed.

        Example::

            %dist_diff model
            %dist_diff --ranks 0-1 optimizer.state_dict()
        """
        spec = parse_argstring(self.dist_diff, line, partial=True)[0].ranks
        expression = arguments.without_ranks_option(line)
        if not expression:
            raise usage_error("%dist_diff needs an expression, e.g. %dist_diff model")
        cluster = self._ready_cluster()
        try:
            snapshots = cluster.snapshots(arguments.chosen_ranks(spec, cluster.n), expression)
        except ClusterError as error:
            raise usage_error(f"%dist_diff {expression}: {error}") from None
        print("\n".join(describe_differences(expression, snapshots)))

    def shutdown(self) -> None:
        """Stop the cluster (used by %unload_ext)."""
        self._stop_cluster()
        self.channel.close()
