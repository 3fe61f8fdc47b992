"""The cluster, live, for JupyterLab's extension: its state sent over a comm.

The kernel opens one comm (target ``ddp_magics.cluster``) when the extension is loaded, and sends
on it the cluster's state: after every cell (IPython's ``post_run_cell``), and while a
``%%distributed`` cell runs, at each tick of the live view (at most every ``MIN_SECONDS``). A
front end without the extension ignores the comm; nbval and nbclient see no output of it. The
extension's panel acts with the magics themselves (it executes ``%dist_recover``...), so this
module only tells.

A state is plain JSON: ``backend``, ``world_size``, ``state`` (``none``, ``idle``, ``busy``,
``hung``, ``broken``), ``default_world_size``, and one row per rank (host, PID, device, state
``idle``/``running``/``hung``/``released``/``dead``, what it runs or where it waits and at which
line, memory unique and pss in bytes). It goes under the key ``cluster``: a top-level ``state``
would be read by nbclient as a widget's state.
"""

from __future__ import annotations

import contextlib
import time

from ddp_magics.stacks import BlockedRank

TARGET = "ddp_magics.cluster"
MIN_SECONDS = 0.25
# While a cell runs and the extension listens: from this many seconds on, every so many seconds,
# the ranks still running are asked where they are (their stacks, as the cell's report reads them).
WHERE_AFTER_SECONDS, WHERE_EVERY_SECONDS, WHERE_WAIT_SECONDS = 2.0, 2.0, 0.5


