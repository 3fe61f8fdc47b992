"""What ``%%distributed --profile NAME`` keeps: every rank's ``torch.profiler`` ranges of one cell
on one clock, and what they say (:class:`Profile`).

Each rank's :class:`~ddp_magics.protocol.RankProfile` is on its own clock; ranks on the
notebook's host share its clock, ranks on other hosts are moved by their measured offset. A
range of the backend moving data (``gloo:all_reduce`` on gloo's thread, an NCCL kernel) is
*communication*; the top-level ranges of the other threads (``aten::addmm``, backward's
``autograd::engine::evaluate_function: ...``), less the ``c10d::`` calls inside them, are
*compute*. Communication overlapped with compute is the overlap; the rest is exposed (the rank
waited for it). Each communication range is named by the ``c10d::`` call that queued it and, as
the cell is traced too, as ``--trace`` names that call (``all_reduce SUM on ranks 0,1 (DDP
bucket 0)``, the cell's line).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ddp_magics.chrome_trace import ChromeTrace
from ddp_magics.protocol import COMMUNICATION, COMPUTE, LAUNCH, WAIT, RankProfile, TraceEvent, rank_label

# A traced call starts inside the profiler's range of its c10d:: op (both on the rank's clock).
CALL_MATCH_SECONDS = 0.002


@dataclass(frozen=True)
class Span:
    """One range of a rank's time on the notebook's clock, in seconds from the profile's start."""

    name: str  # the profiler's
    start: float
    end: float
    kind: str  # COMPUTE, COMMUNICATION or LAUNCH
    thread: int
    device: str = "cpu"
    label: str | None = None  # communication: the call, as --trace names it
    line: int | None = None  # ... and the cell's line that led to it
    mesh_dim: str | None = None  # ... and its DeviceMesh dimension ("tp", "dp"), if any

    @property
    def duration(self) -> float:
        return self.end - self.start


