"""The rank view's record (ddp_magics.lab_bundle), where cell_view.show() puts it, and the cluster's
state the comm sends (ddp_magics.lab_comm): plain data, without a cluster."""

from __future__ import annotations

import json
from types import SimpleNamespace

from IPython.utils.capture import capture_output

from ddp_magics import cell_view, lab_bundle, lab_comm
from ddp_magics.cell_run import CellOutcome
from ddp_magics.cluster.records import RankFailure, RankInfo, RankOutput, RankStatus
from ddp_magics.stacks import BlockedRank

HTML = {"data": {"text/html": "<b>figure</b>", "text/plain": "<figure>"}, "metadata": {}}


def outcome(**changes) -> CellOutcome:
    fields = dict(
        ranks=[0, 1, 2, 3], ended="done", timeout=60, outputs=[], failures=[], dead=[], deaths=[],
        blocked=[], trace=None,
    )
    return CellOutcome(**{**fields, **changes})


def test_each_rank_its_state_and_identical_ranks_one_group():
    outputs = [RankOutput(rank=r, stdout="same\n") for r in range(4)]
    failure = RankFailure(rank=1, ename="ValueError", evalue="bad", traceback="...")
    hung = BlockedRank(rank=2, cell_line=3, source_line="dist.recv(t, src=1)", dist_call="recv")
    view = lab_bundle.rank_view(
        outcome(outputs=outputs, failures=[failure], blocked=[hung], dead=[3], ended="timeout"), True, 200
    )
    states = {record["rank"]: record["state"] for record in view["ranks"]}
    assert states == {0: "finished", 1: "raised", 2: "hung", 3: "dead"}
    assert view["ranks"][1]["error"] == {"ename": "ValueError", "evalue": "bad"}
    assert view["ranks"][2]["where"] == {
        "line": 3, "code": "dist.recv(t, src=1)", "call": "recv", "text": "in recv at cell line 3"
    }
    assert [group["label"] for group in view["groups"]] == ["rank 0", "rank 1", "rank 2", "rank 3"]
    same = lab_bundle.rank_view(outcome(outputs=outputs), True, 200)
    assert same["groups"] == [{"ranks": [0, 1, 2, 3], "label": "ranks 0-3"}]
    apart = lab_bundle.rank_view(outcome(outputs=outputs), False, 200)
    assert len(apart["groups"]) == 4
    json.dumps(view)  # plain JSON


def test_output_is_cut_as_the_text_is_and_big_displays_stay_below():
    long = "".join(f"line {i}\n" for i in range(500))
    view = lab_bundle.rank_view(outcome(ranks=[0], outputs=[RankOutput(rank=0, stdout=long)]), True, 10)
    assert view["ranks"][0]["stdout"].startswith("... 490 earlier lines not shown ...")
    big = {"data": {"image/png": "x" * (lab_bundle.MAX_DISPLAY_BYTES + 1)}, "metadata": {}}
    view = lab_bundle.rank_view(outcome(ranks=[0], outputs=[RankOutput(rank=0, displays=[big])]), True, 10)
    assert view["displays_below"] and view["ranks"][0]["displays"] == []
    assert view["ranks"][0]["displays_below"] == 1


def test_show_adds_the_record_to_the_first_block_only(ip):
    outputs = [RankOutput(rank=0, stdout="a\n", displays=[HTML]), RankOutput(rank=1, stdout="b\n")]
    with capture_output() as shown:
        cell_view.show(outcome(ranks=[0, 1], outputs=outputs), True, 200, diagram=False)
    first, figure, second = shown.outputs
    assert lab_bundle.MIMETYPE in first.data
    assert first.data[lab_bundle.MIMETYPE]["ranks"][0]["displays"] == [HTML]
    assert lab_bundle.MIMETYPE not in figure.data and lab_bundle.MIMETYPE not in second.data
    assert figure.metadata == second.metadata == lab_bundle.SHOWN_IN_RANK_VIEW
    # The rest of the bundle is that of the blocks as the magic showed them before.
    blocks = [item for item in cell_view.render(outputs, True, 200) if not isinstance(item, dict)]
    before = [ip.display_formatter.format(block)[0] for block in blocks]
    assert {k: v for k, v in first.data.items() if k != lab_bundle.MIMETYPE} == before[0]
    assert second.data == before[1] and first.data["text/plain"] == repr(blocks[0])


def test_the_cluster_state_names_each_rank_and_where_it_waits():
    infos = [RankInfo(rank=r, engine_id=r, host="h", pid=100 + r, local_rank=r, device="cpu") for r in (0, 1)]
    cluster = SimpleNamespace(
        backend="gloo", n=2, broken=None,
        status=lambda: [RankStatus(info=info, alive=True) for info in infos],
        busy_ranks=lambda: [0],
        memory=lambda busy: {},
    )
    magics = SimpleNamespace(shell=None, cluster=cluster, default_world_size=None)
    channel = lab_comm.ClusterChannel(magics)
    hung = BlockedRank(rank=0, cell_line=2, source_line="dist.recv(t, src=1)", dist_call="recv")
    channel.cell_ended(outcome(ranks=[0, 1], blocked=[hung], ended="timeout"))
    state = channel.state()
    assert state["state"] == "hung" and state["backend"] == "gloo" and state["world_size"] == 2
    assert state["ranks"][0]["state"] == "hung" and state["ranks"][0]["line"] == 2
    assert state["ranks"][0]["doing"] == "in recv at cell line 2"
    assert state["ranks"][1]["state"] == "idle"
    assert "state" not in {"cluster": state}  # nbclient reads a top-level "state" as a widget's
    running = channel.state(running=({0, 1}, 3.0))
    assert running["state"] == "busy" and running["ranks"][1]["doing"] == "running the cell (3 s)"
    magics.cluster = None
    assert channel.state()["state"] == "none"
