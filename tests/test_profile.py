"""``--profile`` on real gloo clusters: a DDP loop's all-reduces on every lane inside backward,
overlap measured, the saved Chrome trace (one process per rank, clocks aligned), results equal
with and without profiling, ``Trace.save``, a raising cell, and the rank's profiler lines kept
out of the cell's output. (No GPU here: CUDA lanes are untested.)"""

from __future__ import annotations

import json

import pytest
from IPython.core.error import UsageError
from IPython.utils.capture import capture_output
from matplotlib.transforms import Bbox

from ddp_magics.errors import DistributedCellError
from ddp_magics.protocol import COMMUNICATION, COMPUTE
from tests.conftest import run_cell, shown_text

DDP_LOOP = """
import torch.nn as nn
torch.manual_seed(0)
model = nn.Sequential(*[nn.Linear(64, 64) for _ in range(6)])
ddp = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=0.02)
opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
x = torch.randn(16, 64) + rank
for _ in range(3):
    opt.zero_grad()
    ddp(x).pow(2).mean().backward()
    opt.step()
print([round(float(p.sum()), 6) for p in model.parameters()])
"""


def bucket_spans(profile, rank):
    return [s for s in profile.spans[rank] if s.kind == COMMUNICATION and "DDP bucket" in (s.label or "")]


def check_ddp_profile(profile, ranks):
    assert profile.ranks == ranks and not profile.missing
    for rank in ranks:
        buckets = bucket_spans(profile, rank)
        assert len({s.label for s in buckets}) >= 2, "small buckets: several all-reduces per step"
        backward = [s for s in profile.spans[rank] if s.kind == COMPUTE and "evaluate_function" in s.name]
        launches = [
            s for s in profile.spans[rank] if s.name == "c10d::allreduce_" and "DDP bucket" in s.label
        ]
        assert launches and len(launches) == len(buckets)
        for launch in launches:  # DDP's reducer queues each bucket from inside backward
            assert any(b.start <= launch.start <= b.end for b in backward), launch
        row = profile.summary()[rank]
        assert 0.0 <= row["overlap"] <= 1.0
        assert row["communication"] > 0 and row["compute"] > 0
        assert abs(row["overlapped"] + row["exposed"] - row["communication"]) < 1e-9
        assert row["clock_offset"] is None  # one host, one clock
    # Each bucket's all-reduce is running on every rank at once: the clocks are aligned.
    counts = {len(bucket_spans(profile, rank)) for rank in ranks}
    assert len(counts) == 1
    for index in range(counts.pop()):
        same = [bucket_spans(profile, rank)[index] for rank in ranks]
        assert max(s.start for s in same) <= min(s.end for s in same), same


def test_ddp_loop_profiled_on_every_lane(ip, cluster, tmp_path):
    check_ddp_cell(ip, 2, tmp_path)


def check_ddp_cell(ip, world, tmp_path):
    captured, error = run_cell(ip, "--profile prof", DDP_LOOP)
    assert error is None, error
    profile = ip.user_ns["prof"]
    check_ddp_profile(profile, list(range(world)))
    text = captured.stdout + shown_text(captured)
    assert f"Profile of ranks {'0,1' if world == 2 else '0-3'}" in text
    assert "overlapped" in text and "all_reduce SUM (DDP bucket 0), line 9" in text
    assert "USDT" not in text and "profiler_st" not in text  # kineto's lines stay out
    diagram = profile.draw()
    bars = [bar.get_gid() for bar in diagram.figure.axes[0].collections]
    assert [gid for gid in bars if gid.startswith("communication:")] == [
        f"communication:{rank}" for rank in range(world)
    ]
    assert any(gid.startswith("label:") for gid in diagram.gids("label:"))

    saved = json.loads(profile.save(tmp_path / "profile.json").read_text())
    names = {e["pid"]: e["args"]["name"] for e in saved["traceEvents"] if e["name"] == "process_name"}
    assert names == {rank: f"rank {rank}" for rank in range(world)}
    slices = [e for e in saved["traceEvents"] if e["ph"] == "X"]
    assert {e["pid"] for e in slices} == set(range(world))
    reduces = {
        rank: [
            e
            for e in slices
            if e["pid"] == rank and e["cat"] == COMMUNICATION and "DDP bucket 0" in e["args"].get("call", "")
        ]
        for rank in range(world)
    }
    first = [events[0] for events in reduces.values()]  # one clock in the file too
    assert max(e["ts"] for e in first) <= min(e["ts"] + e["dur"] for e in first)
    # The backend's own names stay, for the tools that look for them; ours are in args.
    assert {e["name"] for e in first} == {"gloo:all_reduce"}
    check_per_rank_files(profile, tmp_path / "profile", world)


