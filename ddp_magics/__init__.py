"""ddp_magics: run cells on the ranks of a real torch.distributed process group.

%load_ext ddp_magics
%dist_start -n 2
"""

__version__ = "0.1.0"


def load_ipython_extension(ipython) -> None:
    from ddp_magics.magics import DistributedMagics

    magics = DistributedMagics(shell=ipython)
    ipython.register_magics(magics)  # Magics(shell=...) already joined shell.configurables
    from ddp_magics.reports import stray_clusters_stopped

    stray_clusters_stopped()


def unload_ipython_extension(ipython) -> None:
    from ddp_magics.magics import DistributedMagics

    for magics in [m for m in ipython.configurables if isinstance(m, DistributedMagics)]:
        magics.shutdown()
        while magics in ipython.configurables:
            ipython.configurables.remove(magics)
        for kind, names in magics.magics.items():
            for name in names:
                ipython.magics_manager.magics[kind].pop(name, None)
        ipython.magics_manager.registry.pop(type(magics).__name__, None)
