"""Matching the ranks' traced calls (the notebook side of tracing).

:class:`MatchedTrace` merges the ranks' events. It pairs each send with its recv, lines up each
group's collectives by their order on every rank, names mismatches in plain words
(:mod:`ddp_magics.mismatches`) and orders everything into steps that :mod:`ddp_magics.diagrams`
draws (its ``Trace`` is this one, drawable).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

from ddp_magics.layering import longest_path
from ddp_magics.mismatches import (
    RECV_WITHOUT_SEND,
    SEND_WITHOUT_RECV,
    SIZE_MISMATCH,
    Mismatch,
    collective_mismatches,
    transferred,
)
from ddp_magics.protocol import (
    ERROR,
    OPS,
    RECVS,
    RUNNING,
    SENDS,
    WAIT,
    WAITING,
    TraceEvent,
    format_values,
    group_label,
    plural,
    rank_label,
)

COLLECTIVE, TRANSFER, SOLO = "collective", "transfer", "solo"
MAX_STEP_LINES = 8  # per step in a listing: beyond, the first and last few ranks


@dataclass
class Step:
    """One thing that happened: a collective across a group, a send paired with its recv, or one
    rank's lone call (a wait, or half of a pair that never met)."""

    kind: str
    events: dict[int, TraceEvent]  # rank -> its event (for a transfer: sender and receiver)
    group: tuple[int, ...] = ()
    index: int = 0  # for a collective: its position among the group's collectives (1, 2, ...)
    column: int = 0  # the earliest column of its events
    columns: dict[int, int] = field(default_factory=dict)  # rank -> column of its event (time order)
    waited: Step | None = None  # for waits: the step whose handles they waited on
    lost: frozenset[int] = frozenset()  # ranks of the trace whose calls never arrived (they died)

    @property
    def ranks(self) -> list[int]:
        return sorted(self.events)

    @property
    def op(self) -> str:
        if self.kind == TRANSFER:
            send, recv = self.send, self.recv
            return f"{send.op}/{recv.op}" if send and recv else (send or recv).op
        ops = [self.events[rank].op for rank in self.ranks]
        return "/".join(dict.fromkeys(ops))  # "all_reduce", or "all_reduce/broadcast" if ranks differ

    @property
    def send(self) -> TraceEvent | None:
        return next((e for e in self.events.values() if e.op in SENDS), None)

    @property
    def recv(self) -> TraceEvent | None:
        return next((e for e in self.events.values() if e.op in RECVS), None)

    @property
    def missing(self) -> list[int]:
        return [rank for rank in self.group if rank not in self.events] if self.kind == COLLECTIVE else []

    def flows(self) -> list[tuple[int, int]]:
        """(from rank, to rank) for each rank-to-rank movement of data in this step."""
        if self.kind == TRANSFER:
            return [(self.send.rank, self.recv.rank)] if self.send and self.recv else []
        if self.kind != COLLECTIVE or len({event.op for event in self.events.values()}) > 1:
            return []
        ranks, op = self.ranks, self.op
        root = self.events[ranks[0]].root
        if op in ("broadcast", "scatter"):
            return [(root, rank) for rank in ranks if rank != root] if root in self.events else []
        if op in ("reduce", "gather"):
            return [(rank, root) for rank in ranks if rank != root] if root in self.events else []
        if op == "barrier":
            return []
        return [(a, b) for a in ranks for b in ranks if a != b]

    def title(self) -> str:
        if self.kind == TRANSFER and self.send and self.recv:
            made_by = self.send.made_by or self.recv.made_by
            return f"{self.op} rank {self.send.rank} -> rank {self.recv.rank}" + (
                f" ({made_by})" if made_by else ""
            )
        first = self.events[self.ranks[0]]
        if self.kind == SOLO:
            if self.waited is None:
                return first.call()
            return f"wait for {self.waited.title()}"
        return _collective_title(self)

    def lines(self, every_rank: bool = False) -> list[str]:
        """Per rank: values before -> after; ranks with the same line share it. Past
        ``MAX_STEP_LINES`` lines (16 ranks, each with its own values), the first and last few
        and one line naming the ranks left out, unless ``every_rank``."""
        ranks_by_line: dict[str, list[int]] = {}
        for rank in self.ranks:
            event = self.events[rank]
            if event.op == WAIT:
                line = f"{event.call()}{_status_note(event)}"
            else:
                flow = format_values(event.before)
                if OPS[event.op].outputs:
                    flow += " -> " + format_values(event.after)
                line = f"{_role(self, event)}{flow}{_status_note(event)}"
            ranks_by_line.setdefault(line, []).append(rank)
        for rank in self.missing:
            line = "died before its calls were reported" if rank in self.lost else "never called it"
            ranks_by_line.setdefault(line, []).append(rank)
        lines = [(ranks, f"{rank_label(ranks)}: {line}") for line, ranks in ranks_by_line.items()]
        if every_rank or len(lines) <= MAX_STEP_LINES:
            return [line for _, line in lines]
        head, tail = lines[: MAX_STEP_LINES // 2], lines[-2:]  # as the picture draws them
        left_out = sorted(rank for ranks, _ in lines[len(head) : -2] for rank in ranks)
        elided = f"{rank_label(left_out)}: one line each, not listed (lines(every_rank=True) lists them)"
        return [*(line for _, line in head), elided, *(line for _, line in tail)]


def _collective_title(step: Step) -> str:
    first = step.events[step.ranks[0]]
    if len({event.op for event in step.events.values()}) > 1:
        return f"{step.op} on {group_label(step.group, first.mesh_dim)} (ranks called different collectives)"
    words = [step.op]
    if first.reduce_op:
        words.append(first.reduce_op)
    if first.root is not None and first.op == step.op:
        words.append(f"{'from' if OPS[first.op].root == 'src' else 'to'} rank {first.root}")
    words.append(f"on {group_label(step.group, first.mesh_dim)}")
    makers = list(dict.fromkeys(event.made_by for event in step.events.values() if event.made_by))
    if makers:
        words.append(f"({', '.join(makers)})")
    return " ".join(words)


def _role(step: Step, event: TraceEvent) -> str:
    if step.kind == TRANSFER:
        return "sends " if event.op in SENDS else "receives "
    if step.kind == COLLECTIVE and event.op != step.op:
        return f"called {event.call()}: "
    return ""


def _status_note(event: TraceEvent) -> str:
    return {
        RUNNING: "  (still running)",
        WAITING: "  (not waited on)",
        ERROR: f"  (raised {event.error})",
    }.get(event.status, "")


@dataclass(frozen=True)
class Repeat:
    """Steps ``first`` .. ``first + period - 1`` (indices into a trace's steps), then the same
    calls again, ``times`` times in all."""

    first: int
    period: int
    times: int


@dataclass
class MatchedTrace:
    """The merged trace of one cell: every rank's calls, matched into steps, with mismatches.

    ``complete`` is False when some ranks had not finished the cell (the trace holds what they
    had recorded so far). ``lost`` ranks died before their calls reached the notebook: what
    they called is unknown, so no mismatch blames them.
    """

    events: dict[int, list[TraceEvent]]
    complete: bool = True
    lost: frozenset[int] = frozenset()
    steps: list[Step] = field(init=False)
    mismatches: list[Mismatch] = field(init=False)

    def __post_init__(self) -> None:
        self.events = {rank: list(events) for rank, events in sorted(self.events.items())}
        self.lost = frozenset(self.lost)
        self.steps, self.mismatches = match(self.events, self.lost)

    @property
    def ranks(self) -> list[int]:
        return list(self.events)

    def calls(self) -> int:
        return sum(len(events) for events in self.events.values())

    def in_progress(self, rank: int) -> TraceEvent | None:
        """The call ``rank`` is in (not returned, or a wait not returned), if any."""
        running = [event for event in self.events.get(rank, []) if event.status == RUNNING]
        return running[-1] if running else None

    def text(self, max_steps: int = 30) -> str:
        """The listing: every step, or, past ``max_steps``, runs of repeated steps (a training
        loop's all-reduces) shown once with how many times they came."""
        lines = [
            f"Trace of {rank_label(self.ranks)}: {plural(self.calls(), 'call')} in "
            f"{plural(len(self.steps), 'step')}" + ("" if self.complete else " (cell not finished)")
        ]
        if self.lost:
            lines.append(f"{rank_label(sorted(self.lost))} died: its calls are unknown")
        blocks = self.repeats() if len(self.steps) > max_steps else []
        listed = 0
        position = 0
        while position < len(self.steps) and listed < max_steps:
            block = next((b for b in blocks if b.first == position), None)
            period = block.period if block else 1
            for number, step in enumerate(self.steps[position : position + period], position + 1):
                lines.append(f"{number:>3}. {step.title()}")
                lines.extend(f"       {line}" for line in step.lines())
            listed += period
            position += period
            if block:
                again = block.first + block.period * block.times
                shown = f"step {block.first + 1}" if period == 1 else f"steps {block.first + 1}-{position}"
                lines.append(
                    f"{position + 1:>3}-{again}. {shown} again, {plural(block.times - 1, 'more time')} "
                    "(the same calls; their values not listed)"
                )
                position = again
        if position < len(self.steps):
            lines.append(f"     ... {len(self.steps) - position} more steps: {self.summary()}")
        lines.extend(f"Mismatch: {mismatch.message}" for mismatch in self.mismatches)
        return "\n".join(lines)

    def repeats(self, most_period: int = 8, fewest_times: int = 3) -> list[Repeat]:
        """Runs of steps that repeat the same calls (ops, groups, makers, lines; any values) at
        least ``fewest_times`` in a row, at most ``most_period`` steps long, in step order.
        Steps involved in a mismatch are never part of one."""
        keys = [self._repeat_key(step) for step in self.steps]
        blocks: list[Repeat] = []
        position = 0
        while position < len(keys):
            best = Repeat(position, 1, 1)
            for period in range(1, most_period + 1):
                pattern = keys[position : position + period]
                if len(pattern) < period or None in pattern:
                    break
                times = 1
                while keys[position + times * period : position + (times + 1) * period] == pattern:
                    times += 1
                if times >= fewest_times and period * times > best.period * best.times:
                    best = Repeat(position, period, times)
            if best.times > 1:
                blocks.append(best)
            position += best.period * best.times
        return blocks

    def _repeat_key(self, step: Step) -> tuple | None:
        if any(mismatch.involves(event) for mismatch in self.mismatches for event in step.events.values()):
            return None
        return (
            step.kind,
            step.title(),
            tuple((rank, e.op, e.line, e.made_by, e.status) for rank, e in sorted(step.events.items())),
        )

    def condensed(self) -> tuple[MatchedTrace, dict[tuple[int, int], str]]:
        """This trace with each run of repeated steps kept once (what a timeline can draw): that
        trace, and for each kept event ``(rank, seq)`` its step's number here (``3``), with how
        many times it came (``3 x50``) if it repeats."""
        labels: dict[tuple[int, int], str] = {}
        kept: set[tuple[int, int]] = set()
        blocks = {block.first: block for block in self.repeats()}
        position = 0
        while position < len(self.steps):
            block = blocks.get(position)
            period = block.period if block else 1
            for number, step in enumerate(self.steps[position : position + period], position + 1):
                label = f"{number} x{block.times}" if block else str(number)
                for rank, event in step.events.items():
                    kept.add((rank, event.seq))
                    labels[(rank, event.seq)] = label
            position += period * (block.times if block else 1)
        events = {rank: [e for e in events if (rank, e.seq) in kept] for rank, events in self.events.items()}
        return type(self)(events, complete=self.complete, lost=self.lost), labels

    def summary(self) -> str:
        """``12 x all_reduce, 4 x send/recv`` over all steps."""
        counts: dict[str, int] = {}
        for step in self.steps:
            counts[step.op] = counts.get(step.op, 0) + 1
        return ", ".join(f"{count} x {op}" for op, count in counts.items())

    def __repr__(self) -> str:
        return self.text()


def match(
    events: dict[int, list[TraceEvent]], lost: frozenset[int] = frozenset()
) -> tuple[list[Step], list[Mismatch]]:
    """Pair sends with recvs, line up collectives, find mismatches and order the steps.

    ``lost`` ranks' calls never arrived: they are never reported as missing a call.
    """
    steps: list[Step] = []
    mismatches: list[Mismatch] = []
    _match_collectives(events, steps, mismatches, lost)
    _match_transfers(events, steps, mismatches)
    step_of = {(rank, event.seq): step for step in steps for rank, event in step.events.items()}
    waits: dict[int, Step] = {}  # one wait step per step whose handles were waited on
    for rank, rank_events in events.items():
        for event in rank_events:
            if (rank, event.seq) in step_of:
                continue
            waited = step_of.get((rank, event.waits_for)) if event.op == WAIT else None
            if waited is not None and id(waited) in waits and rank not in waits[id(waited)].events:
                waits[id(waited)].events[rank] = event
                continue
            step = Step(SOLO, {rank: event}, waited=waited)
            if waited is not None:
                waits[id(waited)] = step
            steps.append(step)
    return _in_time_order(events, steps), mismatches


def _match_collectives(events, steps: list[Step], mismatches: list[Mismatch], lost: frozenset[int]) -> None:
    by_group: dict[str, dict[int, list[TraceEvent]]] = {}
    groups: dict[str, tuple[int, ...]] = {}
    for rank, rank_events in events.items():
        for event in rank_events:
            if event.is_collective:
                by_group.setdefault(event.group_name, {}).setdefault(rank, []).append(event)
                groups[event.group_name] = event.group
    for name, per_rank in by_group.items():
        group = groups[name]
        for index in range(max(len(calls) for calls in per_rank.values())):
            step_events = {rank: calls[index] for rank, calls in per_rank.items() if index < len(calls)}
            step = Step(COLLECTIVE, step_events, group=group, index=index + 1, lost=lost)
            steps.append(step)
            mismatches.extend(collective_mismatches(step, traced=set(events) - lost))


def _match_transfers(events, steps: list[Step], mismatches: list[Mismatch]) -> None:
    sends: dict[tuple, list[TraceEvent]] = {}
    recvs: dict[tuple, list[TraceEvent]] = {}
    open_recvs: list[TraceEvent] = []  # from any rank, not received yet
    for rank_events in events.values():
        for event in rank_events:
            if event.op in SENDS:
                sends.setdefault((event.rank, event.peer, event.tag), []).append(event)
            elif event.op in RECVS and event.peer is None:
                open_recvs.append(event)
            elif event.op in RECVS:
                recvs.setdefault((event.peer, event.rank, event.tag), []).append(event)
    for key in sorted(set(sends) | set(recvs)):
        src, dst, tag = key
        key_sends, key_recvs = sends.get(key, []), recvs.get(key, [])
        for send, recv in itertools.zip_longest(key_sends, key_recvs):
            if send and recv:
                steps.append(Step(TRANSFER, {send.rank: send, recv.rank: recv}))
                if send.primary and recv.primary and transferred(send.primary) != transferred(recv.primary):
                    mismatches.append(
                        Mismatch(
                            SIZE_MISMATCH,
                            f"rank {src} sends {send.primary.layout} at {send.where()}, but rank {dst} "
                            f"receives into {recv.primary.layout} at {recv.where()}",
                            (send, recv),
                        )
                    )
            elif send:
                if dst not in events:
                    continue  # the receiver was not traced
                if any(recv.rank == dst for recv in open_recvs):
                    continue  # an any-source recv on dst may take it
                tag_note = f" with tag {tag}" if tag else ""
                mismatches.append(
                    Mismatch(
                        SEND_WITHOUT_RECV,
                        f"rank {src} sends to rank {dst}{tag_note} at {send.where()}, but rank {dst} "
                        "posts no matching recv",
                        (send,),
                    )
                )
            elif src in events:
                tag_note = f" with tag {tag}" if tag else ""
                mismatches.append(
                    Mismatch(
                        RECV_WITHOUT_SEND,
                        f"rank {dst} receives from rank {src}{tag_note} at {recv.where()}, but rank {src} "
                        "never sends to it",
                        (recv,),
                    )
                )
    for recv in open_recvs:
        if recv.status == RUNNING and not any(dst == recv.rank for (_, dst, _) in sends):
            mismatches.append(
                Mismatch(
                    RECV_WITHOUT_SEND,
                    f"rank {recv.rank} receives from any rank at {recv.where()}, but no rank sends to it",
                    (recv,),
                )
            )


def _in_time_order(events: dict[int, list[TraceEvent]], steps: list[Step]) -> list[Step]:
    """Give every event a column and order the steps by it.

    An event comes after the rank's previous event; the events of one collective share a column;
    a recv is no earlier than its send. This is a longest-path layering; if mismatched calls
    make it cyclic, each event falls back to its position among its rank's calls.
    """
    node_of: dict[tuple[int, int], object] = {}
    step_of: dict[tuple[int, int], Step] = {}
    for step in steps:
        for rank, event in step.events.items():
            node_of[(rank, event.seq)] = id(step) if step.kind == COLLECTIVE else (rank, event.seq)
            step_of[(rank, event.seq)] = step
    edges: list[tuple[object, object, int]] = []
    for rank, rank_events in events.items():
        for earlier, later in itertools.pairwise(rank_events):
            edges.append((node_of[(rank, earlier.seq)], node_of[(rank, later.seq)], 1))
    for step in steps:
        if step.kind == TRANSFER and step.send and step.recv:
            send, recv = step.send, step.recv
            edges.append((node_of[(send.rank, send.seq)], node_of[(recv.rank, recv.seq)], 0))
    columns = longest_path(set(node_of.values()), edges)
    for rank, rank_events in events.items():
        for position, event in enumerate(rank_events):
            key = (rank, event.seq)
            step_of[key].columns[rank] = position if columns is None else columns[node_of[key]]
    for step in steps:
        step.column = min(step.columns.values())
    return sorted(steps, key=lambda step: (step.column, step.ranks[0], step.kind))
