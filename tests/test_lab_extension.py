"""The JupyterLab extension (labextension/) in a real JupyterLab 4 and headless Chromium: the rank
view of a cell (tabs, groups of identical ranks, states, the compare grid), and a notebook that
carries the rank view's record opened where the extension is disabled (its text still shows).

Uses test_browser's server, browser and notebook page. Screenshots of the rank view go to docs/
(shown in docs/jupyterlab.md).
"""

from __future__ import annotations

import os
import re
import time

import nbformat
from IPython.core.formatters import DisplayFormatter

from ddp_magics import lab_bundle
from ddp_magics.cell_run import CellOutcome
from ddp_magics.cluster.records import RankFailure, RankOutput
from ddp_magics.output import render
from tests.test_browser import (
    REPO,
    SCREENSHOTS,
    START,
    Lab,
    Notebook,
    browser_context,
    expect,
    lab,
    open_notebook,
)

__all__ = ["browser_context", "lab", "open_notebook"]  # fixtures, used by name

# The README's pictures: the tests take them into test-artifacts/browser/, and into docs/ (committed)
# when UPDATE_DOCS_SCREENSHOTS=1, so a run leaves the working tree as it was.
DOCS = REPO / "docs" if os.environ.get("UPDATE_DOCS_SCREENSHOTS") == "1" else SCREENSHOTS


def tabs(notebook: Notebook, index: int):
    return notebook.cell(index).locator(".ddp-RankView-tab")


def test_four_ranks_a_tab_each_and_the_compare_grid(lab, open_notebook):
    hello = "%%distributed\nprint(f'hello from rank {rank}')"
    fails = "%%distributed\nprint('before')\nresult = 1 / (1 - rank)"
    rich = (
        "%%distributed\nfrom IPython.display import HTML, display\n"
        "print('rank', rank)\ndisplay(HTML(f'<b class=\"shown\">rank {rank} in bold</b>'))"
    )
    notebook = open_notebook(
        lab.add_notebook("rankview.ipynb", [START.replace("-n 2", "-n 4"), hello, fails, rich, "%dist_stop"])
    )
    notebook.run_and_wait(0)
    notebook.run_and_wait(1)
    shown = tabs(notebook, 1)
    expect(shown).to_have_count(4)
    assert shown.all_inner_texts() == ["rank 0", "rank 1", "rank 2", "rank 3"]
    panel = notebook.cell(1).locator(".ddp-RankView-panel")
    for rank in (2, 0, 3, 1):
        shown.nth(rank).click()
        expect(panel).to_have_text(f"hello from rank {rank}")
        expect(shown.nth(rank)).to_have_attribute("aria-selected", "true")
    notebook.page.screenshot(path=str(DOCS / "rank-view.png"), clip=_clip(notebook, 1))
    notebook.cell(1).locator(".ddp-RankView-compare").click()
    grid = notebook.cell(1).locator(".ddp-RankView-grid .ddp-RankView-ranks")
    expect(grid).to_have_count(4)
    for rank in range(4):
        expect(grid.nth(rank)).to_contain_text(f"hello from rank {rank}")
    # Rank 1 raised: its tab is marked and says what it raised; the others share one tab.
    notebook.run_and_wait(2)
    raised = tabs(notebook, 2)
    expect(raised).to_have_count(2)
    assert raised.all_inner_texts() == ["ranks 0,2,3", "rank 1 ✗"]
    expect(raised.nth(1)).to_have_class(re.compile("ddp-mod-raised"))
    raised.nth(1).click()
    expect(notebook.cell(2).locator(".ddp-RankView-state")).to_contain_text("raised ZeroDivisionError")
    notebook.page.screenshot(path=str(DOCS / "rank-view-raised.png"), clip=_clip(notebook, 2))
    # The error box is as before, below the view.
    error = notebook.cell(2).locator(".jp-OutputArea-output[data-mime-type='application/vnd.jupyter.stderr']")
    expect(error).to_contain_text("DistributedCellError: rank 1 raised ZeroDivisionError")
    # A rank's displays are in its tab; the outputs after the view (the blocks and displays it
    # shows) are hidden.
    notebook.run_and_wait(3)
    expect(tabs(notebook, 3)).to_have_count(4)
    tabs(notebook, 3).nth(2).click()
    expect(notebook.cell(3).locator(".ddp-RankView-panel b.shown")).to_have_text("rank 2 in bold")
    expect(notebook.cell(3).locator(".ddp-RankView-panel")).to_contain_text("rank 2")
    expect(notebook.cell(3).locator(".jp-OutputArea-child:visible")).to_have_count(1)
    notebook.run_and_wait(4)
    assert not notebook.console_errors


