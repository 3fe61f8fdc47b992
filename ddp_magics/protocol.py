"""What the engine side and the notebook side agree on: plain, picklable data only.

Engine code imports this module and nothing else of the notebook side (tests/test_layout.py
checks it): the records a traced call leaves (:class:`TraceEvent`), what an engine reports
about itself (:class:`EngineProbe`) and what makes it a rank (:class:`RankSetup`), and the
header that numbers a cell.
"""

from __future__ import annotations

import signal
from dataclasses import dataclass
from typing import NamedTuple

STACK_DUMP_SIGNAL = signal.SIGUSR1
# Makes a rank cut its process groups' connections, whatever its main thread is doing
# (ddp_magics.engine.recovery): the first step of %dist_recover. A real-time signal, which no
# library of a rank takes for itself (code in a cell may well use SIGUSR2, as lesson 12 does).
CUT_CONNECTIONS_SIGNAL = signal.SIGRTMIN + 4
# First line of every cell the notebook sends: the notebook's own number for the cell.
CELL_NUMBER_HEADER = "# ddp_magics: In["
# What a zygote writes to its log as a child it forked ends (the notebook reads it for a dead
# engine's record): the prefix, the PID, how it ended.
ZYGOTE_CHILD_ENDED = "ddp_magics zygote: ended: PID "

DEFAULT_VALUES_LIMIT = 16
# Keys of the data messages (ipyparallel's datapub) engines publish for the running cell.
INSPECTION_KEY = "ddp_magics.inspection"  # an Inspection, answering STACK_DUMP_SIGNAL
TRACE_KEY = "ddp_magics.trace"  # the traced calls of a cell, published as it ends


def numbered_cell(code: str, number: int) -> str:
    """``code`` as sent to the ranks: headed by the number of the notebook cell it comes from."""
    return f"{CELL_NUMBER_HEADER}{number}]\n{code}"


@dataclass(frozen=True)
class EngineProbe:
    """What an engine reports about itself before ranks are assigned."""

    host: str  # its host name (several network namespaces of one machine share it)
    address: str  # the address its host reaches the controller from: one per host
    pid: int
    gpu_count: int


@dataclass(frozen=True)
class RankSetup:
    """Everything one engine needs to become one rank."""

    rank: int
    local_rank: int
    world_size: int
    master_addr: str
    master_port: int  # 0 until rank 0's store listens (engine.rank.open_rendezvous)
    backend: str
    device: str
    timeout_s: float
    # As torchrun sets them: this rank's host is host GROUP_RANK of GROUP_WORLD_SIZE, with
    # LOCAL_WORLD_SIZE ranks.
    group_rank: int = 0
    group_world_size: int = 1
    local_world_size: int = 1
    # With ranks on several hosts: the address of this rank's host that the others reach, whose
    # interface gloo and NCCL must use (by default they take the address the host name resolves
    # to, often 127.0.1.1).
    address: str | None = None


def format_ranks(ranks: list[int]) -> str:
    """``[0, 1, 2, 3]`` -> ``0-3``; ``[0, 2]`` -> ``0,2``; runs of three or more become ranges."""
    ordered = sorted(ranks)
    parts: list[str] = []
    start = 0
    while start < len(ordered):
        end = start
        while end + 1 < len(ordered) and ordered[end + 1] == ordered[end] + 1:
            end += 1
        if end - start >= 2:
            parts.append(f"{ordered[start]}-{ordered[end]}")
        else:
            parts.extend(str(rank) for rank in ordered[start : end + 1])
        start = end + 1
    return ",".join(parts)


