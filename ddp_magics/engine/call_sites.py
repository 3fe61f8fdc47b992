"""Where a traced call comes from, read from its Python frames: the library or helper that made
it (``DDP bucket 0``, ``DTensor``, ``broadcast_object_list``), the torch.distributed function it
went through and the line of the cell that led to it (``loss.backward()``)."""

from __future__ import annotations

import sys
import threading
from typing import NamedTuple

from ddp_magics.engine.c10d_ops import C10dOp
from ddp_magics.protocol import OPS

# Libraries that make calls, by the module their code is in: the outermost one on the stack
# names the maker (DTensor calls the functional collectives, FSDP calls DTensor).
MAKERS = (
    ("torch.nn.parallel.distributed", "DDP"),
    ("torch.distributed.fsdp", "FSDP"),
    ("torch.distributed.tensor", "DTensor"),
    ("torch.distributed.pipelining", "pipelining"),
    ("torch.distributed.optim", "ZeroRedundancyOptimizer"),
    ("torch.distributed.checkpoint", "distributed checkpoint"),
    ("torch.distributed.algorithms", "DDP communication hook"),
    ("torch.distributed._functional_collectives", "functional collectives"),
    ("torch.distributed.device_mesh", "DeviceMesh"),
)
# Installed packages whose frames never name a call's maker: torch itself, what runs a cell, and
# decorators' wrappers that run between a caller and the call (torch 2.13 marks
# all_gather_into_tensor and reduce_scatter_tensor with typing_extensions.deprecated).
NOT_LIBRARIES = frozenset(
    {"torch", "IPython", "ipykernel", "ipyparallel", "ddp_magics", "traitlets", "tornado", "zmq"}
    | {"typing_extensions", "wrapt", "decorator", "deprecated"}
)
# Modules under the makers' that only watch calls, as this tracer does.
OBSERVERS = ("torch.distributed.tensor.debug",)
DDP_PHASES = {"__init__": "DDP construction", "forward": "DDP forward"}
# Makers that own their calls (another library using them is not named): the rest of torch's
# (DTensor, the helpers) are named with the installed library whose frame used them, if any.
TRAINING_LIBRARIES = frozenset(
    {
        "DDP",
        *DDP_PHASES.values(),
        "FSDP",
        "pipelining",
        "ZeroRedundancyOptimizer",
        "distributed checkpoint",
        "DDP communication hook",
    }
)
_API_MODULE = "torch.distributed.distributed_c10d"
_AUTOGRAD_MODULE = "torch.autograd"


class CallSites:
    """What the frames of a cell's calls say, and the DDP buckets each backward pass reduced."""

    def __init__(self, torch) -> None:
        self._torch = torch
        self._sites: dict[tuple, tuple[list, CallSite]] = {}  # code path -> what its frames say
        self._buckets: dict[int, int] = {}  # backward pass -> DDP buckets reduced so far
        self._main_thread = threading.main_thread()

    def find(self, caller) -> tuple[list, CallSite]:
        """The frames from ``caller`` to the cell's, and what they say about the call: the same
        for every call made along the same code path, so worked out once per path and cell."""
        frames, in_cell = _frames_of_the_cell(caller, self._main_thread)
        key = (in_cell, *[id(frame.f_code) for frame in frames])
        known = self._sites.get(key)
        if known is None:
            # The code objects are kept with the entry so that their ids are not reused.
            known = self._sites[key] = ([frame.f_code for frame in frames], _call_site(frames, in_cell))
        return frames, known[1]

    def maker(self, site: CallSite, spec: C10dOp, frames: list, count: bool = True) -> str | None:
        """Who made the call, if not the cell through torch.distributed's functions. ``count``:
        a DDP bucket's call is counted as its backward pass's next one. A call that an installed
        library made (transformers' tensor-parallel plan, accelerate) is named by that library's
        frame (``transformers/distributed/tensor_parallel.py:297``), also when it went through
        torch's own means (``DTensor from transformers/...:354``, ``broadcast_object_list from
        accelerate/...``); a training library of torch's (DDP, FSDP) is named as itself."""
        if site.maker is None and site.from_engine and spec.op == "all_reduce":
            # No Python between the autograd engine and the call: DDP's reducer, which reduces
            # its buckets in order, one all_reduce each, in every backward pass. (torch has no
            # public name for "this backward pass".)
            graph_task = self._torch._C._current_graph_task_id()
            bucket = self._buckets.get(graph_task, 0)
            if count:
                self._buckets[graph_task] = bucket + 1
            return f"DDP bucket {bucket}"
        if site.library_frame is not None and site.maker not in TRAINING_LIBRARIES:
            frame = frames[site.library_frame]
            where = f"{_roles[frame.f_code][3]}:{frame.f_lineno}"
            return where if site.maker is None else f"{site.maker} from {where}"
        return site.maker

    def forget_paths(self) -> None:
        """Let go of the code objects kept for the cell's code paths."""
        self._sites.clear()


