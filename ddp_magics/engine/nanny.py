"""The engine's nanny: ipyparallel's, which also ends what the engine started.

ipyparallel relays a signal for an engine (``Client.send_signal``) through the engine's nanny,
a process of its own beside the engine. ddp_magics stops and restarts engines with SIGKILL
sent that way; a DataLoader worker or any subprocess a cell started would outlive its engine,
on whatever host it runs. Each engine leads its own process group (``engine.process.run``), so
this nanny sends SIGKILL and SIGTERM to the whole group, and once the engine has exited, for
whatever reason, kills what is left of its group.

    python -m ddp_magics.engine.nanny    # ipyparallel's nanny protocol: arguments pickled on stdin
"""

from __future__ import annotations

import contextlib
import os
import pickle
import signal
import subprocess
import sys

from ipyparallel.engine.nanny import KernelNanny

GROUP_SIGNALS = (signal.SIGKILL, signal.SIGTERM)


class GroupNanny(KernelNanny):
    def signal_request(self, content):
        sig = content["sig"]
        sig = getattr(signal, sig) if isinstance(sig, str) else sig
        if sig in GROUP_SIGNALS and self._engine_leads_its_group():
            os.killpg(self.pid, sig)
            return {"status": "ok"}
        return super().signal_request(content)

    def finish(self):
        if not self._finish_called:
            self._kill_what_the_engine_left()
        super().finish()

    def _engine_leads_its_group(self) -> bool:
        try:
            return os.getpgid(self.pid) == self.pid
        except ProcessLookupError:
            return False

    def _kill_what_the_engine_left(self) -> None:
        # The group outlives its leader while a member lives; the engine's PID names it.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pid, signal.SIGKILL)


def start_group_nanny(**arguments) -> tuple[str, subprocess.Popen]:
    """What ``ipyparallel.engine.nanny.start_nanny`` returns (the URL the engine's control socket
    connects to, the nanny's process), with this module's nanny."""
    process = subprocess.Popen(
        [sys.executable, "-m", __name__],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
        start_new_session=True,  # outside the engine's group, which it may kill
    )
    process.stdin.write(pickle.dumps({**arguments, "pid": os.getpid()}))
    process.stdin.close()
    url = process.stdout.readline().decode().strip()
    if not url:
        process.terminate()
        raise RuntimeError("the engine's nanny did not start")
    return url, process


def main() -> None:
    with os.fdopen(sys.stdin.fileno(), mode="rb") as arguments:
        GroupNanny.main(**pickle.load(arguments), pipe=sys.stdout)


if __name__ == "__main__":
    main()
