"""``python -m ddp_magics.engine`` (ipengine's arguments): one rank's engine."""

from ddp_magics.engine.process import run

run()
