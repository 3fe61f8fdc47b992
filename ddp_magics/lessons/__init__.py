"""Helpers the lessons use to show what an op does without running it, and the exercises' verdict.

    from ddp_magics.lessons import draw_op, simulated_trace, RingStepper
    from ddp_magics.lessons.exercises import verdict

The figures (``anatomy.draw_anatomy``, ``ring_stepper.draw_ring_steps``, ``ddp_overlap``) and the checkers'
recorders (``c10d_watch.c10d_watch``: every c10d op at the dispatcher; ``watch.watching``: the
``torch.distributed`` functions called) are imported from their modules. The drawing helpers are
imported when first used, so that a rank that only needs ``verdict`` does not load matplotlib and the
widgets.
"""

from __future__ import annotations

import importlib

_WHERE = {
    "RingStepper": "ddp_magics.lessons.ring_stepper",
    "ring_allreduce_states": "ddp_magics.lessons.ring_stepper",
    "draw_op": "ddp_magics.lessons.simulate",
    "simulated_trace": "ddp_magics.lessons.simulate",
}

__all__ = ["RingStepper", "draw_op", "ring_allreduce_states", "simulated_trace"]


def __getattr__(name: str):
    if name in _WHERE:
        return getattr(importlib.import_module(_WHERE[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
