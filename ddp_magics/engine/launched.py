"""A rank says what it is: a process launched from outside to run code it is sent, as under
torchrun, not a prompt someone types at.

IPython sets ``sys.ps1``, ``sys.ps2`` and ``sys.ps3`` as its shell starts "so that scripts can
decide if they are running interactively" (``InteractiveShell.init_prompts``). Libraries do:
Lightning (``lightning.fabric.utilities.imports._IS_INTERACTIVE``) then refuses
``Fabric(strategy='ddp')`` and picks ``ddp_fork``, which would start processes of its own. The
ranks' shells take no typed input (the notebook's does, and keeps its prompts), so the prompts
are removed on the ranks; IPython's kernel and pdb do not read them.
"""

from __future__ import annotations

import sys

PROMPTS = ("ps1", "ps2", "ps3")


def as_launched_process() -> None:
    """Remove the interactive prompts IPython set in this rank's process."""
    for name in PROMPTS:
        if hasattr(sys, name):
            delattr(sys, name)
