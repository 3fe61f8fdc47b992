"""A rank's engine process: ``python -m ddp_magics.engine`` (ipengine's arguments) runs :func:`run`.

Engines forked by the cluster's zygote (:mod:`ddp_magics.engine.zygote`) call :func:`run` too.
"""

import faulthandler
import os
import sys
from pathlib import Path

from traitlets.config import Config

from ddp_magics.engine.nanny import start_group_nanny
from ddp_magics.engine.rank import start_background_import
from ddp_magics.engine.zygote_client import ZYGOTE_SOCKET_ENV, fork_nanny
from ddp_magics.lifetime import watch_owner


def run(argv: list[str] | None = None) -> None:
    """Run an ipyparallel engine (until it stops) that exits with its nanny when the kernel that
    owns the cluster ends. torch takes seconds to import; starting that import before the engine
    connects lets it overlap the engine's own start-up and registration."""
    if argv is not None:
        sys.argv = ["ddp_magics.engine", *argv]
    if os.getpgrp() != os.getpid():  # forked by a zygote, it leads a session of its own already
        os.setpgid(0, 0)  # its nanny ends the group: what a cell started ends with the engine
    watch_owner()
    # A crash leaves its stack in the engine's log: a descriptor of its own, as the kernel soon
    # sends fd 2 to the cell's output (which dies with the process).
    faulthandler.enable(file=os.dup(2), all_threads=True)
    start_background_import()
    _engine_class().launch_instance()


def _engine_class():
    """ipyparallel's engine with ddp_magics' nanny (:mod:`ddp_magics.engine.nanny`), which a
    zygote that forked the engine forks too."""
    from ipyparallel.engine.app import IPEngine

    zygote = os.environ.get(ZYGOTE_SOCKET_ENV)

    class GroupNannyEngine(IPEngine):
        def start_nanny(self, control_url):
            """ipyparallel's own arguments for the nanny (as in ``IPEngine.start_nanny``)."""
            config = Config()
            config.Session = self.config.Session
            arguments = dict(
                engine_id=self.id,
                identity=self.bident,
                control_url=control_url,
                curve_serverkey=self.curve_serverkey,
                curve_secretkey=self.curve_secretkey,
                curve_publickey=self.curve_publickey,
                registration_url=self.registration_url,
                config=config,
            )
            if zygote:
                return fork_nanny(Path(zygote), arguments)
            return start_group_nanny(**arguments)

    return GroupNannyEngine
