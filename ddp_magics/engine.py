"""Entry point for a rank's engine: ``python -m ddp_magics.engine`` (ipengine's arguments).

The engine exits with its nanny when the kernel that owns the cluster ends. torch takes
seconds to import; starting that import before the engine connects lets it overlap the
engine's own start-up and registration instead of following them.
"""

from ddp_magics.lifetime import watch_owner
from ddp_magics.rank import start_background_import

if __name__ == "__main__":
    watch_owner()
    start_background_import()
    from ipyparallel.engine.app import main

    main()