def check_per_rank_files(saved, directory, world):
    """A directory: one file per rank with distributedInfo, which HTA loads as every rank."""
    saved.save(directory)
    for rank in range(world):
        document = json.loads((directory / f"rank_{rank}.json").read_text())
        assert document["distributedInfo"] == {"rank": rank, "world_size": world, "backend": "gloo"}
        assert {e["pid"] for e in document["traceEvents"]} == {rank}
    hta = pytest.importorskip("hta.trace_analysis")
    analysis = hta.TraceAnalysis(trace_dir=str(directory))
    assert sorted(analysis.t.get_ranks()) == list(range(world))
    names = analysis.t.symbol_table.get_sym_table()
    assert any(name.startswith("gloo:") or name.startswith("all_reduce") for name in names)


STEPS = """
import torch.nn as nn
torch.manual_seed(0)
layers = nn.Sequential(*[nn.Linear(64, 64) for _ in range(8)])
ddp = nn.parallel.DistributedDataParallel(layers, bucket_cap_mb=0.01)
for step in range(4):
    with torch.profiler.record_function(f"step {step}"):
        ddp(torch.randn(16, 64)).sum().backward()
"""


def test_the_picture_marks_steps_and_its_names_never_overlap(ip, cluster):
    """The loop's record_function ranges are dashed step marks; a busy lane's names (8 buckets
    a step) are written where they overlap no other name, measured as drawn."""
    _, error = run_cell(ip, "--profile steps", STEPS)
    assert error is None, error
    profile = ip.user_ns["steps"]
    for rank in (0, 1):
        assert [s.name for s in profile.spans[rank] if s.kind == "mark"] == [f"step {n}" for n in range(4)]
    diagram = profile.draw()
    assert "step marks (dashed): step 0, step 1, step 2, step 3, 4 on rank 0" in diagram.text
    figure = diagram.figure
    marks = {c.get_gid(): len(c.get_segments()) for c in figure.axes[0].collections if "marks" in c.get_gid()}
    assert marks == {"marks:0": 4, "marks:1": 4}
    renderer = figure.canvas.get_renderer()
    texts = [t for t in figure.axes[0].texts if (t.get_gid() or "").startswith(("label:", "marklabel:"))]
    # Text boxes include the line's leading: 2 pixels off the top and bottom are never ink.
    boxes = [t.get_window_extent(renderer) for t in texts]
    boxes = [Bbox.from_extents(b.x0, b.y0 + 2, b.x1, b.y1 - 2) for b in boxes]
    assert len(texts) > 8
    overlapping = [
        (texts[i].get_text(), texts[j].get_text())
        for i in range(len(boxes))
        for j in range(i + 1, len(boxes))
        if boxes[i].overlaps(boxes[j])
    ]
    assert not overlapping
    assert profile.summary()[0]["compute"] > 0  # marks are not work


def test_results_equal_with_and_without_profile(ip, cluster):
    plain, error = run_cell(ip, "", DDP_LOOP)
    assert error is None, error
    profiled, error = run_cell(ip, "--profile prof --trace tr", DDP_LOOP)
    assert error is None, error
    weights = shown_text(plain).strip()
    assert weights and weights in shown_text(profiled)
    assert ip.user_ns["tr"].steps and ip.user_ns["prof"].ranks == [0, 1]  # the two combine


def test_trace_save(ip, cluster, tmp_path):
    _, error = run_cell(
        ip, "--trace tr", "t = torch.tensor([rank + 1.0])\ndist.all_reduce(t)\ndist.broadcast(t, src=1)"
    )
    assert error is None, error
    saved = json.loads(ip.user_ns["tr"].save(tmp_path / "trace.json").read_text())
    names = {e["pid"]: e["args"]["name"] for e in saved["traceEvents"] if e["name"] == "process_name"}
    assert names == {0: "rank 0", 1: "rank 1"}
    calls = [e for e in saved["traceEvents"] if e["ph"] == "X" and e["pid"] == 0]
    assert [e["name"] for e in calls] == ["all_reduce", "broadcast"]
    assert calls[0]["args"]["before"] == "[1.0]" and calls[0]["args"]["after"] == "[3.0]"
    assert calls[1]["args"]["call"] == "broadcast from rank 1 on ranks 0,1"
    assert calls[0]["dur"] >= 0 and calls[1]["ts"] >= calls[0]["ts"]
    check_per_rank_files(ip.user_ns["tr"], tmp_path / "trace", 2)


