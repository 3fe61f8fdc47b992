"""The magics: each parses its line, makes one call below, and shows what comes back.

Settings are the traits of :class:`DistributedMagics` (``%config DistributedMagics.cell_timeout
= 120``), validated beside them; the cluster is configured from them
(:func:`ddp_magics.arguments.start_config`).
"""

from __future__ import annotations

import atexit
import dataclasses
import re

from IPython.core.magic import Magics, cell_magic, line_magic, magics_class, no_var_expand
from IPython.core.magic_arguments import argument, magic_arguments, parse_argstring

from ddp_magics import arguments, cell_view, reports
from ddp_magics.cell_run import CellRun, Waits
from ddp_magics.cluster.rank_cluster import RankCluster
from ddp_magics.cluster.records import BACKENDS, LAUNCHERS, ClusterConfig, ClusterError, DeadRanks, Recovery
from ddp_magics.cluster.strays import stop_stray_clusters
from ddp_magics.diff import describe_differences
from ddp_magics.errors import BROKEN_ADVICE, RESTART_ADVICE, usage_error
from ddp_magics.output import StatusTable
from ddp_magics.protocol import rank_label
from ddp_magics.settings import Settings


@magics_class
class DistributedMagics(Magics, Settings):
    """Run cells on the ranks of a torch.distributed process group."""

    def __init__(self, shell=None, **kwargs) -> None:
        super().__init__(shell=shell, **kwargs)
        self.cluster: RankCluster | None = None
        self._config: ClusterConfig | None = None  # the last %dist_start's, for %dist_restart
        self._restart_failed = False  # the last %dist_restart failed, stopping the cluster
        self._last_raised: list[int] = []  # the ranks that raised in the last cell that failed
        # The last %dist_recover's: per rank, names holding a destroyed group; the ends of the
        # connections it cut (on every rank).
        self._stale: dict[int, tuple[tuple[str, str], ...]] = {}
        self._cut_peers: frozenset[str] = frozenset()

    # ------------------------------------------------------------------ lifecycle
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
            print(
                f"A cluster of {self.cluster.n} ranks ({self.cluster.backend}) is already "
                "running; use %dist_restart for new engines or %dist_stop first."
            )
            return
        config = arguments.start_config(args, self)
        self.report_strays()
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
        self._stale, self._cut_peers = {}, frozenset()
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
            self._stale, self._cut_peers = {}, frozenset()
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
            raise self._no_cluster()
        cluster = self.cluster
        done = cell_view.with_progress(
            "%dist_recover",
            lambda progress: cluster.recover(self.interrupt_grace, args.shrink, progress),
            self.shell,
        )
        if done.dropped:
            self._config = dataclasses.replace(self._config, n=done.world_size)
        self._remember_recovery(done)
        print(reports.recovery_report(done, cluster.backend))

    def _remember_recovery(self, done: Recovery) -> None:
        """What holds a destroyed group now, and which connections were cut (see reports)."""
        self._stale, self._cut_peers = done.stale, frozenset().union(*done.cut_peers.values())

    @staticmethod
    def _dead(ranks: list[int]) -> Exception:
        return usage_error(f"{rank_label(ranks)} died (engine process gone). {RESTART_ADVICE}")

    def _no_cluster(self) -> Exception:
        if self._restart_failed:
            return usage_error(
                "No cluster is running: the last %dist_restart failed and stopped it (nothing of it is "
                "left); %dist_restart starts it again as it was"
            )
        return usage_error("No cluster is running: start one with %dist_start")

    def report_strays(self) -> None:
        for report in stop_stray_clusters():
            print(f"ddp_magics: {report}.")

    # -------------------------------------------------------------------- running
    @magic_arguments()
    @argument("--ranks", default=None, help="ranks to run on, e.g. 0 or 0,2 or 1-3 (default: all)")
    @argument("--timeout", type=float, default=None, help="seconds before a hang is reported")
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
        if args.trace is not None:
            arguments.variable_name("--trace", args.trace)
        if args.profile is not None:
            arguments.variable_name("--profile", args.profile)
        timeout = arguments.timeout_or("--timeout", args.timeout, self.cell_timeout)
        cluster = self._ready_cluster(check_dead=False)  # sending the cell checks
        ranks = arguments.chosen_ranks(args.ranks, cluster.n)
        traced = args.diagram or args.trace is not None
        waits = Waits(timeout, self.error_grace, self.interrupt_grace, self.live_view_after)
        try:
            run = CellRun(
                cluster,
                cell,
                ranks,
                cell_view.cell_number(self.shell),
                waits,
                trace_values_limit=self.trace_values_limit if traced else None,
                input_allowed=cell_view.input_allowed(self.shell),
                profiled=args.profile is not None,
            )
        except DeadRanks as dead:
            raise self._dead(dead.ranks) from None
        except ClusterError as error:
            raise usage_error(f"{'--profile' if args.profile else '--trace/--diagram'}: {error}") from None
        outcome = cell_view.follow(run.steps(), self.shell)
        cell_view.show(outcome, self.collapse_identical, self.max_output_lines, args.diagram)
        if args.trace is not None:
            self.shell.user_ns[args.trace] = outcome.trace
        if args.profile is not None:
            self.shell.user_ns[args.profile] = outcome.profile
        if outcome.clean:
            return
        self._last_raised = sorted(failure.rank for failure in outcome.failures)
        error = reports.cell_error(outcome, self._stale, self._cut_peers)
        if outcome.recovery is not None:  # the ranks that waited were released
            self._remember_recovery(outcome.recovery)
        raise error

    def _ready_cluster(self, check_dead: bool = True) -> RankCluster:
        """The running cluster, if every rank can take a new cell."""
        if self.cluster is None:
            raise self._no_cluster()
        if self.cluster.broken:
            raise usage_error(
                f"The ranks are not one process group since {self.cluster.broken}. {BROKEN_ADVICE}"
            )
        dead = self.cluster.dead_ranks() if check_dead else []
        if dead:
            raise self._dead(dead)
        busy = self.cluster.busy_ranks()
        if busy:
            raise usage_error(f"{rank_label(busy)} still running an earlier cell. {RESTART_ADVICE}")
        return self.cluster

    # ----------------------------------------------------------------- inspecting
    @magic_arguments()
    @line_magic
    def dist_status(self, line: str) -> StatusTable:
        """Ranks, hosts, PIDs, devices, backend, whether each rank is alive, and its memory.

        Example::

            %dist_status
        """
        parse_argstring(self.dist_status, line)
        if self.cluster is None:
            raise self._no_cluster()
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

    # ------------------------------------------------------------------ debugging
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
            if not self._last_raised:
                raise usage_error("%dist_debug: no rank raised in the last failed cell; name one with --rank")
            rank = self._last_raised[0]
        else:
            rank = arguments.parse_rank_spec(str(args.rank), cluster.n)[0]
        try:
            cell_view.post_mortem(cluster, rank, args.commands)
        except ClusterError as error:
            raise usage_error(f"%dist_debug: {error}") from None

    @magic_arguments()
    @argument("expression", nargs="*", metavar="EXPR", help="a Python expression, evaluated on each rank")
    @argument("--ranks", default=None, help="ranks to compare, e.g. 0-1 (default: all); after EXPR")
    @no_var_expand
    @line_magic
    def dist_diff(self, line: str) -> None:
        """Evaluate EXPR on every rank (or --ranks) and show where the ranks agree and where they
        differ (tensors, numbers, containers, a module's parameters and buffers, an optimizer's
        state), each rank against the lowest. EXPR is taken as typed.

        Example::

            %dist_diff model
            %dist_diff optimizer.state_dict() --ranks 0-1
        """
        expression, options = re.fullmatch(r"\s*(.*?)((?:\s+--ranks\s+\S+)?)\s*", line, re.DOTALL).groups()
        if not expression:
            raise usage_error("%dist_diff needs an expression, e.g. %dist_diff model")
        spec = parse_argstring(self.dist_diff, options).ranks
        cluster = self._ready_cluster()
        try:
            snapshots = cluster.snapshots(arguments.chosen_ranks(spec, cluster.n), expression)
        except ClusterError as error:
            raise usage_error(f"%dist_diff {expression}: {error}") from None
        print("\n".join(describe_differences(expression, snapshots)))

    # --------------------------------------------------------------------- helpers
    def shutdown(self) -> None:
        """Stop the cluster (used by %unload_ext)."""
        self._stop_cluster()
