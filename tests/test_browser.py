"""The product as a learner meets it: JupyterLab 4 in headless Chromium, driven by Playwright.

One JupyterLab server (127.0.0.1, a token) and one browser serve the module; every test opens a
notebook of its own, so each has its own kernel and cluster. Screenshots go to
``test-artifacts/browser/`` (kept after the run, not committed). Needs Debian's ``chromium``
(``make test`` installs it when run as root) and Playwright from PyPI; never a downloaded browser.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import nbformat
import psutil
import pytest

from tests.conftest import assert_gone
from tests.ports import unused_port

CHROMIUM = Path("/usr/bin/chromium")
REPO = Path(__file__).resolve().parent.parent
SCREENSHOTS = REPO / "test-artifacts" / "browser"
# Without these, Chromium keeps trying to reach Google's services, which this machine refuses.
CHROMIUM_ARGS = [
    "--headless=new",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]
CELL_SECONDS = 120

playwright_api = pytest.importorskip("playwright.sync_api", reason="Playwright (PyPI: playwright) missing")
if not CHROMIUM.exists():
    pytest.skip(
        "browser tests need Debian's chromium package (/usr/bin/chromium); make test installs it as root",
        allow_module_level=True,
    )
expect = playwright_api.expect


# ------------------------------------------------------------------------- fixtures
class Lab:
    """A running JupyterLab server whose root is a temporary directory."""

    def __init__(self, disabled_extensions: tuple[str, ...] = ()) -> None:
        # Short names: a kernel's sockets live in the runtime directory (ipc transport), and a Unix
        # socket's path has at most 107 characters (the run's TMPDIR is long already).
        self.root = Path(tempfile.mkdtemp(prefix="lab-"))
        self.port = unused_port()
        self.token = os.urandom(16).hex()
        settings = self.root / ".settings" / "@jupyterlab" / "apputils-extension"
        settings.mkdir(parents=True)
        # No "would you like news?" toast over the notebook, no update check (no network here).
        (settings / "notification.jupyterlab-settings").write_text(
            json.dumps({"fetchNews": "false", "checkForUpdates": False})
        )
        env = {
            **os.environ,
            # Its own config directory: `jupyter labextension disable` for this server alone.
            "JUPYTER_CONFIG_DIR": str(self.root / ".config"),
            "JUPYTERLAB_SETTINGS_DIR": str(self.root / ".settings"),
            "JUPYTERLAB_WORKSPACES_DIR": str(self.root / ".workspaces"),
            "JUPYTER_RUNTIME_DIR": str(self.root / ".rt"),
            "IPYTHONDIR": str(self.root / ".ipython"),
        }
        labconfig = self.root / ".config" / "labconfig"
        labconfig.mkdir(parents=True)
        (labconfig / "page_config.json").write_text(
            json.dumps({"disabledExtensions": {name: True for name in disabled_extensions}})
        )
        command = [
            sys.executable,
            "-m",
            "jupyterlab",
            "--no-browser",
            "--ip=127.0.0.1",
            f"--port={self.port}",
            f"--IdentityProvider.token={self.token}",
            f"--ServerApp.root_dir={self.root}",
            "--ServerApp.log_level=WARN",
            # Kernels on Unix sockets in the runtime directory: no TCP ports, none to lose to
            # another process between jupyter_client choosing them and the kernel binding them.
            "--KernelManager.transport=ipc",
        ]
        if os.getuid() == 0:
            command.append("--allow-root")
        self.log = open(self.root / ".server.log", "w")  # noqa: SIM115 (closed in stop)
        self.process = subprocess.Popen(command, env=env, stdout=self.log, stderr=subprocess.STDOUT)
        self._wait_until_up()

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}/{path}?token={self.token}"

    def _wait_until_up(self, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"JupyterLab exited: {(self.root / '.server.log').read_text()}")
            try:
                with urllib.request.urlopen(self.url("api/status"), timeout=2) as response:
                    if response.status == 200:
                        return
            except OSError:
                time.sleep(0.2)
        raise TimeoutError("JupyterLab did not answer within 60 s")

    def add_notebook(self, name: str, cells: list[str]) -> str:
        notebook = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(cell) for cell in cells])
        notebook.metadata["kernelspec"] = {
            "name": "python3",
            "display_name": "Python 3",
            "language": "python",
        }
        nbformat.write(notebook, self.root / name)
        return name

    def stop(self) -> None:
        """Stop the server by PID; its kernels (and their clusters) must go with it."""
        processes = _with_children(self.process.pid)
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self.log.close()
        try:
            assert_gone(processes, timeout=10)
        finally:
            shutil.rmtree(self.root, ignore_errors=True)


def _with_children(pid: int) -> list[psutil.Process]:
    process = psutil.Process(pid)
    return [process, *process.children(recursive=True)]


@pytest.fixture(scope="module")
def lab():
    server = Lab()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def browser_context():
    with playwright_api.sync_playwright() as playwright:
        chromium = playwright.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        # One context for the module: its pages share the HTTP and compiled-script caches, so
        # JupyterLab's bundle is fetched and compiled once, not once per test.
        context = chromium.new_context(viewport={"width": 1400, "height": 1000})
        yield context
        context.close()
        chromium.close()


class Notebook:
    """One open notebook page, and ways to act on it as a user would."""

    def __init__(self, page, name: str) -> None:
        self.page = page
        self.name = name
        self.console_errors: list[str] = []
        page.on("console", lambda message: self._console(message))
        page.on("pageerror", lambda error: self.console_errors.append(f"page error: {error}"))

    def _console(self, message) -> None:
        if message.type == "error":
            self.console_errors.append(message.text)

    @property
    def cells(self):
        return self.page.locator(".jp-NotebookPanel:visible .jp-Notebook .jp-Cell")

    def cell(self, index: int):
        return self.cells.nth(index)

    def output(self, index: int):
        """The cell's outputs that show (a live view hidden in place as its magic ended does not)."""
        return self.cell(index).locator(".jp-OutputArea-output:visible")

    def run(self, index: int) -> None:
        """Run one cell as Shift+Enter does."""
        self.cell(index).locator(".jp-InputArea-editor").click()
        self.page.keyboard.press("Shift+Enter")

    def wait_done(self, index: int, timeout: float = CELL_SECONDS) -> None:
        """Wait until the cell has an execution count (not ``[*]`` or empty)."""
        prompt = self.cell(index).locator(".jp-InputPrompt")
        expect(prompt).to_have_text(re.compile(r"\[\d+\]:"), timeout=timeout * 1000)

    def run_and_wait(self, index: int, timeout: float = CELL_SECONDS) -> None:
        self.run(index)
        self.wait_done(index, timeout)

    def menu(self, top: str, item: str) -> None:
        self.page.locator(".lm-MenuBar-itemLabel", has_text=re.compile(f"^{top}$")).click()
        self.page.locator(".lm-Menu-itemLabel", has_text=re.compile(f"^{re.escape(item)}$")).click()

    def record_outputs(self, index: int):
        """Start recording every text the cell's output area shows, however briefly; returns a
        function that gives what was seen so far."""
        self.cell(index).locator(".jp-Cell-outputWrapper").evaluate(
            """area => {
                window.__seen = [];
                new MutationObserver(() => window.__seen.push(area.innerText))
                    .observe(area, {childList: true, subtree: true, characterData: true});
            }"""
        )
        return lambda: "\n".join(self.page.evaluate("window.__seen"))

    def screenshot(self, label: str) -> None:
        SCREENSHOTS.mkdir(parents=True, exist_ok=True)
        self.page.screenshot(path=str(SCREENSHOTS / f"{Path(self.name).stem}-{label}.png"), full_page=True)

    def text(self, index: int) -> str:
        return "\n".join(self.output(index).all_inner_texts())


