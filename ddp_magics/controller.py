"""Entry point for the cluster's controller: ``python -m ddp_magics.controller`` (ipcontroller's
arguments).

When the kernel that owns the cluster ends, the controller ends its schedulers, waits for the
engines (which watch the kernel too) and removes the cluster's directory.
"""

from ddp_magics.lifetime import watch_owner

if __name__ == "__main__":
    watch_owner(remove_cluster_dir=True)
    from ipyparallel.controller.app import main

    main()
