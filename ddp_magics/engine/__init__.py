"""The engine side: code that runs in the engine processes (the ranks) and in the zygote that
forks them.

Modules here import :mod:`ddp_magics.protocol` and :mod:`ddp_magics.lifetime` and nothing else
of ddp_magics' notebook side (tests/test_layout.py reads the imports to keep it so).

- :mod:`~ddp_magics.engine.process`: the engine process (``python -m ddp_magics.engine``)
- :mod:`~ddp_magics.engine.zygote`: imports torch once and forks engines
- :mod:`~ddp_magics.engine.rank`: probing an engine, making it a rank, numbering cells
- :mod:`~ddp_magics.engine.recorder`: recording the torch.distributed calls of a cell
"""