def _frames_of_the_cell(frame, main_thread: threading.Thread) -> tuple[list, bool]:
    """The Python frames from ``frame`` (the caller of a traced op) up to the cell's own frame,
    innermost first, and whether the cell's frame was found. On a thread without the cell (the
    autograd engine's, for CUDA tensors), the frames of the main thread, which waits in the
    cell's ``backward()``."""
    frames = []
    while frame is not None:
        frames.append(frame)
        back = frame.f_back
        if back is not None and back.f_code.co_name == "run_code":
            return frames, True
        frame = back
    if threading.current_thread() is not main_thread:
        main = sys._current_frames().get(main_thread.ident)
        if main is not None:
            return _frames_of_the_cell(main, main_thread)
    return frames, False


class CallSite(NamedTuple):
    """What the frames of a call say about it."""

    api: str | None  # the torch.distributed function it went through (the outermost one)
    maker: str | None  # the library (the outermost one) or torch.distributed helper that made it
    from_engine: bool  # called from the autograd engine with no Python in between
    cell_frame: int | None  # which frame holds the cell's line (in the cell or a function it defines)
    library_frame: int | None = None  # the innermost frame of an installed library other than torch

    def line(self, frames: list) -> int | None:
        """The line of the running cell that led to the call."""
        return frames[self.cell_frame].f_lineno if self.cell_frame is not None else None


def _call_site(frames: list, in_cell: bool) -> CallSite:
    api = maker = library_frame = None
    roles = [_role(frame.f_code, frame.f_globals) for frame in frames]
    for index, (name, library, helper, installed) in enumerate(roles):  # innermost first: the outermost wins
        if installed is not None and library_frame is None:
            library_frame = index
        api = name or api  # the deprecated all_gather_into_tensor forwards to all_gather_single
        if library is not None:
            maker = library
        elif helper is not None and helper != _ENGINE_CALL and maker is None:
            maker = helper  # broadcast_object_list, new_group, ...
    cell_frame = None
    if in_cell:
        cell_file = frames[-1].f_code.co_filename
        cell_frame = next(i for i, frame in enumerate(frames) if frame.f_code.co_filename == cell_file)
    if cell_frame is not None and library_frame is not None and library_frame > cell_frame:
        library_frame = None  # the cell called torch; a library called the cell (a trainer's loop)
    return CallSite(api, maker, bool(roles) and roles[0][2] == _ENGINE_CALL, cell_frame, library_frame)


_ENGINE_CALL = "autograd engine"
_roles: dict = {}  # code object -> its role (what a traced call made from it says)


def _role(code, globals_: dict) -> tuple[str | None, str | None, str | None, str | None]:
    """(the torch.distributed function it is, if one the trace names; the library it belongs
    to, if one that makes calls; torch.distributed's helper it is, or the autograd engine's
    call; its file under site-packages if an installed library's other than torch's), cached per
    code object: frames are read for every traced call."""
    role = _roles.get(code)
    if role is None:
        module = globals_.get("__name__", "")
        api = library = helper = None
        if module == _API_MODULE:
            api, helper = (code.co_name, None) if code.co_name in OPS else (None, code.co_name)
        elif module.startswith(_AUTOGRAD_MODULE) and code.co_name == "_engine_run_backward":
            helper = _ENGINE_CALL
        for prefix, label in MAKERS:
            if module == prefix or module.startswith(prefix + "."):
                library = DDP_PHASES.get(code.co_name, label) if label == "DDP" else label
        if module.startswith(OBSERVERS):
            library = None  # a tool that watches the calls (CommDebugMode re-makes each one)
        role = _roles[code] = (api, library, helper, _installed_file(code.co_filename, module))
    return role


def _installed_file(filename: str, module: str) -> str | None:
    """``transformers/distributed/tensor_parallel.py`` for a file of an installed library that
    is not torch's nor one of the notebook machinery's; None otherwise."""
    if module.split(".")[0] in NOT_LIBRARIES:
        return None
    for packages in ("/site-packages/", "/dist-packages/"):
        if packages in filename:
            return filename.rpartition(packages)[2]
    return None
