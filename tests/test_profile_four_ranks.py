"""``--profile`` on 4 gloo ranks (its own module: its own cluster): a DDP loop, and a 2 x 2
DeviceMesh whose dimensions are named in the trace's events, its picture, the profile and the
saved file."""

from __future__ import annotations

import json

import pytest

from tests.conftest import run_cell, running_cluster
from tests.test_profile import check_ddp_cell

MESH = """
from torch.distributed.device_mesh import init_device_mesh
mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
t = torch.ones(2)
dist.all_reduce(t, group=mesh.get_group("tp"))
dist.all_reduce(t, group=mesh.get_group("dp"))
"""


@pytest.fixture(scope="module")
def cluster4(ip):
    with running_cluster(ip, 4) as magics:
        yield magics


def test_ddp_loop_profiled_on_four_lanes(ip, cluster4, tmp_path):
    check_ddp_cell(ip, 4, tmp_path)


def test_mesh_dimensions_named(ip, cluster4, tmp_path):
    _, error = run_cell(ip, "--profile prof --trace tr", MESH)
    assert error is None, error
    trace, profile = ip.user_ns["tr"], ip.user_ns["prof"]
    reduces = [e for e in trace.events[0] if e.op == "all_reduce"]
    assert [e.mesh_dim for e in reduces] == ["tp", "dp"]
    assert [e.group for e in reduces] == [(0, 1), (0, 2)]
    listing = trace.text()  # the listing names the dimension too, as the picture and the profile do
    assert "all_reduce SUM on tp ranks 0,1" in listing and "all_reduce SUM on dp ranks 0,2" in listing
    boxes = [artist.get_text() for artist in trace.draw().figure.axes[0].texts]
    assert any("[tp]" in text for text in boxes) and any("[dp]" in text for text in boxes)
    labels = [s.label for s in profile.spans[0] if s.label and s.label.startswith("all_reduce")]
    assert "all_reduce SUM on tp ranks 0,1" in labels and "all_reduce SUM on dp ranks 0,2" in labels
    assert "all_reduce SUM [tp], line 4" in profile.draw().text
    saved = json.loads(profile.save(tmp_path / "mesh.json").read_text())
    dims = {e["args"].get("mesh_dim") for e in saved["traceEvents"] if e["ph"] == "X" and e["pid"] == 3}
    assert {"tp", "dp"} <= dims
    saved = json.loads(trace.save(tmp_path / "trace.json").read_text())
    assert [e["args"].get("mesh_dim") for e in saved["traceEvents"] if e["ph"] == "X" and e["pid"] == 1][
        -2:
    ] == [
        "tp",
        "dp",
    ]
