"""%dist_diff (where ranks' values agree and differ) and %dist_debug (pdb post-mortem on a rank
that raised), on the real 2-rank gloo cluster."""

from __future__ import annotations

import re
import time

import pytest
from IPython.core.error import UsageError
from IPython.utils.capture import capture_output

from ddp_magics.errors import DistributedCellError
from tests.conftest import assert_gone, run_cell, start_kernel_with_cluster


def line_magic(ip, name: str, line: str) -> str:
    with capture_output() as captured:
        ip.run_line_magic(name, line)
    return captured.stdout


SET_UP = """\
import torch.nn as nn
torch.manual_seed(0)
model = nn.Linear(3, 2)
if rank == 1:
    with torch.no_grad():
        model.weight[1, 2] += 0.5
same = torch.arange(4.0)
scaled = torch.arange(4.0) * (1 + rank)
shapes = torch.zeros(2 + rank)
settings = {'lr': 0.1, 'steps': [10, 10 + rank]}
"""


def test_diff_shows_where_ranks_agree_and_differ(ip, healthy):
    _, error = run_cell(ip, "", SET_UP)
    assert error is None
    assert line_magic(ip, "dist_diff", "model") == (
        "model (Linear) on ranks 0,1, each compared with rank 0:\n"
        "  weight  tensor (2, 3) float32  differs (rank 1: max |a-b| 0.5, first at [1, 2])\n"
        "  bias    tensor (2,) float32  equal\n"
        "1 of 2 entries differ.\n"
    )
    assert line_magic(ip, "dist_diff", "same") == (
        "same (Tensor) on ranks 0,1, each compared with rank 0:\n  value  tensor (4,) float32  equal\n"
    )
    assert "differs (rank 1: max |a-b| 3, first at [1])" in line_magic(ip, "dist_diff", "scaled")
    assert "shape differs on rank 1: rank 1 (3,)" in line_magic(ip, "dist_diff", "shapes")
    settings_report = (
        "settings (dict) on ranks 0,1, each compared with rank 0:\n"
        "  lr        equal: 0.1\n"
        "  steps[0]  equal: 10\n"
        "  steps[1]  differs on rank 1: rank 0 10, rank 1 11\n"
        "1 of 3 entries differ.\n"
    )
    # Options first, as %debug takes them; after EXPR too.
    assert line_magic(ip, "dist_diff", "--ranks 0-1 settings") == settings_report
    assert line_magic(ip, "dist_diff", "settings --ranks 0-1") == settings_report
    assert line_magic(ip, "dist_diff", "--ranks=0-1 settings") == settings_report
    optimizer = "opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)\n"
    optimizer += "model(torch.ones(1, 3)).sum().backward()\nopt.step()"
    assert run_cell(ip, "", optimizer)[1] is None
    shown = line_magic(ip, "dist_diff", "opt")
    assert re.search(r"\n  state\.0\.momentum_buffer +tensor \(2, 3\) float32  equal\n", shown), shown
    assert "param_groups.0.lr" in shown and "All entries equal." in shown


def test_diff_of_an_expression_that_raises_is_one_line(ip, healthy):
    with pytest.raises(UsageError) as refused:
        ip.run_line_magic("dist_diff", "no_such_name + 1")
    assert (
        str(refused.value)
        == "%dist_diff no_such_name + 1: rank 0: NameError: name 'no_such_name' is not defined"
    )
    with pytest.raises(UsageError, match="needs an expression"):
        ip.run_line_magic("dist_diff", "")


def test_post_mortem_on_the_rank_that_raised_with_its_locals(ip, healthy):
    cell = "def f(x):\n    y = x * 2\n    return y / (x - 1)\nresult = f(rank)"
    _, error = run_cell(ip, "", cell)
    assert (
        isinstance(error, DistributedCellError)
        and str(error) == "rank 1 raised ZeroDivisionError: division by zero"
    )
    ip.run_line_magic("dist_diff", "rank")  # a request between the two is not what is debugged
    shown = line_magic(ip, "dist_debug", "-c \"p x, y; u; p result if 'result' in dir() else None; q\"")
    lines = shown.splitlines()
    assert lines[0] == "[rank 1]"
    assert lines[1].endswith("(3)f()") and lines[2] == "-> return y / (x - 1)"
    assert "(1, 2)" in lines
    up = next(i for i, line in enumerate(lines) if line.endswith("(4)<module>()"))
    assert lines[up + 1 :] == ["-> result = f(rank)", "None"], shown  # up in the cell: no result yet
    # The frames of IPython running the cell are left out of the stack.
    assert "interactiveshell.py" not in line_magic(ip, "dist_debug", '-c "w"')