class Profile:
    """The ranks' profiles of one cell, merged; ``summary()``, ``text()``, ``draw()``, ``save()``."""

    def __init__(
        self,
        profiles: dict[int, RankProfile],
        offsets: dict[int, tuple[float, float] | None],
        events: dict[int, list[TraceEvent]] | None = None,
        missing: list[int] = (),
    ) -> None:
        """``offsets``: each rank's clock minus the notebook's and how far off that may be, in
        seconds (None: the notebook's host, the same clock)."""
        self.profiles = dict(sorted(profiles.items()))
        self.offset_bounds = {rank: pair[1] for rank, pair in offsets.items() if pair is not None}
        self.offsets = {rank: None if pair is None else pair[0] for rank, pair in offsets.items()}
        self.missing = sorted(missing)  # ranks whose profile did not come back (still running, dead)
        shift = {rank: self.offsets.get(rank) or 0.0 for rank in self.profiles}
        usable = [p for p in self.profiles.values() if p.error is None]
        self.origin = min((p.started - shift[p.rank] for p in usable), default=0.0)  # the first cell start
        self.spans: dict[int, list[Span]] = {
            rank: _spans(profile, shift[rank] + self.origin, (events or {}).get(rank, []))
            for rank, profile in self.profiles.items()
        }

    @property
    def ranks(self) -> list[int]:
        return list(self.profiles)

    def summary(self) -> dict[int, dict]:
        """Per rank, in seconds: ``wall``, ``compute``, ``communication``, ``overlapped`` (the
        communication during compute), ``exposed`` (the rest), ``overlap`` (overlapped over
        communication, None without communication), ``top_ops`` ((op, calls, self seconds), the
        costliest first), ``clock_offset`` (None: the notebook's host, the same clock; 0.0: the
        clocks agree within ``clock_offset_bound``) and ``clock_offset_bound``."""
        summary = {}
        for rank, spans in self.spans.items():
            profile = self.profiles[rank]
            compute, communication = _work(spans)
            overlapped = _length(_intersect(compute, communication))
            busy = _length(communication)
            summary[rank] = {
                "wall": profile.ended - profile.started if profile.error is None else 0.0,
                "compute": _length(compute),
                "communication": busy,
                "overlapped": overlapped,
                "exposed": busy - overlapped,
                "overlap": overlapped / busy if busy else None,
                "top_ops": list(profile.top_ops),
                "clock_offset": self.offsets.get(rank),
                "clock_offset_bound": self.offset_bounds.get(rank),
                "error": profile.error,
            }
        return summary

    def text(self) -> str:
        """The summary in words, a line or two per rank (times: in a lesson, a timing cell)."""
        return summary_text(self)

    def draw(self, max_spans: int = 4000):
        """A lane per rank: compute above, communication below, calls named."""
        from ddp_magics.profile_figure import draw_profile

        return draw_profile(self, max_spans)

    def save(self, path) -> Path:
        """Chrome-trace JSON: one process per rank named ``rank N``, its threads as the profiler
        saw them, each range under the profiler's name (``gloo:all_reduce``, ``aten::addmm``),
        communication's call as ``--trace`` names it in its ``args``. ``path``: a ``.json``
        file, every rank in it; or a directory, one file per rank with its ``distributedInfo``
        (rank, world size, backend), which HTA's ``TraceAnalysis(trace_dir=path)`` reads."""
        chrome = ChromeTrace(self.origin)
        for rank, spans in self.spans.items():
            chrome.rank(rank)
            for span in spans:
                thread = f"{span.device} {span.kind} (thread {span.thread})"
                args = {}
                if span.label:
                    args["call"] = span.label
                if span.line is not None:
                    args["line"] = span.line
                if span.mesh_dim is not None:
                    args["mesh_dim"] = span.mesh_dim
                chrome.slice(
                    rank, thread, span.name, self.origin + span.start, self.origin + span.end, span.kind, args
                )
        offsets = {str(rank): offset for rank, offset in self.offsets.items()}
        bounds = {str(rank): bound for rank, bound in self.offset_bounds.items()}
        other = {"clock_offsets_seconds": offsets, "clock_offset_bounds_seconds": bounds}
        world = max((p.world_size or 0 for p in self.profiles.values()), default=0) or len(self.profiles)
        ranks = {
            rank: {"rank": rank, "world_size": world, "backend": profile.backend or "unknown"}
            for rank, profile in self.profiles.items()
        }
        return chrome.save(path, {"source": "ddp_magics --profile", **other}, ranks)

    def _repr_pretty_(self, printer, cycle: bool) -> None:
        printer.text(self.text())

    def __repr__(self) -> str:
        return self.text()


def summary_text(profile: Profile) -> str:
    """``rank 0: wall 41.2 ms, compute 30.1 ms, communication 12.0 ms (75% overlapped, exposed
    3.0 ms)``, then the top ops, each rank's measured clock offset, the ranks with no profile."""
    lines = [f"Profile of {rank_label(profile.ranks)}" if profile.ranks else "Profile: no rank answered"]
    for rank, row in profile.summary().items():
        if row["error"]:
            lines.append(f"rank {rank}: nothing recorded ({row['error']})")
            continue
        overlap = "no communication" if row["overlap"] is None else f"{row['overlap']:.0%} overlapped"
        lines.append(
            f"rank {rank}: wall {_ms(row['wall'])}, compute {_ms(row['compute'])}, communication "
            f"{_ms(row['communication'])} ({overlap}, exposed {_ms(row['exposed'])})"
        )
        top = ", ".join(f"{name} {_ms(seconds)} x{calls}" for name, calls, seconds in row["top_ops"][:3])
        if top:
            lines.append(f"  top ops: {top}")
        left_out = profile.profiles[rank].left_out
        if left_out:
            kept = len(profile.profiles[rank].slices)
            lines.append(
                f"  {left_out} more ranges not kept (a rank keeps its first {kept}): the picture, the "
                "lanes' totals and the saved files end there; profile fewer steps to see them"
            )
    for rank, offset in profile.offsets.items():
        if offset is not None:
            bound = profile.offset_bounds[rank] * 1e3
            measured = f"{offset * 1e3:+.1f} ms from the notebook's (measured, ± {bound:.1f} ms)"
            lines.append(f"rank {rank}: its clock {measured}")
    if profile.missing:
        lines.append(f"{rank_label(profile.missing)}: no profile (still running or died)")
    return "\n".join(lines)


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f} ms"


