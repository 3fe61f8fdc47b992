"""Lesson 06's figure: DDP's backward pass and its bucket all-reduces on a time line, two lanes per rank.

The times come from the lesson's own hooks (``time.monotonic()``, one clock for all processes of a
machine): a tensor hook per layer weight says when autograd computed that layer's gradient, and a
communication hook says when each bucket's all-reduce was launched and when its future completed. nbval
never compares images, and the lesson prints only what does not depend on timing.
"""

from __future__ import annotations


def draw_overlap(timelines: list[dict], title: str = "") -> None:
    """Draw every rank's backward pass (one bar per layer: from the previous gradient to this one) above its
    bucket all-reduces (launch to completion).

    ``timelines[r]`` is rank r's ``{"start": t, "end": t, "grads": [(layer, t), ...],
    "buckets": [(index, launched, done, numel), ...]}``, times in seconds on one clock.
    """
    import matplotlib.pyplot as plt

    t0 = min(timeline["start"] for timeline in timelines)
    fig, ax = plt.subplots(figsize=(9, 0.6 + 1.1 * len(timelines)))
    labels = []
    for r, timeline in enumerate(timelines):
        compute_y, comm_y = 2 * r, 2 * r + 1
        labels += [f"rank {r} backward", f"rank {r} all-reduce"]
        previous = timeline["start"]
        for i, (layer, t) in enumerate(timeline["grads"]):
            ax.broken_barh([(1000 * (previous - t0), 1000 * (t - previous))], (compute_y - 0.35, 0.7),
                           color="#4c72b0" if i % 2 == 0 else "#7fa3d1", edgecolor="white")
            ax.text(1000 * ((previous + t) / 2 - t0), compute_y, layer.replace("layer ", "L"), ha="center",
                    va="center", color="white", fontsize=8)
            previous = t
        count = max(len(timeline["buckets"]), 1)
        height = 0.8 / count  # one thin row per bucket: several can be in flight at once
        for row, (index, launched, done, _) in enumerate(sorted(timeline["buckets"])):
            bottom = comm_y - 0.4 + row * height
            ax.broken_barh([(1000 * (launched - t0), 1000 * (done - launched))], (bottom, height * 0.9),
                           color="#dd8452", edgecolor="white")
            ax.text(1000 * (launched - t0), bottom + height * 0.45, f" b{index}", ha="left", va="center",
                    color="black", fontsize=7)
        ax.axvline(1000 * (timeline["end"] - t0), ymin=0, ymax=1, color="0.4", linestyle=":", linewidth=1)
    ax.set_yticks(range(len(labels)), labels)
    ax.invert_yaxis()
    ax.set_xlabel("milliseconds since the first rank entered backward() (dotted: backward() returned)")
    default = "blue: autograd computes layer L's gradients; orange: bucket b's all-reduce, launch to end"
    ax.set_title(title or default, fontsize=10)
    fig.tight_layout()
    plt.show()
