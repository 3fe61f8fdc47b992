"""Mismatches between the ranks' traced calls: what each kind is called, and the checks of a
collective's calls against each other.

:func:`ddp_magics.matching.match` finds them as it pairs the calls: a collective's with
:func:`collective_mismatches`, a send's or a recv's as it pairs sends with recvs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

from ddp_magics.protocol import TraceEvent, group_label, rank_label


class Collective(Protocol):
    """What the checks need of one collective across its group (a ``matching.Step``)."""

    events: dict[int, TraceEvent]  # rank -> its call
    group: tuple[int, ...]
    index: int  # its position among the group's collectives

    @property
    def missing(self) -> list[int]: ...

    @property
    def op(self) -> str: ...


@dataclass(frozen=True)
class Mismatch:
    kind: str
    message: str
    events: tuple[TraceEvent, ...]  # the calls involved

    @property
    def ranks(self) -> tuple[int, ...]:
        return tuple(sorted({event.rank for event in self.events}))

    def involves(self, event: TraceEvent) -> bool:
        return any(e.rank == event.rank and e.seq == event.seq for e in self.events)


MISSING_CALL = "collective not called by every rank"
DIFFERENT_OPS = "different collectives"
DIFFERENT_SHAPES = "different shapes or dtypes"
DIFFERENT_ROOTS = "different roots"
DIFFERENT_REDUCE_OPS = "different reduce ops"
SEND_WITHOUT_RECV = "send without recv"
RECV_WITHOUT_SEND = "recv without send"
SIZE_MISMATCH = "send and recv sizes differ"


def collective_mismatches(step: Collective, traced: set[int]) -> list[Mismatch]:
    found = []
    events = step.events
    mesh_dim = next((event.mesh_dim for event in events.values() if event.mesh_dim), None)
    nth = f"collective #{step.index} on {group_label(step.group, mesh_dim)}"
    missing = [rank for rank in step.missing if rank in traced]
    if missing:
        called = ", ".join(f"rank {r} called {e.what()} at {e.where()}" for r, e in sorted(events.items()))
        found.append(
            Mismatch(
                MISSING_CALL,
                f"{nth}: {called}; {rank_label(missing)} never called it",
                tuple(events.values()),
            )
        )
    if len({event.op for event in events.values()}) > 1:
        called = ", ".join(f"rank {r} called {e.what()} at {e.where()}" for r, e in sorted(events.items()))
        found.append(Mismatch(DIFFERENT_OPS, f"{nth}: {called}", tuple(events.values())))
        return found  # shapes, roots and reduce ops of different ops are not comparable
    for kind, describe in (
        (DIFFERENT_SHAPES, lambda e: e.primary.layout if e.primary else None),
        (DIFFERENT_ROOTS, lambda e: None if e.root is None else f"root rank {e.root}"),
        (DIFFERENT_REDUCE_OPS, lambda e: e.reduce_op),
    ):
        seen = {rank: describe(event) for rank, event in sorted(events.items())}
        if len(set(seen.values())) > 1:
            detail = ", ".join(f"rank {rank} {text}" for rank, text in seen.items())
            found.append(Mismatch(kind, f"{nth} ({step.op}): {kind}: {detail}", tuple(events.values())))
    return found


def transferred(layout) -> tuple[int, str]:
    """What a send moves, as the backend sees it: elements and dtype (shape () and (1,) agree:
    torch's pipelining sends a scalar's metadata into a one-element buffer)."""
    return math.prod(layout.shape), layout.dtype