def test_raising_cell_keeps_its_profile(ip, healthy):
    cell = "t = torch.ones(4)\ndist.all_reduce(t)\nif rank == 1:\n    raise ValueError('boom')\nprint('fine')"
    _, error = run_cell(ip, "--profile prof", cell)
    assert isinstance(error, DistributedCellError)
    assert "boom" in str(error.render() if hasattr(error, "render") else error) or "ValueError" in str(error)
    profile = ip.user_ns["prof"]
    assert profile.ranks == [0, 1]
    for rank in (0, 1):
        assert any(s.label and s.label.startswith("all_reduce") for s in profile.spans[rank])


def test_profile_name_checked(ip, cluster):
    _, error = run_cell(ip, "--profile 1x", "pass")
    assert error is not None and "--profile" in str(error)


def test_status_shows_each_ranks_unique_and_proportional_memory(ip, cluster):
    """Ranks forked from one zygote share its pages: resident memory counts them once per rank,
    so the table shows what only each rank uses (USS) and its share of the rest (PSS)."""
    table = ip.run_line_magic("dist_status", "")
    assert table.columns == ("rank", "host", "pid", "device", "state")  # rows as before
    header, *rows = repr(table).splitlines()[1:]
    assert header.split()[-2:] == ["unique", "pss"] and "cuda" not in header  # no GPU here
    for rank, row in zip((0, 1), rows):
        memory = table.memory[rank]
        assert 0 < memory.unique < memory.proportional < memory.resident < 8 << 30
        assert row.endswith(f"{memory.unique / (1 << 20):.1f} MiB  {memory.proportional / (1 << 20):.1f} MiB")
    together = sum(table.memory[rank].proportional for rank in (0, 1)) / (1 << 20)
    assert f"pss add up to what they take together ({together:.1f} MiB here)" in repr(table)
    assert "unique: memory only this rank&#x27;s process uses" in table._repr_html_()


def test_hanging_cell_reports_as_before_and_keeps_the_finished_ranks_profiles(ip, healthy):
    cell = "t = torch.ones(4)\ndist.all_reduce(t)\nif rank == 1:\n    dist.recv(t, src=0)"
    _, error = run_cell(ip, "--profile prof --timeout 3", cell)
    assert isinstance(error, DistributedCellError)
    assert "rank 1" in str(error) and "recv from rank 0" in str(error)  # where it waits, as traced
    profile = ip.user_ns["prof"]
    assert profile.ranks == [0] and profile.missing == [1]
    assert any(s.label and s.label.startswith("all_reduce") for s in profile.spans[0])
    assert "rank 1: no profile (still running or died)" in profile.text()


def test_a_profile_that_cannot_start_says_so_in_one_line(ip, healthy):
    run_cell(ip, "", "dist.destroy_process_group()")
    try:
        _, error = run_cell(ip, "--profile prof", "print(rank)")
        assert isinstance(error, UsageError)
        assert str(error).startswith("--profile: tracing could not start (rank 0: ValueError:")
        assert "\n" not in str(error)
    finally:
        with capture_output():
            ip.run_line_magic("dist_restart", "")


def test_profile_of_some_ranks_only(ip, cluster):
    _, error = run_cell(ip, "--ranks 1 --profile prof", "x = torch.randn(64, 64) @ torch.randn(64, 64)")
    assert error is None, error
    profile = ip.user_ns["prof"]
    assert profile.ranks == [1] and not profile.missing
    row = profile.summary()[1]
    assert row["compute"] > 0 and row["communication"] == 0 and row["overlap"] is None
    assert any(name == "aten::mm" for name, _, _ in row["top_ops"])
    assert "rank 1: wall" in profile.text() and "no communication" in profile.text()


def test_ranges_left_out_beyond_the_limit_are_said():
    """A rank keeps at most MAX_SLICES ranges per cell: the summary says how many more there were."""
    from ddp_magics.profile import Profile
    from ddp_magics.protocol import ProfiledSlice, RankProfile

    kept = (ProfiledSlice("aten::mm", 10.0, 10.5, 1, COMPUTE),)
    profiles = {
        0: RankProfile(0, kept, (("aten::mm", 1, 0.5),), 10.0, 11.0, left_out=7),
        1: RankProfile(1, kept, (("aten::mm", 1, 0.5),), 10.0, 11.0),
    }
    text = Profile(profiles, {0: None, 1: None}).text()
    assert "  7 more ranges not kept (a rank keeps its first 1)" in text, text
    assert text.count("more ranges not kept") == 1, text