@pytest.fixture
def open_notebook(lab, browser_context):
    """Open a notebook in JupyterLab; at the end its kernel is shut down and the page closed."""
    opened: list[Notebook] = []

    def open_(name: str) -> Notebook:
        page = browser_context.new_page()
        notebook = Notebook(page, name)
        # A workspace of its own: the page shows this notebook alone, not those opened before.
        page.goto(lab.url(f"lab/workspaces/{Path(name).stem}/tree/{name}"))
        expect(notebook.cells.first).to_be_visible(timeout=60_000)
        # The kernel has started and answered (running earlier would ask which kernel to start).
        expect(page.locator("#jp-main-statusbar")).to_contain_text("| Idle", timeout=60_000)
        opened.append(notebook)
        return notebook

    yield open_
    for notebook in opened:
        _shut_down_kernels(lab)
        notebook.page.close()


def _shut_down_kernels(lab: Lab) -> None:
    with urllib.request.urlopen(lab.url("api/kernels"), timeout=10) as response:
        kernels = json.loads(response.read())
    for kernel in kernels:
        request = urllib.request.Request(lab.url(f"api/kernels/{kernel['id']}"), method="DELETE")
        urllib.request.urlopen(request, timeout=30).close()


START = "%load_ext ddp_magics\n%dist_start -n 2"
PIDS = (
    "import json\n"
    "m = next(m for m in get_ipython().configurables if type(m).__name__ == 'DistributedMagics')\n"
    "print('PIDS', json.dumps([p.pid for p in m.cluster.processes()]))"
)


