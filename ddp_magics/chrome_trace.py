"""Chrome-trace JSON (the format Perfetto, ``chrome://tracing`` and HTA read): one process per
rank, named ``rank N``, one thread per kind of work, each range a complete (``"X"``) event with
times in microseconds, as one file or one file per rank. Used by ``Trace.save`` and
``Profile.save``."""

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

    def save(self, path, other: dict | None = None, ranks: dict[int, dict] | None = None) -> Path:
        """``path`` a ``.json`` file: one file, every rank a process. Otherwise a directory (made
        if needed): one file per rank, ``rank_N.json``, with the ``distributedInfo`` the
        profiler's own per-rank export has (``ranks[N]``: its rank, world size and backend), as
        HTA's ``TraceAnalysis(trace_dir=...)`` and Perfetto's multi-file view read them."""
        path = Path(path)
        if path.suffix == ".json" and not path.is_dir():
            path.write_text(json.dumps(self._document(self.events, other)))
            return path
        path.mkdir(parents=True, exist_ok=True)
        for rank, info in (ranks or {}).items():
            events = [event for event in self.events if event.get("pid") == rank]
            document = self._document(events, other)
            document["distributedInfo"] = info
            (path / f"rank_{rank}.json").write_text(json.dumps(document))
        return path

    def _document(self, events: list[dict], other: dict | None) -> dict:
        return {
            "traceEvents": events,
            "displayTimeUnit": "ms",
            "baseTimeNanoseconds": round(self.origin * 1e9),
            "otherData": {"origin_epoch_seconds": self.origin, **(other or {})},
        }
