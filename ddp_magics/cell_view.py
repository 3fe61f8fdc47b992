"""A cell as the user sees it: its progress in the live view, a rank's pdb answered at the
notebook's prompt (while the cell runs, or post mortem), and its outputs in rank order."""

from __future__ import annotations

import dataclasses
import html
from collections.abc import Callable, Generator

from IPython.core.error import StdinNotImplementedError
from IPython.core.getipython import get_ipython
from IPython.display import display

from ddp_magics import lab_bundle, reports
from ddp_magics.cell_run import CellOutcome, CellRun, Prompt, Tick, Waits
from ddp_magics.cluster.rank_cluster import RankCluster
from ddp_magics.cluster.records import ClusterError, DeadRanks, GroupBroken, Progress, RankOutput
from ddp_magics.errors import usage_error, ways_out
from ddp_magics.live_view import WIDGET_MIMETYPE, LiveView
from ddp_magics.output import live_html, render
from ddp_magics.protocol import rank_label

LIVE_TAIL_LINES = 12


def with_progress(magic: str, action: Callable[[Progress], object], shell) -> object:
    """``action(progress)``, showing each step it reports while it runs; a ClusterError becomes
    a one-line error naming ``magic``."""
    live = LiveView(in_kernel(shell))
    steps: list[str] = []

    def progress(message: str) -> None:
        steps.append(message)
        live.update("<br>".join(html.escape(step) for step in steps) + " …")

    try:
        return action(progress)
    except ClusterError as error:
        if isinstance(error, GroupBroken):
            advice = f". The ranks are left without a process group: {ways_out(error.ways_out)}."
        else:
            advice = f"; {ways_out(error.ways_out)}" if error.ways_out else ""
        raise usage_error(f"{magic} failed: {error}{advice}") from None
    finally:
        live.close()


def run(
    cluster: RankCluster,
    cell: str,
    ranks: list[int],
    waits: Waits,
    trace_values_limit: int | None,
    profiled: bool,
    shell,
    on_tick: Callable[[list[int], float], None] | None = None,
) -> CellOutcome:
    """Send the cell (a one-line error if it cannot be: a dead rank, tracing or profiling that
    does not start) and follow it to its outcome."""
    try:
        cell_run = CellRun(
            cluster,
            cell,
            ranks,
            cell_number(shell),
            waits,
            trace_values_limit=trace_values_limit,
            input_allowed=input_allowed(shell),
            profiled=profiled,
        )
    except DeadRanks as dead:
        raise reports.dead_ranks_error(dead.ranks) from None
    except ClusterError as error:
        raise usage_error(f"{'--profile' if profiled else '--trace/--diagram'}: {error}") from None
    return follow(cell_run.steps(), shell, on_tick)


def follow(
    steps: Generator[Tick | Prompt, str | None, CellOutcome],
    shell,
    on_tick: Callable[[list[int], float], None] | None = None,
) -> CellOutcome:
    """Show a cell's progress and answer its prompts until it ends; the stop button, wherever it
    is pressed, goes to the cell run. A widget a rank displays (a tqdm bar) is shown as it comes,
    so that it moves while the cell runs (its updates reach the notebook as they happen); the
    outcome returned leaves it out, as it is shown already."""
    live = LiveView(in_kernel(shell))
    widgets_shown: set[str] = set()
    try:
        record = next(steps)
        while True:
            try:
                if isinstance(record, Tick):
                    live.update(
                        live_html(record.outputs, set(record.pending), record.elapsed, LIVE_TAIL_LINES)
                    )
                    _show_new_widgets(record.outputs, widgets_shown)
                    if on_tick is not None:
                        on_tick(list(record.pending), record.elapsed)
                    answer = None
                else:
                    answer = ask(record)
            except KeyboardInterrupt:
                record = steps.throw(KeyboardInterrupt())
                continue
            record = steps.send(answer)
    except StopIteration as ended:
        return _without_widgets(ended.value, widgets_shown)
    finally:
        live.close()


def _widget_id(item: dict) -> str | None:
    view = item["data"].get(WIDGET_MIMETYPE)
    return view.get("model_id") if isinstance(view, dict) else None


def _show_new_widgets(outputs: list[RankOutput], shown: set[str]) -> None:
    for output in outputs:
        for item in output.displays:
            model_id = _widget_id(item)
            if model_id and model_id not in shown:
                display(item["data"], metadata=item["metadata"], raw=True)
                shown.add(model_id)