def _clip(notebook: Notebook, index: int) -> dict:
    box = notebook.cell(index).bounding_box()
    return {"x": box["x"], "y": box["y"], "width": box["width"], "height": min(box["height"], 700)}


def test_eight_identical_ranks_show_one_tab(lab, open_notebook):
    same = "%%distributed\nprint('the same on every rank')"
    notebook = open_notebook(
        lab.add_notebook("eight.ipynb", [START.replace("-n 2", "-n 8"), same, "%dist_stop"])
    )
    notebook.run_and_wait(0)
    notebook.run_and_wait(1)
    shown = tabs(notebook, 1)
    expect(shown).to_have_count(1)
    expect(shown).to_have_text("ranks 0-7")
    expect(notebook.cell(1).locator(".ddp-RankView-panel")).to_have_text("the same on every rank")
    expect(notebook.cell(1).locator(".ddp-RankView-compare")).to_have_count(0)
    notebook.run_and_wait(2)
    assert not notebook.console_errors


def _saved_notebook(lab: Lab, name: str) -> str:
    """A notebook saved with a 3-rank cell's outputs as the magic makes them (rank 1 raised)."""
    outputs = [
        RankOutput(rank=0, stdout="rank 0 says hi\n"),
        RankOutput(rank=1, stdout="rank 1 says hi\n"),
        RankOutput(rank=2, stdout="rank 2 says hi\n"),
    ]
    failure = RankFailure(rank=1, ename="ValueError", evalue="no", traceback="")
    outcome = CellOutcome(
        ranks=[0, 1, 2], ended="error", timeout=60, outputs=outputs, failures=[failure], dead=[],
        deaths=[], blocked=[], trace=None,
    )
    (blocks,) = render(outputs)
    data, _ = DisplayFormatter().format(blocks)
    data[lab_bundle.MIMETYPE] = lab_bundle.rank_view(outcome, True, 200)
    cell = nbformat.v4.new_code_cell("%%distributed\nprint(f'rank {rank} says hi')", execution_count=1)
    cell.outputs = [nbformat.v4.new_output("display_data", data=data)]
    notebook = nbformat.v4.new_notebook(cells=[cell])
    notebook.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nbformat.write(notebook, lab.root / name)
    return name


def test_saved_rank_view_opened_with_and_without_the_extension(lab, open_notebook, browser_context):
    notebook = open_notebook(_saved_notebook(lab, "saved.ipynb"))
    expect(tabs(notebook, 0)).to_have_count(3)
    expect(notebook.cell(0).locator(".ddp-RankView-panel")).to_have_text("rank 0 says hi")
    bare = Lab(disabled_extensions=("ddp-magics",))
    try:
        page = browser_context.new_page()
        name = _saved_notebook(bare, "saved.ipynb")
        page.goto(bare.url(f"lab/workspaces/bare/tree/{name}"))
        without = Notebook(page, name)
        output = without.cell(0).locator(".jp-OutputArea-output")
        for rank in range(3):
            expect(output).to_contain_text(f"rank {rank} says hi", timeout=60_000)
        expect(output).to_contain_text("[rank 0]")
        expect(without.cell(0).locator(".ddp-RankView")).to_have_count(0)
        assert "No renderer" not in output.inner_text()
        page.close()
    finally:
        bare.stop()


# ------------------------------------------------------------------- the cluster, live
def open_panel(notebook: Notebook):
    panel = notebook.page.locator("#ddp-magics-cluster")
    if not panel.is_visible():
        notebook.page.locator(".jp-SideBar .lm-TabBar-tab[data-id='ddp-magics-cluster']").click()
    expect(panel).to_be_visible()
    return panel


