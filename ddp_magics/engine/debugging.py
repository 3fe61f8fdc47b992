"""A rank's side of debugging: ``breakpoint()`` in a cell (pdb whose prompt is answered in the
notebook), ``%dist_debug`` (pdb post-mortem on the rank's last error) and ``%dist_diff`` (a
picklable snapshot of a value to compare across ranks).

``breakpoint()``, ``pdb.set_trace()`` and ``torch.distributed.breakpoint()`` on a rank open
:class:`_NotebookPdb`: at each prompt it publishes what pdb printed as a data message of the
running cell (``DEBUGGER_KEY``) and waits for a line, which the notebook sends as a control
message (``DEBUGGER_INPUT_REQUEST``): the control thread answers while the main thread is in the
cell, on any host, over the cluster's own channels.

Both run on an idle rank through ordinary apply requests, so they need no channel of their own
and work on any host. A post-mortem session stays open on the rank between requests: the
notebook sends one batch of pdb commands at a time (typed at its prompt, or given with ``-c``)
and shows what pdb printed. None of these functions raises: an apply request that raises
becomes the engine's last error (``sys.last_traceback``), which is what post-mortem debugs.
"""

from __future__ import annotations

import code
import contextlib
import io
import pdb
import pickle
import queue
import sys

from ddp_magics.protocol import (
    DEBUGGER_INPUT_REQUEST,
    DEBUGGER_KEY,
    SKIP_BREAKPOINTS,
    DebuggerPrompt,
    DTensorLeaf,
    ValueSnapshot,
)

_session: _PostMortem | None = None
_lines: queue.Queue[str] = queue.Queue()  # typed lines for the rank's pdb, from the control thread
_prompts = 0  # prompts published in this cell
_skipping = False  # the notebook can read no input: this cell's breakpoints are skipped


class _CellNames:
    """pdb naming a notebook cell as tracebacks do (``Cell In[9](3)f()``), not by the file IPython
    keeps its source in (``/tmp/ipykernel_4242/2783094.py``)."""

    def format_stack_entry(self, frame_lineno, lprefix=": "):
        text = super().format_stack_entry(frame_lineno, lprefix)
        filename = self.canonic(frame_lineno[0].f_code.co_filename)
        from IPython import get_ipython

        named = get_ipython().compile.format_code_name(filename)
        return text.replace(filename, " ".join(named), 1) if named else text


def notebook_debugger_installed() -> bool:
    return sys.breakpointhook is _breakpoint


def install_notebook_debugger() -> None:
    """Once per engine: ``breakpoint()``, ``pdb.set_trace()`` and ``torch.distributed.breakpoint()``
    open a pdb answered from the notebook, and the control channel takes its lines."""
    from IPython import get_ipython

    kernel = get_ipython().kernel
    kernel.control_handlers[DEBUGGER_INPUT_REQUEST] = _take_line
    sys.breakpointhook = _breakpoint
    pdb.set_trace = _set_trace
    import torch.distributed

    # torch.distributed.breakpoint (torch 2.13) stops one rank in the pdb this function makes,
    # which reads /dev/stdin (an engine has none); the rest of it (skip, timeouts, the others'
    # barrier) stays torch's.
    torch.distributed._make_distributed_pdb = _NotebookPdb


def new_cell() -> None:
    """A cell starts: its breakpoints stop again, numbering prompts from 1."""
    global _prompts, _skipping
    _prompts, _skipping = 0, False
    while not _lines.empty():
        _lines.get_nowait()


def _take_line(stream, ident, parent) -> None:
    """The control thread's handler of ``DEBUGGER_INPUT_REQUEST``: queue the line, confirm."""
    from IPython import get_ipython

    _lines.put(parent["content"]["line"])
    kernel = get_ipython().kernel
    reply = {"status": "ok"}
    kernel.session.send(stream, "ddp_magics_debugger_input_reply", reply, parent=parent, ident=ident)


class _LineReader:
    """pdb's stdin: each line it asks for is a prompt published to the notebook."""

    def __init__(self, debugger: _NotebookPdb) -> None:
        self.debugger = debugger

    def readline(self, console: bool = False) -> str:
        global _prompts, _skipping
        if _skipping:
            return "c\n"
        from IPython import get_ipython

        _prompts += 1
        prompt = DebuggerPrompt(number=_prompts, output=self.debugger.take_output(), console=console)
        get_ipython().data_pub.publish_data({DEBUGGER_KEY: prompt})
        line = _lines.get()
        if line == SKIP_BREAKPOINTS:
            _skipping = True
            self.debugger.clear_all_breaks()
            return "c\n"
        return line + "\n"