def _without_widgets(outcome: CellOutcome, shown: set[str]) -> CellOutcome:
    if not shown:
        return outcome
    outputs = [
        dataclasses.replace(output, displays=[d for d in output.displays if _widget_id(d) not in shown])
        for output in outcome.outputs
    ]
    return dataclasses.replace(outcome, outputs=outputs)


def ask(prompt: Prompt) -> str | None:
    """The line typed at the notebook's prompt for a rank stopped in pdb; None, said in one
    line, where no input can be read (nbval, nbclient)."""
    if prompt.can_answer:
        if prompt.output:
            ending = "" if prompt.output.endswith("\n") else "\n"
            print(f"[rank {prompt.rank}]\n{prompt.output}", end=ending)
        for where, ranks in prompt.others.items():
            print(f"[{rank_label(ranks)}] meanwhile {where}")
        try:
            return input(f">>> (rank {prompt.rank}) " if prompt.console else f"(Pdb rank {prompt.rank}) ")
        except (StdinNotImplementedError, OSError, EOFError):
            pass
    print(f"[rank {prompt.rank}] breakpoint() skipped: no input can be read here")
    return None


def show(outcome: CellOutcome, collapse_identical: bool, max_output_lines: int, diagram: bool) -> None:
    """The ranks' outputs in rank order, then the diagram if asked for. In a kernel, the first
    rank block also carries the rank view's record (``lab_bundle``), its text and HTML as they
    are; the outputs after it, which the rank view shows too, are marked so in their metadata."""
    items = render(outcome.outputs, collapse_identical, max_output_lines)
    shell = get_ipython()
    view = lab_bundle.rank_view(outcome, collapse_identical, max_output_lines) if items and shell else None
    for index, item in enumerate(items):
        if view is None:
            if isinstance(item, dict):
                display(item["data"], metadata=item["metadata"], raw=True)
            else:
                display(item)
            continue
        if isinstance(item, dict):
            data, metadata = item["data"], dict(item["metadata"])
        else:
            data, metadata = shell.display_formatter.format(item)
        if index == 0:
            data = {**data, lab_bundle.MIMETYPE: view}
        elif not (view["displays_below"] and isinstance(item, dict)):
            metadata = {**metadata, **lab_bundle.SHOWN_IN_RANK_VIEW}
        display(data, metadata=metadata, raw=True)
    if diagram:
        if outcome.trace.steps:
            display(outcome.trace.draw())
        else:
            print(reports.no_calls_message(outcome))
    if outcome.profile is not None:
        print(outcome.profile.text())
        if any(outcome.profile.spans.values()):
            display(outcome.profile.draw())


def post_mortem(cluster: RankCluster, rank: int, commands: str | None) -> None:
    """pdb post mortem on ``rank``: what it shows first, then the ``-c`` commands (``p x; w``), or
    what is typed at the prompt until pdb ends; pdb is closed on the rank whatever happens."""
    if commands and len(commands) > 1 and commands[0] == commands[-1] and commands[0] in "'\"":
        commands = commands[1:-1]  # IPython's argument splitting keeps the quotes
    shown = cluster.start_post_mortem(rank)
    print(f"[rank {rank}]")
    print(shown, end="")
    still_open = True
    try:
        if commands is not None:
            listed = [command.strip() for command in commands.split(";") if command.strip()]
            shown, still_open = cluster.post_mortem_commands(rank, listed)
            print(shown, end="")
            return
        while still_open:
            try:
                command = input(f"(Pdb rank {rank}) ")
            except (StdinNotImplementedError, OSError):  # no stdin (nbval, nbclient; pytest's OSError)
                print('%dist_debug: no input can be read here; give pdb commands with -c "p x; w"')
                return
            except (EOFError, KeyboardInterrupt):
                return
            shown, still_open = cluster.post_mortem_commands(rank, [command])
            print(shown, end="")
    finally:
        if still_open:
            cluster.end_post_mortem(rank)


def cell_number(shell) -> int:
    """The number the notebook shows for the cell running now (``In[N]``)."""
    running = shell.displayhook.exec_result  # set by IPython for the length of a cell
    if running is not None and running.execution_count is not None:
        return running.execution_count
    return shell.execution_count


def input_allowed(shell) -> bool:
    """Whether the front end that sent the running cell takes input (nbval and nbclient do not);
    True outside a kernel, where input() reads the terminal."""
    kernel = getattr(shell, "kernel", None)
    if kernel is None:
        return True
    return bool(kernel.get_parent("shell").get("content", {}).get("allow_stdin", False))


def in_kernel(shell) -> bool:
    return getattr(shell, "kernel", None) is not None
