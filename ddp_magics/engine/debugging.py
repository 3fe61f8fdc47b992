"""A rank's side of ``%dist_debug`` (pdb post-mortem on the rank's last error) and ``%dist_diff``
(a picklable snapshot of a value to compare across ranks).

Both run on an idle rank through ordinary apply requests, so they need no channel of their own
and work on any host. A post-mortem session stays open on the rank between requests: the
notebook sends one batch of pdb commands at a time (typed at its prompt, or given with ``-c``)
and shows what pdb printed. None of these functions raises: an apply request that raises
becomes the engine's last error (``sys.last_traceback``), which is what post-mortem debugs.
"""

from __future__ import annotations

import io
import pdb
import pickle
import sys

from ddp_magics.protocol import ValueSnapshot

_session: _PostMortem | None = None


class _PostMortem(pdb.Pdb):
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
    local = tensor.to_local() if hasattr(tensor, "to_local") else tensor  # a DTensor: this rank's shard
    return local.detach().to("cpu")


def _join(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name


def _picklable(value) -> bool:
    try:
        pickle.dumps(value)
    except Exception:  # anything pickling a user object raises: it is shown by its repr
        return False
    return True
