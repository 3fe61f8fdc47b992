"""The engine side: code that runs in the engine processes (the ranks) and in the zygote that
forks them.

Modules here import :mod:`ddp_magics.protocol` and :mod:`ddp_magics.lifetime` and nothing else
of ddp_magics' notebook side (tests/test_layout.py reads the imports to keep it so).

- :mod:`~ddp_magics.engine.process`: the engine process (``python -m ddp_magics.engine``)
- :mod:`~ddp_magics.engine.zygote`: imports torch once and forks engines
- :mod:`~ddp_magics.engine.rank`: probing an engine, making it a rank, numbering cells
- :mod:`~ddp_magics.engine.recorder`: recording the torch.distributed calls of a cell, with
  :mod:`~ddp_magics.engine.c10d_ops` (the ops and their arguments),
  :mod:`~ddp_magics.engine.call_sites` (who made a call, at which cell line) and
  :mod:`~ddp_magics.engine.tensors` (a call's tensors described)
- :mod:`~ddp_magics.engine.inspector`: where a rank is, answered while it is blocked in C
- :mod:`~ddp_magics.engine.recovery`: cutting a rank's process groups and making them anew
- :mod:`~ddp_magics.engine.debugging`: pdb answered in the notebook, post mortem, snapshots
- :mod:`~ddp_magics.engine.nanny`, :mod:`~ddp_magics.engine.zygote_client`,
  :mod:`~ddp_magics.engine.host`: the engine's nanny, asking the zygote for a process, preparing
  another host
"""
