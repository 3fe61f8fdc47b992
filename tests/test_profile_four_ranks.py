"""``--profile`` of a DDP loop on 4 gloo ranks (its own module: its own cluster)."""

from __future__ import annotations

from tests.conftest import running_cluster
from tests.test_profile import check_ddp_cell


def test_ddp_loop_profiled_on_four_lanes(ip, tmp_path):
    with running_cluster(ip, 4):
        check_ddp_cell(ip, 4, tmp_path)
