"""Chrome-trace JSON (the format Perfetto, ``chrome://tracing`` and HTA read): one process per
rank, named ``rank N``, one thread per kind of work, each range a complete (``"X"``) event with
times in microseconds. Used by ``Trace.save`` and ``Profile.save``."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class ChromeTrace:
    """Events added rank by rank, written as one JSON file."""

    origin: float  # seconds since the epoch that ts 0 stands for
    events: list[dict] = field(default_factory=list)
    _threads: dict[tuple[int, str], int] = field(default_factory=dict)

    def rank(self, rank: int) -> None:
        self.events.append({"ph": "M", "name": "process_name", "pid": rank, "args": {"name": f"rank {rank}"}})
        self.events.append(
            {"ph": "M", "name": "process_sort_index", "pid": rank, "args": {"sort_index": rank}}
        )

    def thread(self, rank: int, name: str) -> int:
        """The thread id of ``name`` in ``rank``'s process, declared when first used."""
        key = (rank, name)
        if key not in self._threads:
            tid = self._threads[key] = 1 + sum(1 for known in self._threads if known[0] == rank)
            self.events.append(
                {"ph": "M", "name": "thread_name", "pid": rank, "tid": tid, "args": {"name": name}}
            )
        return self._threads[key]

    def slice(self, rank: int, thread: str, name: str, start: float, end: float, category: str, args=None):
        """A range of ``rank``'s ``thread`` from ``start`` to ``end`` (seconds since the epoch)."""
        self.events.append(
            {
                "ph": "X",
                "name": name,
                "cat": category,
                "pid": rank,
                "tid": self.thread(rank, thread),
                "ts": round((start - self.origin) * 1e6, 3),
                "dur": round(max(end - start, 0.0) * 1e6, 3),
                "args": args or {},
            }
        )

    def save(self, path, other: dict | None = None) -> Path:
        path = Path(path)
        document = {
            "traceEvents": self.events,
            "displayTimeUnit": "ms",
            "otherData": {"origin_epoch_seconds": self.origin, **(other or {})},
        }
        path.write_text(json.dumps(document))
        return path
