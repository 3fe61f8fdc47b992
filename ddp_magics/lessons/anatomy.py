"""The anatomy of a notebook's process group, drawn for lessons 00 and 01.

    from ddp_magics.lessons.anatomy import draw_anatomy
    draw_anatomy(nnodes=1, nproc_per_node=2)

The notebook's kernel sends each ``%%distributed`` cell to ipyparallel's controller, which hands it to one
engine per rank; the engines are the ranks, numbered node after node and, within a node, by local rank; their
process group meets at the store that rank 0 hosts (``MASTER_ADDR:MASTER_PORT``) and moves tensors through the
backend. Deterministic: the same arguments draw the same picture.
"""

from __future__ import annotations


def draw_anatomy(nnodes: int = 1, nproc_per_node: int = 2, accelerator: str = "cpu", backend: str = "gloo"):
    """A matplotlib figure: the kernel, the controller, ``nnodes`` x ``nproc_per_node`` engines (ranks)."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import FancyArrowPatch, FancyBboxPatch

    world = nnodes * nproc_per_node
    engine_w, gap, node_pad = 1.5, 0.25, 0.3
    node_w = nproc_per_node * engine_w + (nproc_per_node - 1) * gap + 2 * node_pad
    width = nnodes * node_w + (nnodes - 1) * 0.6
    figure, ax = plt.subplots(figsize=(max(6.0, 0.95 * width + 1), 4.3))
    span = max(width, 4.6)
    ax.set_xlim(width / 2 - span / 2 - 0.3, width / 2 + span / 2 + 0.3)
    ax.set_ylim(-0.2, 6.2)
    ax.axis("off")

    def box(x, y, w, h, text, face, size=8, weight="normal"):
        ax.add_patch(FancyBboxPatch((x, y), w, h, boxstyle="round,pad=0.04", facecolor=face, edgecolor="0.3"))
        ax.text(x + w / 2, y + h / 2, text, ha="center", va="center", fontsize=size, weight=weight)

    def arrow(start, end, text=None, style="-|>"):
        ax.add_patch(FancyArrowPatch(start, end, arrowstyle=style, mutation_scale=10, color="0.35"))
        if text:
            ax.text((start[0] + end[0]) / 2 + 0.08, (start[1] + end[1]) / 2, text, fontsize=7, color="0.3",
                    va="center")

    middle = width / 2
    box(middle - 1.9, 5.3, 3.8, 0.7, "notebook kernel: your cells, %%distributed", "#fff3cd", 8, "bold")
    box(middle - 1.9, 4.1, 3.8, 0.6, "ipyparallel controller", "#e8e8e8")
    arrow((middle, 5.3), (middle, 4.72), "cell code down, output up", "<|-|>")
    engine_y, engine_h = 1.75, 1.25
    for node in range(nnodes):
        x0 = node * (node_w + 0.6)
        ax.add_patch(FancyBboxPatch((x0, 1.45), node_w, 2.05, boxstyle="round,pad=0.02", facecolor="#f4f8fc",
                                    edgecolor="0.55", linestyle="--"))
        ax.text(x0 + 0.12, 3.3, f"node {node}" if nnodes > 1 else "this machine", fontsize=7, va="center",
                color="0.3")
        for local in range(nproc_per_node):
            rank = node * nproc_per_node + local
            x = x0 + node_pad + local * (engine_w + gap)
            device = f"cuda:{local}" if accelerator == "cuda" else "cpu"
            store = "\nhosts the store" if rank == 0 else ""
            face = "#dcedc8" if rank == 0 else "#e3f2fd"
            label = f"engine\nrank {rank}\nlocal_rank {local}\n{device}{store}"
            box(x, engine_y, engine_w, engine_h, label, face, 7)
            arrow((middle, 4.1), (x + engine_w / 2, engine_y + engine_h + 0.02))
    ax.plot([0.3, width - 0.3], [0.95, 0.95], color="#c62828", linewidth=2.5)
    for node in range(nnodes):
        x0 = node * (node_w + 0.6)
        for local in range(nproc_per_node):
            x = x0 + node_pad + local * (engine_w + gap) + engine_w / 2
            ax.plot([x, x], [engine_y, 0.95], color="#c62828", linewidth=1.2)
    ax.text(middle, 0.3,
            f"process group ({backend}): world_size {world} = {nnodes} node{'s' if nnodes > 1 else ''} x "
            f"{nproc_per_node} per node\nthe ranks meet at rank 0's store (MASTER_ADDR:MASTER_PORT)",
            ha="center", fontsize=7.5, color="#c62828")
    figure.tight_layout()
    return figure