# Modules whose frames pdb steps over: what runs a cell, not the user's code.
_MACHINERY_MODULES = [
    *("IPython.*", "ipykernel.*", "ipyparallel.*", "ddp_magics.*", "traitlets.*", "jupyter_client.*"),
    *("zmq.*", "tornado.*", "asyncio.*", "comm.*", "contextlib", "codeop", "threading", "runpy"),
]


class DebuggerQuit(Exception):
    """``q`` at a breakpoint()'s prompt: the cell ends on this rank, as if it raised there (the
    notebook knows it by its name, ``protocol.DEBUGGER_QUIT``)."""


class _NotebookPdb(_CellNames, pdb.Pdb):
    def __init__(self) -> None:
        self.output = io.StringIO()
        super().__init__(
            stdin=_LineReader(self), stdout=self.output, skip=_MACHINERY_MODULES, nosigint=True, readrc=False
        )
        self.use_rawinput = False
        self.prompt = ""  # the notebook shows its own, naming the rank

    def take_output(self) -> str:
        text = self.output.getvalue()
        self.output.seek(0)
        self.output.truncate()
        return text

    def do_quit(self, arg):
        """q(uit): end the cell on this rank (pdb's own quit raises BdbQuit, which IPython ends
        a cell on without reporting it)."""
        self.clear_all_breaks()
        self.set_continue()
        sys.settrace(None)
        raise DebuggerQuit("the debugger was quit (q)")

    do_q = do_exit = do_quit

    def do_interact(self, arg):
        """interact: a Python console in the current frame's namespace, its lines typed at the
        notebook's prompt like pdb's; exit() goes back to pdb."""
        namespace = {**self.curframe.f_globals, **self.curframe_locals}
        console = _NotebookConsole(self.stdin, namespace)
        saved_displayhook, sys.displayhook = sys.displayhook, sys.__displayhook__  # not IPython's Out[]
        try:
            with contextlib.redirect_stdout(self.output), contextlib.redirect_stderr(self.output):
                console.interact(banner="*interactive* (exit() goes back to pdb)", exitmsg="")
        finally:
            sys.displayhook = saved_displayhook


class _NotebookConsole(code.InteractiveConsole):
    """``interact``'s console: each line comes from the notebook, as pdb's do."""

    def __init__(self, reader: _LineReader, namespace: dict) -> None:
        super().__init__(namespace)
        self.reader = reader

    def raw_input(self, prompt: str = "") -> str:
        if _skipping:
            raise EOFError
        line = self.reader.readline(console=True).rstrip("\n")
        if line.strip() in ("exit()", "quit()", "exit", "quit"):
            raise EOFError
        return line


def _breakpoint(*args, **kwargs) -> None:
    if not _skipping:
        _NotebookPdb().set_trace(sys._getframe().f_back)


def _set_trace(*, header: str | None = None, **_) -> None:
    if _skipping:
        return
    debugger = _NotebookPdb()
    if header is not None:
        debugger.message(header)
    debugger.set_trace(sys._getframe().f_back)


class _PostMortem(_CellNames, pdb.Pdb):
    """pdb at a traceback, driven one command at a time, writing into a buffer."""

    def __init__(self, traceback) -> None:
        self.output = io.StringIO()
        super().__init__(stdin=io.StringIO(), stdout=self.output, nosigint=True, readrc=False)
        self.prompt = ""
        self.reset()  # as pdb.post_mortem does
        self.setup(None, traceback)
        # Start the stack at the cell: the frames of IPython running it are not the user's.
        first = next((i for i, (frame, _) in enumerate(self.stack) if not _is_machinery(frame)), 0)
        self.stack = self.stack[first:]
        self.curindex -= first
        self.print_stack_entry(self.stack[self.curindex])

    def take_output(self) -> str:
        text = self.output.getvalue()
        self.output.seek(0)
        self.output.truncate()
        return text


def _is_machinery(frame) -> bool:
    return any(part in frame.f_code.co_filename for part in _MACHINERY)


