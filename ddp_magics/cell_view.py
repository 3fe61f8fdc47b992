"""A cell as the user sees it: its progress in the live view, a rank's pdb answered at the
notebook's prompt (while the cell runs, or post mortem), and its outputs in rank order."""

from __future__ import annotations

from collections.abc import Callable, Generator

from IPython.core.error import StdinNotImplementedError
from IPython.display import display

from ddp_magics.cell_run import CellOutcome, Prompt, Tick
from ddp_magics.live_view import LiveView
from ddp_magics.output import live_html, render
from ddp_magics.protocol import rank_label
from ddp_magics.reports import no_calls_message

LIVE_TAIL_LINES = 12


def follow(steps: Generator[Tick | Prompt, str | None, CellOutcome], live: LiveView) -> CellOutcome:
    """Show a cell's progress and answer its prompts until it ends; the stop button, wherever it
    is pressed, goes to the cell run."""
    try:
        record = next(steps)
        while True:
            try:
                if isinstance(record, Tick):
                    live.update(
                        live_html(record.outputs, set(record.pending), record.elapsed, LIVE_TAIL_LINES)
                    )
                    answer = None
                else:
                    answer = ask(record)
            except KeyboardInterrupt:
                record = steps.throw(KeyboardInterrupt())
                continue
            record = steps.send(answer)
    except StopIteration as ended:
        return ended.value
    finally:
        live.close()


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
    """The ranks' outputs in rank order, then the diagram if asked for."""
    for item in render(outcome.outputs, collapse_identical, max_output_lines):
        if isinstance(item, dict):
            display(item["data"], metadata=item["metadata"], raw=True)
        else:
            display(item)
    if diagram:
        if outcome.trace.steps:
            display(outcome.trace.draw())
        else:
            print(no_calls_message(outcome))


def post_mortem_dialogue(
    rank: int, run_commands: Callable[[list[str]], tuple[str, bool]], commands: str | None
):
    """Feed pdb on ``rank`` (``run_commands``: what they printed, whether pdb is still open) the
    ``-c`` commands, or what is typed at the prompt until pdb ends; whether it is still open."""
    if commands is not None:
        shown, still_open = run_commands(
            [command.strip() for command in commands.split(";") if command.strip()]
        )
        print(shown, end="")
        return still_open
    still_open = True
    while still_open:
        try:
            command = input(f"(Pdb rank {rank}) ")
        except (StdinNotImplementedError, OSError):  # no stdin (nbval, nbclient; pytest's OSError)
            print('%dist_debug: no input can be read here; give pdb commands with -c "p x; w"')
            return True
        except (EOFError, KeyboardInterrupt):
            return True
        shown, still_open = run_commands([command])
        print(shown, end="")
    return False