# --------------------------------------------------------------------------- merging
def _spans(profile: RankProfile, shift: float, events: list[TraceEvent]) -> list[Span]:
    """The rank's slices moved onto the notebook's clock, communication named by its call."""
    slices = sorted(profile.slices, key=lambda s: s.start)
    launches = [s for s in slices if s.kind == LAUNCH]
    calls = _calls_of_launches(launches, [e for e in events if e.op != WAIT])
    queued = _launch_of_transfers(slices, launches)
    spans = []
    for index, piece in enumerate(slices):
        label = line = mesh_dim = None
        launch = piece if piece.kind == LAUNCH else queued.get(index)
        if launch is not None:
            call = calls.get(id(launch))
            label = call.call() if call is not None else _op_name(launch.name)
            if call is not None:
                line, mesh_dim = call.line, call.mesh_dim
        spans.append(
            Span(
                piece.name,
                piece.start - shift,
                piece.end - shift,
                piece.kind,
                piece.thread,
                piece.device,
                label,
                line,
                mesh_dim,
            )
        )
    return spans


def _calls_of_launches(launches: list, events: list[TraceEvent]) -> dict[int, TraceEvent]:
    """Each c10d:: range's traced call: the first call not yet placed that started inside it."""
    calls: dict[int, TraceEvent] = {}
    remaining = sorted(events, key=lambda e: e.start)
    for launch in launches:
        for index, event in enumerate(remaining):
            if launch.start - CALL_MATCH_SECONDS <= event.start <= launch.end:
                calls[id(launch)] = event
                del remaining[index]
                break
    return calls


def _launch_of_transfers(slices: list, launches: list) -> dict[int, object]:
    """For each backend range (by index in ``slices``): the c10d:: call that queued it, the
    earliest not yet taken that started before it (backends run their work in order)."""
    queued: dict[int, object] = {}
    waiting = list(launches)
    for index, piece in enumerate(slices):
        if piece.kind != COMMUNICATION or piece.device != "cpu":
            continue
        for position, launch in enumerate(waiting):
            if launch.start <= piece.start:
                queued[index] = launch
                del waiting[position]
                break
    return queued


def _op_name(name: str) -> str:
    """``c10d::allreduce_`` -> ``allreduce``."""
    return name.removeprefix("c10d::").strip("_")


# --------------------------------------------------------------------------- interval arithmetic
def _work(spans: list[Span]) -> tuple[list[tuple[float, float]], list[tuple[float, float]]]:
    """(compute, communication) of a rank as sorted disjoint intervals. Compute: on a GPU, its
    kernels; else the CPU's ranges (c10d:: calls are not compute). Communication: NCCL's kernels
    where there are any; else the CPU's c10d:: ranges, which is where gloo works, over CUDA
    tensors too (it copies them to the host)."""
    on_gpu = any(span.device == "cuda" for span in spans)
    device = "cuda" if on_gpu else "cpu"
    on_gpu_links = any(s.kind == COMMUNICATION and s.device == "cuda" for s in spans)
    links = "cuda" if on_gpu_links else "cpu"
    communication = _union([(s.start, s.end) for s in spans if s.kind == COMMUNICATION and s.device == links])
    compute = _union([(s.start, s.end) for s in spans if s.kind == COMPUTE and s.device == device])
    if not on_gpu:
        compute = _subtract(compute, _union([(s.start, s.end) for s in spans if s.kind == LAUNCH]))
    return compute, communication


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[list[float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(start, end) for start, end in merged]


def _intersect(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> list[tuple[float, float]]:
    result, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        start, end = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if start < end:
            result.append((start, end))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return result


def _subtract(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> list[tuple[float, float]]:
    result = []
    for start, end in a:
        for cut_start, cut_end in b:
            if cut_end <= start or cut_start >= end:
                continue
            if cut_start > start:
                result.append((start, cut_start))
            start = max(start, cut_end)
        if start < end:
            result.append((start, end))
    return result


def _length(intervals: list[tuple[float, float]]) -> float:
    return sum(end - start for start, end in intervals)
