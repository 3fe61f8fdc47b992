"""Entry point for a rank's engine: ``python -m ddp_magics.engine`` (ipengine's arguments).

torch takes seconds to import; starting that import before the engine connects lets it
overlap the engine's own start-up and registration instead of following them.
"""

from ddp_magics.rank import start_background_import

if __name__ == "__main__":
    start_background_import()
    from ipyparallel.engine.app import main

    main()
