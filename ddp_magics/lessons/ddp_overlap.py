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

    ``timelines[i]`` is one rank's run: ``{"start": t, "end": t, "grads": [(layer, t), ...],
    "buckets": [(index, launched, done, numel), ...]}``, times in seconds on one clock, with an optional
    ``"label"`` for its lanes (default ``rank i``) and ``"run"``: timelines of the same run share a time
    origin (their earliest start), so that runs made one after the other are drawn one under the other on one
    scale.
    """
    import matplotlib.pyplot as plt

    origins: dict = {}
    for timeline in timelines:
        run = timeline.get("run")
        origins[run] = min(origins.get(run, timeline["start"]), timeline["start"])
    span = max(timeline["end"] - origins[timeline.get("run")] for timeline in timelines)
    fig, ax = plt.subplots(figsize=(9, 0.9 + 1.1 * len(timelines)))
    labels = []
    for r, timeline in enumerate(timelines):
        t0 = origins[timeline.get("run")]
        compute_y, comm_y = 2 * r, 2 * r + 1
        name = timeline.get("label", f"rank {r}")
        labels += [f"{name} backward", f"{name} all-reduce"]
        if r and timeline.get("run") != timelines[r - 1].get("run"):
            ax.axhline(compute_y - 0.5, color="0.3", linewidth=0.8)  # a new run starts below this line
        previous = timeline["start"]
        for i, (layer, t) in enumerate(timeline["grads"]):
            ax.broken_barh([(1000 * (previous - t0), 1000 * (t - previous))], (compute_y - 0.35, 0.7),
                           color="#4c72b0" if i % 2 == 0 else "#7fa3d1", edgecolor="white")
            short = layer.replace("layer ", "L")
            if t - previous > 0.04 * span:  # wide enough for its name inside
                ax.text(1000 * ((previous + t) / 2 - t0), compute_y, short, ha="center", va="center",
                        color="white", fontsize=8)
            else:  # a narrow bar: its name just above it, in black
                ax.text(1000 * ((previous + t) / 2 - t0), compute_y - 0.37, short, ha="center", va="bottom",
                        color="black", fontsize=7)
            previous = t
        count = max(len(timeline["buckets"]), 1)
        height = 0.8 / count  # one thin row per bucket: several can be in flight at once
        for row, (index, launched, done, _) in enumerate(sorted(timeline["buckets"])):
            bottom = comm_y - 0.4 + row * height
            ax.broken_barh([(1000 * (launched - t0), 1000 * (done - launched))], (bottom, height * 0.9),
                           color="#dd8452", edgecolor="white")
            ax.text(1000 * (launched - t0), bottom + height * 0.45, f" b{index}", ha="left", va="center",
                    color="black", fontsize=7)
        ax.plot([1000 * (timeline["end"] - t0)] * 2, [compute_y - 0.5, comm_y + 0.5], color="0.4",
                linestyle=":", linewidth=1)
    ax.set_yticks(range(len(labels)), labels)
    ax.set_ylim(len(labels) - 0.5, -0.5)
    ax.set_xlim(0, 1000 * span * 1.02)
    ax.set_xlabel("milliseconds since the first rank of the run entered backward() (dotted: the step's end)")
    default = "blue: autograd computes layer L's gradients; orange: bucket b's all-reduce, launch to end"
    ax.set_title(title or default, fontsize=10)
    fig.tight_layout()
    plt.show()