def test_a_hang_in_the_panel_then_its_recover_button(lab, open_notebook):
    define = "%%distributed\nx = rank + 100"
    hang = "%%distributed --timeout 15\nif rank == 0:\n    dist.recv(torch.zeros(1), src=1)"
    after = "%%distributed\nprint('x is', x)"
    notebook = open_notebook(lab.add_notebook("panel.ipynb", [START, define, hang, after, "%dist_stop"]))
    status = notebook.page.locator(".ddp-ClusterStatus")
    panel = open_panel(notebook)
    notebook.run_and_wait(0)
    expect(status).to_have_text("ddp: gloo · 2 ranks · idle")
    expect(panel.locator("tbody[data-rank]")).to_have_count(2)
    notebook.run_and_wait(1)
    notebook.run(2)
    started = time.monotonic()
    # While the cell runs, rank 0 shows as running, then where it waits, within the cell's
    # timeout (the cell still runs); at the timeout, hung there.
    row = panel.locator("tbody[data-rank='0']")
    expect(row).to_contain_text("running", timeout=10_000)
    expect(row).to_contain_text(re.compile(r"in recv at cell line 2 \(\d+ s\) — line 2: dist\.recv\("))
    assert time.monotonic() - started < 15
    expect(notebook.cell(2).locator(".jp-InputPrompt")).to_have_text("[*]:")
    expect(row).to_contain_text("hung", timeout=30_000)
    expect(row).to_contain_text("line 2: dist.recv(torch.zeros(1), src=1)")
    expect(status).to_have_text("ddp: gloo · 2 ranks · hung")
    notebook.wait_done(2)
    panel.page.screenshot(path=str(DOCS / "cluster-panel.png"))
    panel.locator("button[data-action='recover']").click()
    expect(panel.locator(".ddp-ClusterPanel-output")).to_contain_text("%dist_recover")
    expect(status).to_have_text("ddp: gloo · 2 ranks · idle", timeout=60_000)
    expect(panel.locator("button[data-action='recover']")).to_be_enabled(timeout=60_000)
    notebook.run_and_wait(3)
    view = notebook.cell(3).locator(".ddp-RankView")
    expect(view.locator(".ddp-RankView-tab")).to_have_count(2)
    expect(view.locator(".ddp-RankView-panel")).to_have_text("x is 100")
    notebook.run_and_wait(4)
    expect(status).to_have_text("ddp: no cluster")
    assert not notebook.console_errors


# ---------------------------------------------------------- the number of ranks in the toolbar
def test_toolbar_ranks_restart_and_survive_reopening(lab, open_notebook, browser_context):
    start = "%load_ext ddp_magics\n%dist_start"
    notebook = open_notebook(lab.add_notebook("toolbar.ipynb", [start, "%dist_stop"]))
    status = notebook.page.locator(".ddp-ClusterStatus")
    field = notebook.page.locator(".jp-NotebookPanel:visible .ddp-RanksField-input")
    notebook.run_and_wait(0)
    expect(status).to_have_text("ddp: gloo · 2 ranks · idle")
    expect(field).to_have_value("2")
    field.fill("3")
    field.press("Enter")
    dialog = notebook.page.locator(".jp-Dialog")
    expect(dialog).to_contain_text("Restart the cluster with 3 ranks?")
    dialog.get_by_role("button", name="Restart with 3 ranks").click()
    expect(status).to_have_text("ddp: gloo · 3 ranks · idle", timeout=60_000)
    notebook.page.keyboard.press("Control+s")
    saved = lab.root / "toolbar.ipynb"
    deadline = time.monotonic() + 20
    while nbformat.read(saved, as_version=4).metadata.get("ddp_magics", {}).get("world_size") != 3:
        assert time.monotonic() < deadline, "the size was not saved in the notebook's metadata"
        time.sleep(0.5)
    notebook.menu("Kernel", "Shut Down Kernel")
    expect(notebook.page.locator("#jp-main-statusbar")).to_contain_text("No Kernel", timeout=30_000)
    notebook.page.close()
    # Reopened: a new kernel, and %dist_start without -n starts the notebook's 3 ranks.
    again = open_notebook("toolbar.ipynb")
    expect(again.page.locator(".jp-NotebookPanel:visible .ddp-RanksField-input")).to_have_value("3")
    again.run_and_wait(0)
    expect(again.output(0)).to_contain_text("3 ranks")
    expect(again.page.locator(".ddp-ClusterStatus")).to_have_text("ddp: gloo · 3 ranks · idle")
    again.run_and_wait(1)
    assert not again.console_errors


def test_past_eight_groups_a_selector(lab, open_notebook):
    own = "%%distributed\nprint(f'rank {rank} of {world_size}')"
    cells = [START.replace("-n 2", "-n 10"), own, "%dist_stop"]
    notebook = open_notebook(lab.add_notebook("ten.ipynb", cells))
    notebook.run_and_wait(0)
    notebook.run_and_wait(1)
    select = notebook.cell(1).locator("select.ddp-RankView-select")
    expect(select.locator("option")).to_have_count(10)
    expect(tabs(notebook, 1)).to_have_count(0)
    select.select_option(label="rank 7")
    expect(notebook.cell(1).locator(".ddp-RankView-panel")).to_have_text("rank 7 of 10")
    notebook.run_and_wait(2)
    assert not notebook.console_errors