_MACHINERY = ("/IPython/", "/ipykernel/", "/ipyparallel/", "/ddp_magics/")


def start_post_mortem() -> tuple[bool, str]:
    """Open pdb at the frame where this rank's last cell raised: (True, what pdb shows first),
    or (False, why not)."""
    global _session
    traceback = getattr(sys, "last_traceback", None)
    if traceback is None:
        return False, "no cell has raised on this rank"
    end_post_mortem()
    _session = _PostMortem(traceback)
    return True, _session.take_output()


def post_mortem_commands(commands: list[str]) -> tuple[str, bool]:
    """Run pdb ``commands`` in the open session; what they printed, and whether the session is
    still open (a command that would resume the program, like ``c`` or ``q``, ends it)."""
    if _session is None:
        return "no post-mortem session is open on this rank\n", False
    for command in commands:
        try:
            resumes = _session.onecmd(command)
        except Exception as error:  # pdb reports a command's own errors; this is pdb failing
            _session.message(f"*** {type(error).__name__}: {error}")
            resumes = True
        if resumes:
            output = _session.take_output()
            end_post_mortem()
            return output, False
    return _session.take_output(), True


def end_post_mortem() -> None:
    global _session
    if _session is not None:
        _session.forget()
        _session = None


def snapshot(expression: str) -> ValueSnapshot | str:
    """``expression``, evaluated in the rank's namespace, as leaves to compare; or, if it
    raises, its error in one line."""
    from IPython import get_ipython

    try:
        value = eval(expression, get_ipython().user_ns)  # the user's own expression, on their own rank
        leaves: dict[str, object] = {}
        _add_leaves(value, "", leaves)
    except Exception as error:  # the user's expression: its error goes back as the answer
        return f"{type(error).__name__}: {error}"
    return ValueSnapshot(type_name=type(value).__name__, leaves=leaves)


def _add_leaves(value, path: str, leaves: dict[str, object]) -> None:
    import torch

    if isinstance(value, torch.nn.Module):
        for name, tensor in value.state_dict().items():
            leaves[_join(path, name)] = _cpu(tensor)
    elif isinstance(value, torch.optim.Optimizer):
        state = value.state_dict()
        for index, per_parameter in state["state"].items():
            for key, item in per_parameter.items():
                _add_leaves(item, _join(path, f"state.{index}.{key}"), leaves)
        for index, group in enumerate(state["param_groups"]):
            for key, item in group.items():
                if key != "params":
                    _add_leaves(item, _join(path, f"param_groups.{index}.{key}"), leaves)
    elif isinstance(value, torch.Tensor):
        leaves[path or "value"] = _cpu(value)
    elif isinstance(value, dict):
        for key, item in value.items():
            _add_leaves(item, _join(path, repr(key) if not isinstance(key, str) else key), leaves)
    elif isinstance(value, list | tuple):
        for index, item in enumerate(value):
            _add_leaves(item, f"{path}[{index}]", leaves)
    else:
        leaves[path or "value"] = value if _picklable(value) else repr(value)


def _cpu(tensor):
    """A CPU copy of a tensor; of a DTensor, its local tensor and its layout (no collective: the
    notebook compares what should agree)."""
    if not hasattr(tensor, "to_local") or not hasattr(tensor, "placements"):
        return tensor.detach().to("cpu")
    mesh = tensor.device_mesh
    coordinate = mesh.get_coordinate()
    return DTensorLeaf(
        tensor.to_local().detach().to("cpu"),
        tuple(tensor.shape),
        tuple(_placement(placement) for placement in tensor.placements),
        tuple(mesh.shape),
        tuple(coordinate) if coordinate is not None else None,
    )


def _placement(placement) -> str:
    """``Shard(0)``, ``Replicate()``, ``Partial(sum)`` (torch's own str is ``S(0)``, ``R``)."""
    if placement.is_shard():
        return f"Shard({placement.dim})"
    if placement.is_replicate():
        return "Replicate()"
    if placement.is_partial():
        return f"Partial({getattr(placement, 'reduce_op', 'sum')})"
    return repr(placement)


def _join(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name


def _picklable(value) -> bool:
    try:
        pickle.dumps(value)
    except Exception:  # anything pickling a user object raises: it is shown by its repr
        return False
    return True
