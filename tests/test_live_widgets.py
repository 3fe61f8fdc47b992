"""A widget a rank displays (a tqdm bar) shows while the cell runs, and moves: ipyparallel
forwards its model's updates as they happen, and the magic displays its view as the rank sends
it, not at the cell's end. On a real kernel with 2 gloo ranks, read as a front end reads it."""

from __future__ import annotations

import pytest

from tests.conftest import assert_gone, start_kernel_with_cluster

WIDGET = "application/vnd.jupyter.widget-view+json"
STEPS = 6


@pytest.fixture(scope="module")
def kernel():
    manager, client, processes, _ = start_kernel_with_cluster(2)
    yield client
    client.stop_channels()
    manager.shutdown_kernel(now=True)
    assert_gone(processes)


def test_a_tqdm_bar_on_the_ranks_is_shown_while_it_moves(kernel):
    messages = []
    cell = (
        "%%distributed\nfrom tqdm.auto import tqdm\nimport time\n"
        f"for step in tqdm(range({STEPS}), desc='steps'):\n    time.sleep(0.4)\nprint('done', rank)"
    )
    reply = kernel.execute_interactive(cell, timeout=120, output_hook=messages.append)
    assert reply["content"]["status"] == "ok"
    kinds = [m["msg_type"] for m in messages]
    bars = [
        index
        for index, m in enumerate(messages)
        if m["msg_type"] == "display_data"
        and m["content"]["data"].get(WIDGET, {}).get("model_id")
        and "steps" in m["content"]["data"].get("text/plain", "")
    ]
    assert len(bars) == 2, kinds  # one bar per rank, each shown once
    last_update = max(
        index
        for index, m in enumerate(messages)
        if m["msg_type"] == "comm_msg" and f"{STEPS}/{STEPS}" in str(m["content"]["data"].get("state", {}))
    )
    assert max(bars) < last_update, "the bars were shown only after they had finished"
    text = "".join(m["content"].get("text", "") for m in messages if m["msg_type"] == "stream")
    text += "".join(
        m["content"]["data"].get("text/plain", "") for m in messages if m["msg_type"] == "display_data"
    )
    assert "done 0" in text and "done 1" in text