def rank_label(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {format_ranks(ranks)}"


# --------------------------------------------------------------------------- what a call records
@dataclass(frozen=True)
class OpSpec:
    """Which arguments of a torch.distributed function hold what."""

    inputs: tuple[str, ...] = ()  # tensors (or tensor lists) whose values go in
    outputs: tuple[str, ...] = ()  # tensors (or tensor lists) that hold the result
    primary: str | None = None  # the tensor whose shape must agree across the group
    root: str | None = None  # src/dst of a rooted collective
    peer: str | None = None  # dst/src of a point-to-point call
    has_reduce_op: bool = False
    p2p: bool = False

    @property
    def in_place(self) -> bool:
        """Writes its result into its input (all_reduce, broadcast, recv, ...)."""
        return self.outputs == self.inputs


OPS: dict[str, OpSpec] = {
    "send": OpSpec(inputs=("tensor",), primary="tensor", peer="dst", p2p=True),
    "recv": OpSpec(inputs=("tensor",), outputs=("tensor",), primary="tensor", peer="src", p2p=True),
    "isend": OpSpec(inputs=("tensor",), primary="tensor", peer="dst", p2p=True),
    "irecv": OpSpec(inputs=("tensor",), outputs=("tensor",), primary="tensor", peer="src", p2p=True),
    "broadcast": OpSpec(inputs=("tensor",), outputs=("tensor",), primary="tensor", root="src"),
    "reduce": OpSpec(
        inputs=("tensor",), outputs=("tensor",), primary="tensor", root="dst", has_reduce_op=True
    ),
    "all_reduce": OpSpec(inputs=("tensor",), outputs=("tensor",), primary="tensor", has_reduce_op=True),
    "gather": OpSpec(inputs=("tensor",), outputs=("gather_list",), primary="tensor", root="dst"),
    "all_gather": OpSpec(inputs=("tensor",), outputs=("tensor_list",), primary="tensor"),
    "all_gather_into_tensor": OpSpec(
        inputs=("input_tensor",), outputs=("output_tensor",), primary="input_tensor"
    ),
    # torch 2.13's name for all_gather_into_tensor (which it deprecates and forwards here)
    "all_gather_single": OpSpec(inputs=("input_tensor",), outputs=("output_tensor",), primary="input_tensor"),
    "scatter": OpSpec(inputs=("scatter_list",), outputs=("tensor",), primary="tensor", root="src"),
    "reduce_scatter": OpSpec(
        inputs=("input_list",), outputs=("output",), primary="output", has_reduce_op=True
    ),
    "reduce_scatter_tensor": OpSpec(
        inputs=("input",), outputs=("output",), primary="output", has_reduce_op=True
    ),
    # torch 2.13's name for reduce_scatter_tensor (which it deprecates and forwards here)
    "reduce_scatter_single": OpSpec(
        inputs=("input",), outputs=("output",), primary="output", has_reduce_op=True
    ),
    "all_to_all": OpSpec(inputs=("input_tensor_list",), outputs=("output_tensor_list",)),
    "all_to_all_single": OpSpec(inputs=("input",), outputs=("output",)),
    "barrier": OpSpec(),
}
TRACED_OPS = tuple(OPS)
SENDS, RECVS = ("send", "isend"), ("recv", "irecv")
WAIT = "wait"
# Status of an event: running (called, not returned), waiting (async op issued, not waited yet),
# done, error.
RUNNING, WAITING, DONE, ERROR = "running", "waiting", "done", "error"


class TensorInfo(NamedTuple):
    shape: tuple[int, ...]
    dtype: str
    values: tuple | None = None  # flat values when the tensor is small enough

    def describe(self) -> str:
        if self.values is not None:
            return "[" + ", ".join(format_number(value) for value in self.values) + "]"
        return f"<{'x'.join(map(str, self.shape)) or 'scalar'} {self.dtype}>"

    @property
    def layout(self) -> str:
        return f"shape ({', '.join(map(str, self.shape))}{',' if len(self.shape) == 1 else ''}) {self.dtype}"


@dataclass
class TraceEvent:
    """One call a rank made, as plain data. Ranks are global ranks."""

    rank: int
    seq: int  # 1, 2, ... in the order the rank made its calls
    op: str
    group: tuple[int, ...]
    group_name: str
    peer: int | None = None
    root: int | None = None
    reduce_op: str | None = None
    tag: int = 0
    primary: TensorInfo | None = None  # shape and dtype only
    before: tuple[TensorInfo, ...] = ()
    after: tuple[TensorInfo, ...] | None = None
    async_op: bool = False
    waits_for: int | None = None  # a wait: the seq of the call whose handle it waited on
    waited_op: str | None = None  # ... and that call's op
    line: int | None = None  # line in the cell that made the call
    start: float = 0.0
    end: float | None = None
    status: str = RUNNING
    error: str | None = None
    # Who made the call, if not the cell through torch.distributed's functions: "DDP bucket 0",
    # "DDP construction", "DTensor", "FSDP", "pipelining", "broadcast_object_list", ...
    made_by: str | None = None
    # The DeviceMesh dimension whose group it ran on ("tp", "dp"), if a mesh made the group.
    mesh_dim: str | None = None
    backend: str | None = None  # the group's ("gloo", "nccl")

    @property
    def is_collective(self) -> bool:
        return self.op in OPS and not OPS[self.op].p2p

    def call(self) -> str:
        """``recv from rank 1``, ``all_reduce SUM on ranks 0,1 (DDP bucket 0)``, ``all_gather on tp
        ranks 0,1 (DTensor)``, ``wait for isend (call #2)``."""
        if self.op == WAIT:
            return f"wait for {self.waited_op} (call #{self.waits_for})"
        if self.op in SENDS:
            words = [f"{self.op} to rank {self.peer}"]
        elif self.op in RECVS:
            words = [f"{self.op} from {'any rank' if self.peer is None else f'rank {self.peer}'}"]
        else:
            words = [self.op]
            if self.reduce_op:
                words.append(self.reduce_op)
            if self.root is not None:
                words.append(f"{'from' if OPS[self.op].root == 'src' else 'to'} rank {self.root}")
            words.append(f"on {group_label(self.group, self.mesh_dim)}")
        if self.made_by:
            words.append(f"({self.made_by})")
        return " ".join(words)

    def what(self) -> str:
        """``all_reduce``, or ``all_reduce (DDP bucket 0)`` for a library's call."""
        return f"{self.op} ({self.made_by})" if self.made_by else self.op

    def where(self) -> str:
        return f"line {self.line}" if self.line is not None else "an unknown line"


def plural(count: int, noun: str) -> str:
    return f"{count} {noun}{'' if count == 1 else 's'}"


def group_label(group: tuple[int, ...], mesh_dim: str | None = None) -> str:
    """``ranks 0,1``, or ``tp ranks 0,1`` for the group of a DeviceMesh dimension."""
    return (f"{mesh_dim} " if mesh_dim else "") + rank_label(list(group))


def format_number(value) -> str:
    if isinstance(value, float):
        text = format(value, ".6g")
        return text if any(mark in text for mark in ".enia") else text + ".0"
    return str(value)


def format_values(infos: tuple[TensorInfo, ...] | None) -> str:
    if infos is None:
        return "?"
    if not infos:
        return "-"
    return " ".join(info.describe() for info in infos)


@dataclass(frozen=True)
class Inspection:
    """A rank's answer to ``STACK_DUMP_SIGNAL``: where it is, while it runs a cell."""

    number: int  # 1, 2, ... per engine: tells a new answer from one the notebook already had
    stack: str  # faulthandler's dump of every thread
    events: list[TraceEvent] | None  # the calls traced so far in this cell (None: not traced)


@dataclass(frozen=True)
class Rejoined:
    """A rank's answer to re-forming its process group (%dist_recover)."""

    device: str
    # Names in the rank's namespace that hold a process group from before: ``(name, what)``,
    # like ``("model", "DistributedDataParallel")``.
    stale: tuple[tuple[str, str], ...] = ()
    # The peers ("[address]:port") of every connection recovery has cut on this rank: gloo names
    # one when an object holding an old group (a DDP wrapper) uses it.
    cut_peers: frozenset[str] = frozenset()


@dataclass(frozen=True)
class ValueSnapshot:
    """What ``%dist_diff`` compares of one rank's value: its leaves by path (``weight``,
    ``state.0.exp_avg``, ``[2]``), each a CPU tensor or a plain picklable value (else its repr)."""

    type_name: str
    leaves: dict[str, object]


@dataclass(frozen=True)
class DTensorLeaf:
    """A DTensor leaf of a :class:`ValueSnapshot`: this rank's local tensor (on the CPU) and how
    the whole is laid out over the mesh."""

    local: object  # a CPU tensor
    shape: tuple[int, ...]  # the whole tensor's
    placements: tuple[str, ...]  # per mesh dimension: "Shard(0)", "Replicate()", "Partial(sum)"
    mesh_shape: tuple[int, ...]
    coordinate: tuple[int, ...] | None  # this rank's place on the mesh

    def layout(self) -> str:
        return ", ".join(self.placements)

    def replica_key(self) -> tuple:
        """Ranks with the same key hold the same local tensor: the same place on every mesh
        dimension that is not replicated."""
        coordinate = self.coordinate or ()
        return tuple(
            place for place, placement in zip(coordinate, self.placements) if placement != "Replicate()"
        )


DEBUGGER_KEY = "ddp_magics.debugger"  # a DebuggerPrompt: a rank in breakpoint() waits for a line
# The control message that carries a typed line to a rank at a debugger prompt (its main thread
# is busy in the cell; the engine's control thread still answers).
DEBUGGER_INPUT_REQUEST = "ddp_magics_debugger_input_request"
# The line the notebook sends when no input can be read there: skip this cell's breakpoints.
SKIP_BREAKPOINTS = "\x00skip"
# The error a rank answers with when ``q`` at its prompt ended the cell there, on purpose.
DEBUGGER_QUIT = "DebuggerQuit"


@dataclass(frozen=True)
class DebuggerPrompt:
    """A rank stopped in ``breakpoint()``: what pdb printed since its last prompt."""

    number: int  # this rank's prompts so far in this cell
    output: str
    console: bool = False  # at pdb's ``interact`` console (Python lines), not at pdb's prompt


# --------------------------------------------------------------------------- what a profile records
PROFILE_KEY = "ddp_magics.profile"  # a RankProfile, published as a profiled cell ends
# What a profiled slice of a rank's time was. A mark: a top-level ``record_function`` range
# (a loop's ``step 3``, ``ProfilerStep#3``, ``DistributedDataParallel.forward``), not work itself.
COMPUTE, COMMUNICATION, LAUNCH, MARK = "compute", "communication", "launch", "mark"


@dataclass(frozen=True)
class ProfiledSlice:
    """One range of a rank's profile. Times are seconds since the epoch on the rank's clock."""

    name: str  # aten::addmm, gloo:all_reduce, c10d::allreduce_, a CUDA kernel's name
    start: float
    end: float
    thread: int  # the profiler's thread number (CUDA: the stream)
    kind: str  # COMPUTE, COMMUNICATION (the backend moving data), LAUNCH (a c10d:: call)
    device: str = "cpu"  # "cpu" or "cuda"


@dataclass(frozen=True)
class RankProfile:
    """What ``torch.profiler`` recorded on one rank during one cell."""

    rank: int
    slices: tuple[ProfiledSlice, ...]  # the top-level ranges of each thread, and every c10d/backend range
    top_ops: tuple[tuple[str, int, float], ...]  # (op, calls, self seconds), the costliest first
    started: float  # when profiling started, on the rank's clock
    ended: float
    activities: tuple[str, ...] = ("cpu",)
    left_out: int = 0  # slices beyond the limit
    error: str | None = None  # why nothing was recorded
    backend: str | None = None  # the default group's ("gloo", "nccl")
    world_size: int | None = None


@dataclass(frozen=True)
class RankMemory:
    """A rank's memory, in bytes: resident (its process's RSS, which counts every page it shares
    with the other ranks forked from one zygote in full), unique (USS: the pages only it uses,
    freed if it ended), proportional (PSS: unique plus its share of each shared page; the ranks'
    add up to what they take together) and, on a GPU, what torch's caching allocator has
    allocated and reserved on its device (None on CPU). None: not known."""

    resident: int
    cuda_allocated: int | None = None
    cuda_reserved: int | None = None
    unique: int | None = None
    proportional: int | None = None