def test_post_mortem_on_a_rank_that_never_raised_says_so(ip, healthy):
    with pytest.raises(UsageError) as refused:
        ip.run_line_magic("dist_debug", "--rank 0")
    assert str(refused.value) == "%dist_debug: rank 0: no cell has raised on this rank"


def test_post_mortem_without_input_ends_at_once(ip, healthy):
    """No stdin (as under nbval; pytest's here): one line says how to give commands instead."""
    _, error = run_cell(ip, "--ranks 1", "raise ValueError('look here')")
    assert isinstance(error, DistributedCellError)
    shown = line_magic(ip, "dist_debug", "")
    assert shown.startswith("[rank 1]\n> ") and "raise ValueError('look here')" in shown
    assert shown.endswith('%dist_debug: no input can be read here; give pdb commands with -c "p x; w"\n')


def test_post_mortem_prompt_is_answered_in_the_front_end():
    """In a real kernel, the prompt is the front end's input box (an input_request): ``p y``
    shows the local of rank 1's failing frame, ``q`` ends the session."""
    manager, client, processes, _ = start_kernel_with_cluster(2)
    try:
        failing = "%%distributed\ndef f(x):\n    y = x + 40\n    return y / 0\nf(rank)"
        assert client.execute_interactive(failing, timeout=60)["content"]["status"] == "error"
        answers = iter(["p y", "q"])
        prompts, outputs = [], []

        def answer(message):
            prompts.append(message["content"]["prompt"])
            client.input(next(answers))

        reply = client.execute_interactive(
            "%dist_debug --rank 1",
            timeout=60,
            allow_stdin=True,
            stdin_hook=answer,
            output_hook=outputs.append,
        )
        assert reply["content"]["status"] == "ok"
        assert prompts == ["(Pdb rank 1) ", "(Pdb rank 1) "]
        text = "".join(m["content"]["text"] for m in outputs if m["msg_type"] == "stream")
        assert text.splitlines()[0] == "[rank 1]" and "41" in text.splitlines()
    finally:
        client.stop_channels()
        manager.shutdown_kernel(now=True)
    assert_gone(processes)


KERNEL_MANAGERS = {}  # kernel4's client -> its manager (for the stop button)


@pytest.fixture(scope="module")
def kernel4():
    """A real kernel with 4 ranks, whose prompts a test answers as a front end would."""
    manager, client, processes, _ = start_kernel_with_cluster(4)
    KERNEL_MANAGERS[client] = manager
    yield client
    client.stop_channels()
    manager.shutdown_kernel(now=True)
    assert_gone(processes)


def run_with_answers(client, cell: str, answers: list[str], delay: float = 0.0, allow_stdin: bool = True):
    """Run ``cell``, answering each input request with the next of ``answers`` (after ``delay``
    seconds); (status, prompts, shown text with any error report, error line)."""
    pending = iter(answers)
    prompts, outputs = [], []

    def answer(message):
        prompts.append(message["content"]["prompt"])
        time.sleep(delay)
        client.input(next(pending))

    reply = client.execute_interactive(
        cell, timeout=60, allow_stdin=allow_stdin, stdin_hook=answer, output_hook=outputs.append
    )
    text = ""
    for message in outputs:
        if message["msg_type"] == "stream":
            text += message["content"]["text"]
        elif message["msg_type"] == "display_data":
            text += message["content"]["data"].get("text/plain", "") + "\n"
        elif message["msg_type"] == "error":  # the report the front end shows
            text += "\n".join(message["content"]["traceback"]) + "\n"
    error = reply["content"].get("evalue") if reply["content"]["status"] == "error" else None
    return reply["content"]["status"], prompts, text, error


STEP = """\
%%distributed --timeout 2
def step(x):
    y = x * 10
    if rank in STOPPING:
        breakpoint()
    z = y + 1
    return z
t = torch.tensor([float(step(rank))])
dist.all_reduce(t)
print(rank, t.item())
"""


