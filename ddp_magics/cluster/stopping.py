"""Making sure stopped processes end, by PID: the last step of every stop (the ordinary one, a
restart's, and a stray cluster's removal)."""

from __future__ import annotations

import psutil

from ddp_magics.lifetime import kill_now, wait_for_exit

# How long stopping waits for a step that normally takes milliseconds before forcing it.
STOP_GRACE_SECONDS = 0.5
# After SIGKILL, how long a process may take to be gone.
KILLED_EXIT_SECONDS = 3.0


def stop_processes(
    processes: list[psutil.Process], grace: float = STOP_GRACE_SECONDS, timeout: float = KILLED_EXIT_SECONDS
) -> None:
    """Make sure stopped processes exit, by PID: SIGKILL those still running after ``grace``
    seconds (all are ours and hold nothing to save)."""
    kill_now(wait_for_exit(processes, timeout=grace))
    wait_for_exit(processes, timeout=timeout)
