"""Helpers the lessons use to show what an op does without running it.

    from ddp_magics.lessons import draw_op, simulated_trace, RingStepper
"""

from ddp_magics.lessons.ring_stepper import RingStepper, ring_allreduce_states
from ddp_magics.lessons.simulate import draw_op, simulated_trace

__all__ = ["RingStepper", "draw_op", "ring_allreduce_states", "simulated_trace"]