# ---------------------------------------------------------------------------- tests
def test_lesson_00_run_all(lab, open_notebook):
    lesson = nbformat.read(REPO / "notebooks" / "00_start_here.ipynb", as_version=4)
    for cell in lesson.cells:  # every output checked below is made by this run
        if cell.cell_type == "code":
            cell.outputs, cell.execution_count = [], None
    lesson.metadata.pop("widgets", None)
    nbformat.write(lesson, lab.root / "00_start_here.ipynb")
    notebook = open_notebook("00_start_here.ipynb")
    code_cells = notebook.cells.and_(notebook.page.locator(".jp-CodeCell"))
    count = sum(cell.cell_type == "code" for cell in lesson.cells)
    expect(code_cells).to_have_count(count)
    last = count - 1
    notebook.menu("Run", "Run All Cells")
    prompt = code_cells.nth(last).locator(".jp-InputPrompt")
    expect(prompt).to_have_text(re.compile(r"\[\d+\]:"), timeout=240_000)
    notebook.screenshot("run-all")

    # The rank view (labextension/): a tab per rank, rank 0's shown first, rank 1's a click away.
    hello = code_cells.filter(has_text='print(f"I am rank {rank}').first  # found by its code
    expect(hello.locator(".ddp-RankView-panel")).to_contain_text("I am rank 0 of 2")
    hello.locator(".ddp-RankView-tab", has_text="rank 1").click()
    expect(hello.locator(".ddp-RankView-panel")).to_contain_text("I am rank 1 of 2")
    tabs = notebook.page.locator(".ddp-RankView-tab")
    expect(tabs.filter(has_text="ranks 0,1").first).to_be_visible()  # identical outputs collapsed
    # The --diagram cell shows a picture.
    diagram = code_cells.filter(has_text="%%distributed --diagram").locator(".jp-OutputArea-output img")
    expect(diagram).to_be_visible()
    assert diagram.evaluate("image => image.naturalWidth") > 100
    # The failing cell's error box names the rank and its exception; Run All went on past it.
    error = code_cells.filter(has_text="result = 1 / (1 - rank)").locator(
        ".jp-OutputArea-output[data-mime-type='application/vnd.jupyter.stderr']"
    )
    expect(error).to_contain_text("DistributedCellError: rank 1 raised ZeroDivisionError")
    expect(code_cells.nth(last).locator(".jp-OutputArea-output")).to_have_text("Stopped 2 ranks.")
    assert not notebook.console_errors