def test_breakpoint_on_one_rank_is_answered_in_the_front_end(kernel4):
    """p of a local, n, p, c; the others wait in all_reduce; 3 s at the prompt are not a hang
    (the cell's timeout is 2 s)."""
    kernel4.execute_interactive("%%distributed\nSTOPPING = {1}", timeout=30)
    status, prompts, text, _ = run_with_answers(kernel4, STEP, ["p y", "n", "n", "p z", "c"], delay=0.6)
    assert status == "ok", text
    assert prompts == ["(Pdb rank 1) "] * 5
    assert "[rank 1]\n10\n" in text and "[rank 1]\n11\n" in text
    assert "-> z = y + 1" in text
    # Where the others were as rank 1 stopped (in all_reduce, or on their way to it).
    meanwhile = re.findall(r"^\[ranks? ([\d,-]+)\] meanwhile (.+)$", text, re.MULTILINE)
    assert sorted(r for ranks, _ in meanwhile for r in map(int, re.split("[,-]", ranks))) == [0, 2, 3], text
    for rank in range(4):
        assert f"[rank {rank}]\n{rank} 64.0" in text


def test_two_ranks_stopping_are_served_in_rank_order(kernel4):
    kernel4.execute_interactive("%%distributed\nSTOPPING = {0, 2}", timeout=30)  # rank 0 too
    status, prompts, text, _ = run_with_answers(kernel4, STEP, ["p rank", "c", "p rank", "c"])
    assert status == "ok", text
    assert prompts == ["(Pdb rank 0) ", "(Pdb rank 0) ", "(Pdb rank 2) ", "(Pdb rank 2) "]
    assert text.index("[rank 0]\n0\n") < text.index("[rank 2]\n2\n")


def test_interact_is_a_console_typed_at_the_notebook_prompt(kernel4):
    kernel4.execute_interactive("%%distributed\nSTOPPING = {1}", timeout=30)
    answers = ["interact", "y * 3", "w = y + 2", "exit()", "p w", "c"]
    status, prompts, text, _ = run_with_answers(kernel4, STEP, answers)
    assert status == "ok", text
    assert prompts == [
        "(Pdb rank 1) ",
        ">>> (rank 1) ",
        ">>> (rank 1) ",
        ">>> (rank 1) ",
        "(Pdb rank 1) ",
        "(Pdb rank 1) ",
    ]
    assert "*interactive* (exit() goes back to pdb)" in text and "\n30\n" in text
    assert "*** NameError: name 'w' is not defined" in text  # the console's names stay in the console


def test_q_ends_the_cell_on_that_rank_in_one_line(kernel4):
    cell = "%%distributed\nif rank == 1:\n    breakpoint()\nprint('after', rank)"
    status, prompts, text, error = run_with_answers(kernel4, cell, ["q"])
    assert status == "error" and prompts == ["(Pdb rank 1) "]
    assert error == "rank 1 raised DebuggerQuit: the debugger was quit (q)"
    assert "[rank 0]\nafter 0" in text and "after 1" not in text


def test_the_stop_button_at_a_prompt_ends_debugging_and_the_cell(kernel4):
    """Interrupting the kernel at rank 1's prompt quits its pdb (the cell ends there) and interrupts
    the others; the ranks left in all_reduce are released, and the next cell runs at once."""
    kernel4.execute_interactive("%%distributed\nSTOPPING = {1}", timeout=30)
    prompts = []

    def stop_button(message):
        prompts.append(message["content"]["prompt"])
        KERNEL_MANAGERS[kernel4].interrupt_kernel()

    reply = kernel4.execute_interactive(STEP, timeout=60, allow_stdin=True, stdin_hook=stop_button)
    assert prompts == ["(Pdb rank 1) "]
    assert reply["content"]["status"] == "error"
    assert "rank 1 raised DebuggerQuit: the debugger was quit (q)" in reply["content"]["evalue"]
    assert (
        "ranks 0,2,3 were waiting in all_reduce at cell line 8 and were released"
        in reply["content"]["evalue"]
    )
    check = "%%distributed\nt = torch.ones(1)\ndist.all_reduce(t)\nprint(t.item())"
    status, _, text, _ = run_with_answers(kernel4, check, [])
    assert status == "ok" and "[ranks 0-3]\n4.0" in text, text


def test_without_input_a_breakpoint_is_skipped_with_one_line(kernel4):
    """As under nbval or nbclient: nothing waits for input that cannot come."""
    kernel4.execute_interactive("%%distributed\nSTOPPING = {1, 2}", timeout=30)
    status, prompts, text, _ = run_with_answers(kernel4, STEP, [], allow_stdin=False)
    assert status == "ok" and prompts == []
    assert "[rank 1] breakpoint() skipped: no input can be read here" in text
    assert "[rank 2] breakpoint() skipped: no input can be read here" in text
    assert "[rank 3]\n3 64.0" in text