class ClusterChannel:
    """The comm to the extension, and what the magics tell it."""

    def __init__(self, magics) -> None:
        self.magics = magics
        self._comm = None
        self._sent_at = 0.0
        self._where: dict[int, dict] = {}  # rank -> where it waits, from the last cell's outcome
        self._listening = False  # the extension answered the comm's opening
        self._cell = ""  # the running cell's code, to read a rank's line from its stack
        self._asked_at = 0.0
        self._running_where: dict[int, dict] = {}
        self._memory: dict = {}  # rank -> its memory when last read

    # ------------------------------------------------------------------ the comm
    def open(self) -> None:
        if self._comm is not None or getattr(self.magics.shell, "kernel", None) is None:
            return
        try:
            from comm import create_comm

            self._comm = create_comm(target_name=TARGET, data={"cluster": self.state()})
            self._comm.on_msg(self._from_front_end)
        except Exception:  # no comm machinery: the extension just shows nothing
            self._comm = None
            return
        self.magics.shell.events.register("post_run_cell", self._after_cell)

    def close(self) -> None:
        if self._comm is None:
            return
        self.magics.shell.events.unregister("post_run_cell", self._after_cell)
        self.send({"state": "none", "world_size": 0, "ranks": [], "backend": None})
        self._comm.close()
        self._comm = None

    def send(self, state: dict) -> None:
        if self._comm is not None:
            self._comm.send({"cluster": state})  # never a top-level "state": nbclient reads it as a widget's
            self._sent_at = time.monotonic()

    def _from_front_end(self, message: dict) -> None:
        data = message.get("content", {}).get("data", {})
        if isinstance(data, dict) and data.get("listening"):
            self._listening = True

    def _after_cell(self, result=None) -> None:
        with contextlib.suppress(Exception):  # never an error in a cell's output for the panel's sake
            self.send(self.state())

    # ------------------------------------------------------------------ what is sent
    def cell_ended(self, outcome) -> None:
        """Keep where the cell left each rank that did not finish (hung, stopped, released)."""
        self._where = {}
        for blocked, how in [(outcome.blocked, "hung"), (outcome.released, "released")]:
            for item in blocked:
                self._where[item.rank] = {
                    "how": "stopped" if how == "hung" and outcome.ended == "interrupt" else how,
                    "line": item.cell_line,
                    "code": item.source_line,
                    "call": item.traced_call or item.dist_call,
                    "text": item.where(),
                }

    def cell_started(self, cell: str) -> None:
        self._cell, self._running_where, self._asked_at, self._where = cell, {}, 0.0, {}

    def tick(self, pending: list[int], elapsed: float) -> None:
        """A ``%%distributed`` cell is running: the ranks in ``pending`` have not finished."""
        if self._comm is None or time.monotonic() - self._sent_at < MIN_SECONDS:
            return
        if self._listening and elapsed >= WHERE_AFTER_SECONDS:
            self._ask_where(pending)
        self.send(self.state(running=(set(pending), elapsed)))

    def _ask_where(self, pending: list[int]) -> None:
        """Where each rank still running is now (its stack, read as a cell's report reads it)."""
        if time.monotonic() - self._asked_at < WHERE_EVERY_SECONDS or self.magics.cluster is None:
            return
        self._asked_at = time.monotonic()
        try:
            found = self.magics.cluster.inspect(
                sorted(pending), wait=WHERE_WAIT_SECONDS, patience=WHERE_WAIT_SECONDS
            )
        except Exception:  # the cell's own wait goes on; the panel just knows less
            return
        for rank, inspection in found.items():
            blocked = BlockedRank.from_dump(rank, inspection.stack, self._cell)
            if blocked.cell_line is not None:
                self._running_where[rank] = {
                    "how": "running",
                    "line": blocked.cell_line,
                    "code": blocked.source_line,
                    "call": blocked.dist_call,
                    "text": blocked.where(),
                }

    def state(self, running: tuple[set[int], float] | None = None) -> dict:
        magics = self.magics
        cluster = magics.cluster
        default = getattr(magics, "default_world_size", None)
        if cluster is None:
            return {
                "state": "none",
                "backend": None,
                "world_size": 0,
                "ranks": [],
                "default_world_size": default,
            }
        try:
            statuses = cluster.status()
            busy = set(running[0]) if running else set(cluster.busy_ranks())
            memory = {} if running else cluster.memory(sorted(busy))
        except Exception as error:  # a cluster half stopped: say so, never fail the cell
            return {
                "state": "broken",
                "backend": cluster.backend,
                "world_size": cluster.n,
                "ranks": [],
                "default_world_size": default,
                "problem": str(error),
            }
        rows = []
        for status in statuses:
            info = status.info
            where = self._where.get(info.rank)
            if not status.alive:
                state, doing = "dead", "its process ended"
            elif running and info.rank in busy and info.rank in self._running_where:
                where = self._running_where[info.rank]
                state, doing = "running", f"{where['text']} ({running[1]:.0f} s)"
            elif running and info.rank in busy:
                state, doing = "running", f"running the cell ({running[1]:.0f} s)"
            elif info.rank in busy and where:
                state, doing = where["how"], where["text"]
            elif info.rank in busy:
                state, doing = "running", "running"
            else:
                state, doing = "idle", ""
            if memory:
                self._memory[info.rank] = memory.get(info.rank)
            found = self._memory.get(info.rank)  # while a cell runs: as it was before it
            rows.append(
                {
                    "rank": info.rank,
                    "host": info.host,
                    "pid": info.pid,
                    "device": info.device,
                    "state": state,
                    "doing": doing,
                    "line": where["line"] if where and state in ("hung", "stopped", "running") else None,
                    "code": where["code"] if where and state in ("hung", "stopped", "running") else None,
                    "unique": getattr(found, "unique", None),
                    "pss": getattr(found, "proportional", None),
                    "resident": getattr(found, "resident", None),
                }
            )
        if cluster.broken:
            overall = "broken"
        elif running:
            overall = "busy"
        elif any(row["state"] in ("hung", "stopped") for row in rows):
            overall = "hung"
        elif busy:
            overall = "busy"
        else:
            overall = "idle"
        return {
            "state": overall,
            "backend": cluster.backend,
            "world_size": cluster.n,
            "ranks": rows,
            "default_world_size": default,
        }