def test_live_view_then_final_output(lab, open_notebook):
    slow = (
        "%%distributed\nimport time\n"
        "for step in range(4):\n    print('step', step, flush=True)\n    time.sleep(1)"
    )
    notebook = open_notebook(lab.add_notebook("live.ipynb", [START, slow, "%dist_stop"]))
    notebook.run_and_wait(0)
    notebook.run(1)
    live = notebook.output(1).filter(has_text="running for")
    expect(live).to_be_visible(timeout=10_000)
    notebook.screenshot("live-view")
    notebook.wait_done(1)
    expect(live).to_have_count(0)
    shown = notebook.output(1)  # the live view is hidden in place: one output shows
    expect(shown).to_have_count(1)
    expect(shown.locator(".ddp-RankView-tab")).to_have_text("ranks 0,1")
    expect(shown).to_contain_text("step 3")
    notebook.run_and_wait(2)
    assert not notebook.console_errors


def test_hang_report_then_restart_with_progress(lab, open_notebook):
    hang = "%%distributed --timeout 3\nif rank == 0:\n    dist.recv(torch.zeros(1), src=1)"
    after = "%%distributed\nprint('rank', rank, 'is back')"
    notebook = open_notebook(
        lab.add_notebook("hang.ipynb", [START, hang, "%dist_restart", after, "%dist_stop"])
    )
    notebook.run_and_wait(0)
    notebook.run_and_wait(1)
    report = notebook.text(1)
    assert "rank 0 still running after 3 s" in report
    assert "line 2: dist.recv(torch.zeros(1), src=1)" in report
    assert "Cell In" not in report
    notebook.screenshot("hang-report")
    seen = notebook.record_outputs(2)
    notebook.run_and_wait(2)
    assert "stopping the 2 engines" in seen(), "the restart showed no progress"
    expect(notebook.output(2)).to_contain_text("2 ranks ready")
    notebook.run_and_wait(3)
    notebook.output(3).locator(".ddp-RankView-tab", has_text="rank 1").click()  # the rank view's tab
    expect(notebook.output(3)).to_contain_text("rank 1 is back")
    notebook.run_and_wait(4)
    assert not notebook.console_errors


def test_interrupt_button(lab, open_notebook):
    sleepy = "%%distributed\nimport time\ntime.sleep(60)"
    after = "%%distributed\nprint('rank', rank, 'still usable')"
    notebook = open_notebook(lab.add_notebook("interrupt.ipynb", [START, sleepy, after, "%dist_stop"]))
    notebook.run_and_wait(0)
    notebook.run(1)
    # The live view shows once the ranks run the cell: the interrupt is for a running cell.
    expect(notebook.output(1).filter(has_text="running for")).to_be_visible(timeout=10_000)
    notebook.page.locator("jp-button[data-command='notebook:interrupt-kernel']").click()
    notebook.wait_done(1, timeout=30)
    error = notebook.text(1)
    assert "ranks 0,1 were interrupted" in error
    # One traceback for both ranks, numbered as the notebook numbers the cell.
    assert error.count("KeyboardInterrupt") >= 1 and "[ranks 0,1]" in error
    prompt = notebook.cell(1).locator(".jp-InputPrompt").inner_text()
    assert f"Cell In[{prompt.strip('[]: ')}]" in error
    notebook.screenshot("interrupted")
    notebook.run_and_wait(2)
    expect(notebook.output(2)).to_contain_text("still usable")
    notebook.run_and_wait(3)
    assert not notebook.console_errors