def test_torch_distributed_breakpoint_stops_the_chosen_rank(kernel4):
    cell = "%%distributed\nx = rank + 100\ndist.breakpoint(rank=2)\nprint('past', rank)"
    status, prompts, text, _ = run_with_answers(kernel4, cell, ["up", "p x", "c"])
    assert status == "ok", text
    assert prompts == ["(Pdb rank 2) "] * 3
    assert "Type 'up' to get to the frame that called dist.breakpoint(rank=2)" in text
    assert "[rank 2]\n102\n" in text and "past 3" in text


def test_code_in_a_magic_line_reaches_the_ranks_as_typed(ip, healthy):
    """IPython fills ``{x}`` and ``$x`` in a magic's line from the notebook's namespace unless the
    magic opts out (as %debug, %timeit and %px do): %dist_diff and %dist_debug take code for the
    ranks, which must see what was typed."""
    ip.user_ns["x"] = "notebook_value"
    _, error = run_cell(ip, "", "x = 10 * (rank + 1)")
    assert error is None
    shown = line_magic(ip, "dist_diff", "{x}")
    assert shown.startswith("{x} (set) on ranks 0,1"), shown
    with pytest.raises(UsageError) as refused:
        ip.run_line_magic("dist_diff", "$x + 1")
    assert str(refused.value).startswith("%dist_diff $x + 1: rank 0: SyntaxError"), str(refused.value)
    _, error = run_cell(ip, "--ranks 1", "x = 7\nraise ValueError('look here')")
    assert isinstance(error, DistributedCellError)
    shown = line_magic(ip, "dist_debug", """-c "p {x}, '$x'" """)
    assert "({7}, '$x')" in shown.splitlines(), shown


def front_end_view(messages: list[dict]) -> list[str]:
    """What a notebook shows of a cell at its end, from its iopub messages as JupyterLab applies
    them: ``clear_output`` (at once, or with ``wait`` at the next output), displays updated in
    place by their id; each output as text (a widget view as ``widget:<model id>``)."""
    shown: list[tuple[str | None, str]] = []
    clear_at_next = False
    for message in messages:
        kind, content = message["msg_type"], message["content"]
        if kind == "clear_output":
            if content.get("wait"):
                clear_at_next = True
            else:
                shown.clear()
            continue
        if kind not in ("stream", "display_data", "update_display_data", "error", "execute_result"):
            continue
        if clear_at_next:
            shown.clear()
            clear_at_next = False
        if kind == "stream":
            text = content["text"]
        elif kind == "error":
            text = "\n".join(content["traceback"])
        else:
            data = content["data"]
            view = data.get("application/vnd.jupyter.widget-view+json")
            text = f"widget:{view['model_id']}" if view else data.get("text/plain", "")
        display_id = content.get("transient", {}).get("display_id")
        if kind == "update_display_data":
            shown = [(shown_id, text if shown_id == display_id else old) for shown_id, old in shown]
        else:
            shown.append((display_id, text))
    return [text for _, text in shown]


def test_the_pdb_dialogue_stays_above_the_error_and_the_live_view_goes(kernel4):
    """The live view is hidden in place as the cell ends (no clear_output, which took the
    dialogue printed meanwhile with it)."""
    kernel4.execute_interactive("%config DistributedMagics.live_view_after = 0", timeout=30)
    try:
        cell = "%%distributed\nimport time\ntime.sleep(1)\nif rank == 1:\n    breakpoint()\ndist.barrier()"
        messages = []
        prompts = iter(["p rank * 100", "q"])
        reply = kernel4.execute_interactive(
            cell,
            timeout=60,
            allow_stdin=True,
            stdin_hook=lambda message: kernel4.input(next(prompts)),
            output_hook=messages.append,
        )
    finally:
        kernel4.execute_interactive("%config DistributedMagics.live_view_after = 1.0", timeout=30)
    assert reply["content"]["status"] == "error"
    widget = "application/vnd.jupyter.widget-view+json"
    live_views = [
        m["content"]["data"][widget]["model_id"]
        for m in messages
        if m["msg_type"] == "display_data" and widget in m["content"]["data"]
    ]
    assert live_views and all(live_views), "the live view was never shown"
    shown = front_end_view(messages)
    text = "\n".join(shown)
    assert "[rank 1]\n100\n" in text, shown
    assert text.index("[rank 1]\n100\n") < text.index("DistributedCellError"), shown
    assert [t for t in shown if t.startswith("widget:")] == ["widget:"], shown  # hidden in place