def test_ring_stepper_buttons(lab, open_notebook):
    stepper = "from ddp_magics.lessons import RingStepper\nRingStepper([[1, 2], [3, 4]])"
    notebook = open_notebook(lab.add_notebook("stepper.ipynb", [stepper]))
    notebook.run_and_wait(0)
    widget = notebook.cell(0).locator(".jp-OutputArea-output")
    visible_step = widget.locator(".widget-html:visible", has_text=re.compile(r"step \d of \d"))
    expect(visible_step).to_contain_text("step 0 of 2")
    widget.get_by_role("button", name="next").click()
    expect(visible_step).to_contain_text("step 1 of 2")
    widget.get_by_role("button", name="previous").click()
    expect(visible_step).to_contain_text("step 0 of 2")
    widget.locator(".widget-play button").first.click()  # play
    expect(visible_step).to_contain_text("step 2 of 2", timeout=10_000)
    notebook.screenshot("ring-stepper")
    assert not notebook.console_errors


def test_four_ranks_then_shut_down_kernel_from_the_menu(lab, open_notebook):
    """Four rank columns (the rank view's compare grid) never break a line inside a word; then
    "Shut Down Kernel" ends every process of the cluster (checked by PID)."""
    values = "%%distributed\nprint(f'rank {rank}:', (torch.arange(6.0) + rank).tolist())"
    notebook = open_notebook(
        lab.add_notebook("shutdown.ipynb", [START.replace("-n 2", "-n 4"), values, PIDS])
    )
    notebook.page.set_viewport_size({"width": 900, "height": 1000})
    notebook.run_and_wait(0)
    notebook.run_and_wait(1)
    notebook.cell(1).locator(".ddp-RankView-compare").click()  # the rank view's compare grid
    lines = notebook.output(1).locator(".ddp-RankView-grid pre")
    expect(lines).to_have_count(4)
    for index in range(4):
        expect(lines.nth(index)).to_have_text(f"rank {index}: {[float(i + index) for i in range(6)]}")
        one_line = lines.nth(index).evaluate(
            "pre => pre.getBoundingClientRect().height < 1.5 * parseFloat(getComputedStyle(pre).lineHeight)"
        )
        assert one_line, f"rank {index}'s line wraps"
    notebook.screenshot("four-ranks")
    notebook.run_and_wait(2)
    pids = json.loads(notebook.text(2).split("PIDS", 1)[1])
    processes = [psutil.Process(pid) for pid in pids]
    notebook.menu("Kernel", "Shut Down Kernel")
    expect(notebook.page.locator("#jp-main-statusbar")).to_contain_text("No Kernel", timeout=10_000)
    assert_gone(processes, timeout=3)
    notebook.screenshot("kernel-shut-down")
    assert not notebook.console_errors


def test_breakpoint_on_a_rank_is_answered_in_the_input_box(lab, open_notebook):
    """Issue 23: rank 1's pdb prompt is JupyterLab's own input box; typing `p x` shows rank 1's x,
    `c` lets the cell finish."""
    stop = "%%distributed\nx = rank + 40\nif rank == 1:\n    breakpoint()\nprint('done', rank)"
    notebook = open_notebook(lab.add_notebook("debug.ipynb", [START, stop, "%dist_stop"]))
    notebook.run_and_wait(0)
    notebook.run(1)
    for command, shown in (("p x", "41"), ("c", "done 0")):
        box = notebook.cell(1).locator(".jp-Stdin-input:enabled").last  # a box answered stays, disabled
        expect(box).to_be_visible(timeout=30_000)
        expect(notebook.cell(1).locator(".jp-Stdin-prompt").last).to_contain_text("(Pdb rank 1)")
        box.fill(command)
        box.press("Enter")
        expect(notebook.cell(1)).to_contain_text(shown, timeout=30_000)
    notebook.wait_done(1)
    notebook.screenshot("breakpoint")
    assert "done 0" in notebook.text(1)
    notebook.cell(1).locator(".ddp-RankView-tab", has_text="rank 1").click()  # the rank view's tab
    expect(notebook.cell(1).locator(".ddp-RankView-panel")).to_contain_text("done 1")
    notebook.run_and_wait(2)
    assert not notebook.console_errors
