"""Every way a session ends leaves zero controller, engine or nanny processes."""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import psutil
import pytest
from IPython.utils.capture import capture_output

from ddp_magics.cluster.strays import OWNER_FILE, clusters_root, stop_stray_clusters
from ddp_magics.lifetime import (
    CLUSTER_DIR_ENV,
    LIFELINE_ENV,
    OWNER_ENV,
    OWNER_GONE_EXIT_CODE,
    Lifeline,
    Owner,
    machine_boot_id,
    process_alive,
    start_ticks,
)
from ddp_magics.private_files import remove_tree
from tests.conftest import assert_gone, start_kernel_with_cluster

# Starts a cluster in a fresh interpreter and prints the PIDs of everything it runs.
START_AND_REPORT = textwrap.dedent(
    """
    import json, sys
    from IPython.core.interactiveshell import InteractiveShell
    shell = InteractiveShell.instance()
    shell.run_line_magic("load_ext", "ddp_magics")
    shell.run_line_magic("dist_start", "-n 2")
    magics = next(m for m in shell.configurables if type(m).__name__ == "DistributedMagics")
    print(json.dumps([p.pid for p in magics.cluster.processes()]), flush=True)
    """
)


def _processes(pids: list[int]) -> list[psutil.Process]:
    return [psutil.Process(pid) for pid in pids]


def _cluster_processes(magics) -> list[psutil.Process]:
    processes = magics.cluster.processes()
    engines = {info.pid for info in magics.cluster.ranks}
    assert engines <= {p.pid for p in processes}
    assert len(processes) > len(engines) + 1, "expected the controller and nannies too"
    zygotes = {psutil.Process(pid).parent() for pid in engines}
    assert len(zygotes) == 1 and zygotes <= set(processes), "expected the zygote, parent of the engines"
    return processes


def test_dist_stop_leaves_nothing(ip, magics):
    with capture_output():
        ip.run_line_magic("dist_start", "-n 2")
    processes = _cluster_processes(magics)
    workdir = magics.cluster.workdir
    with capture_output() as captured:
        ip.run_line_magic("dist_stop", "")
    assert captured.stdout.strip() == "Stopped 2 ranks."
    assert_gone(processes, timeout=0.5)
    assert not workdir.exists()


def test_unload_ext_stops_the_cluster(ip, magics):
    with capture_output():
        ip.run_line_magic("dist_start", "-n 2")
    processes = _cluster_processes(magics)
    ip.run_line_magic("unload_ext", "ddp_magics")
    try:
        assert_gone(processes, timeout=0.5)
        assert "distributed" not in ip.magics_manager.magics["cell"]
    finally:
        ip.run_line_magic("load_ext", "ddp_magics")


def test_interpreter_exit_stops_the_cluster():
    result = subprocess.run(
        [sys.executable, "-c", START_AND_REPORT],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    pids = json.loads(result.stdout.strip().splitlines()[-1])
    assert pids
    running = [pid for pid in pids if process_alive(pid)]
    assert not running, f"left running after exit: {running}"


def _start_in_kernel(world_size: int):
    """A real ipykernel with a cluster: (kernel manager, the cluster's processes, its directory)."""
    manager, client, processes, workdir = start_kernel_with_cluster(world_size)
    client.stop_channels()
    return manager, processes, workdir


# JupyterLab's "Shut Down Kernel": a shutdown request, a short wait, then a kill. At n=4 the
# kernel used to be killed while it stopped the cluster, leaving orphans.
@pytest.mark.parametrize("world_size", [4])
def test_kernel_shutdown_stops_the_cluster(world_size):
    manager, processes, workdir = _start_in_kernel(world_size)
    manager.shutdown_kernel(now=False)
    assert_gone(processes, timeout=3)
    assert not workdir.exists()


def test_a_killed_kernel_leaves_nothing():
    """Without any later %load_ext: the engines and the controller watch the kernel."""
    manager, processes, workdir = _start_in_kernel(2)
    try:
        manager.signal_kernel(signal.SIGKILL)
        manager.provisioner.process.wait(timeout=10)
        assert_gone(processes, timeout=3)
        assert _gone_within(workdir, seconds=3)
    finally:
        manager.cleanup_resources()


def _gone_within(path: Path, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while path.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    return not path.exists()


def _stray_cluster(name: str, cluster_json: str | None) -> Path:
    """A cluster directory as a kernel that died would leave it: its owner is gone."""
    workdir = clusters_root() / f"cluster-test-{name}"
    security = workdir / "profile" / "security"
    security.mkdir(parents=True)
    ended = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True)
    gone_pid = int(ended.stdout)
    (workdir / OWNER_FILE).write_text(str(Owner(gone_pid, 0, machine_boot_id())))
    if cluster_json is not None:
        (security / "cluster-1-abcd.json").write_text(cluster_json)
    return workdir


def _cluster_json(pids: list[int]) -> str:
    engines = {str(i): {"pid": pid} for i, pid in enumerate(pids)}
    sets = {"1": {"engines": engines}}
    return json.dumps({"controller": {"state": {"pid": -1}}, "engines": {"sets": sets}})


def test_stray_recovery_stops_only_the_clusters_own_processes(temp_dir):
    workdir = _stray_cluster("running", cluster_json=None)
    ours = subprocess.Popen(["sleep", "60"], env={**os.environ, CLUSTER_DIR_ENV: str(workdir)})
    not_ours = subprocess.Popen(["sleep", "60"])  # its PID is listed too, as a reused PID would be
    try:
        (workdir / "profile" / "security" / "cluster-1-abcd.json").write_text(
            _cluster_json([ours.pid, not_ours.pid])
        )
        reports = stop_stray_clusters()
        assert ours.wait(timeout=5) == -signal.SIGKILL
        assert not_ours.poll() is None
        assert reports == [f"stopped 1 processes of {workdir.name}, whose kernel had ended"]
        assert not workdir.exists()
    finally:
        for process in (ours, not_ours):
            process.kill()
            process.wait()
        shutil.rmtree(workdir, ignore_errors=True)


def test_stray_recovery_of_half_removed_clusters_never_raises(ip, temp_dir):
    """What a controller removing its directory, or a crash while writing, leaves behind."""
    half_written = _stray_cluster("half-written", cluster_json='{"controller": {"sta')
    no_cluster_file = _stray_cluster("no-cluster-file", cluster_json=None)
    no_security_dir = _stray_cluster("no-security-dir", cluster_json=None)
    shutil.rmtree(no_security_dir / "profile")
    old_owner_format = _stray_cluster("old-owner-format", cluster_json=_cluster_json([]))
    (old_owner_format / OWNER_FILE).write_text('{"pid": 1, "create_time": 0.0}')
    removal_cut_short = _stray_cluster("removal-cut-short", cluster_json=None)
    (removal_cut_short / OWNER_FILE).unlink()
    an_hour_ago = time.time() - 3600
    os.utime(removal_cut_short, (an_hour_ago, an_hour_ago))
    being_made = _stray_cluster("being-made", cluster_json=None)  # no owner file yet, just now
    (being_made / OWNER_FILE).unlink()
    strays = [half_written, no_cluster_file, no_security_dir, old_owner_format, removal_cut_short]
    try:
        ip.run_line_magic("unload_ext", "ddp_magics")
        with capture_output() as captured:
            ip.run_line_magic("load_ext", "ddp_magics")
        assert captured.stdout == ""
        assert not [path for path in strays if path.exists()]
        assert being_made.exists()
        assert "distributed" in ip.magics_manager.magics["cell"]
    finally:
        for path in [*strays, being_made]:
            shutil.rmtree(path, ignore_errors=True)


def _keep_writing(directory: Path, stop) -> None:
    """What ipyparallel's hub does in the controller's main thread while its watcher removes
    the cluster's directory: open files for writing in a folder of it (``open(path, "w")``, which
    creates no folder), again and again. New names, so that the removal finds the folder it just
    emptied has entries again."""
    log = directory / "profile" / "log"
    for number in itertools.count():
        if stop.is_set():
            return
        with contextlib.suppress(OSError), open(log / f"engines-{number}.json", "w") as file:
            file.write("{}")


def test_a_directory_written_in_while_it_is_removed_is_removed_once_the_writing_ends(tmp_path):
    """A single ``shutil.rmtree`` leaves such a directory behind about 9 times in 10."""
    directory = tmp_path / "cluster"
    (directory / "profile" / "log").mkdir(parents=True)
    stop = threading.Event()
    writer = threading.Thread(target=_keep_writing, args=(directory, stop))
    writer.start()
    stopper = threading.Timer(0.3, stop.set)
    stopper.start()
    try:
        assert remove_tree(directory, timeout=60)
        assert not directory.exists()
    finally:
        stop.set()
        writer.join()
        stopper.join()


WATCHER = """
import time
from ddp_magics.lifetime import watch_owner
watch_owner()
print("watching", flush=True)
time.sleep(60)
"""


def test_a_process_of_another_host_ends_when_the_owners_lifeline_closes(tmp_path):
    """An engine on another machine cannot watch the kernel's PID (its owner names another boot
    id); it holds a connection to the kernel's lifeline and exits once that closes."""
    lifeline = Lifeline("127.0.0.1")
    elsewhere = Owner(os.getpid(), start_ticks(os.getpid()), "boot-id-of-another-machine")
    environment = {
        **os.environ,
        OWNER_ENV: str(elsewhere),
        CLUSTER_DIR_ENV: str(tmp_path),
        LIFELINE_ENV: lifeline.environment_value,
    }
    watcher = subprocess.Popen(
        [sys.executable, "-c", WATCHER], env=environment, stdout=subprocess.PIPE, text=True
    )
    try:
        assert watcher.stdout.readline() == "watching\n"
        time.sleep(0.3)
        assert watcher.poll() is None  # the lifeline holds
        started = time.monotonic()
        lifeline.close()
        assert watcher.wait(timeout=5) == OWNER_GONE_EXIT_CODE
        assert time.monotonic() - started < 1.0
    finally:
        if watcher.poll() is None:
            watcher.kill()
            watcher.wait()
        watcher.stdout.close()


# An MPI rank's shared segment as MPICH names it (/dev/shm/mpich_shm_*), mapped; and one of the
# same pattern it does not map, which is not its to remove.
MAPPER = """
import mmap, os, sys, time
from ddp_magics.lifetime import watch_owner
mapped, unmapped = sys.argv[1:3]
descriptor = os.open(mapped, os.O_CREAT | os.O_RDWR, 0o600)
os.ftruncate(descriptor, 4096)
segment = mmap.mmap(descriptor, 4096)
os.close(os.open(unmapped, os.O_CREAT | os.O_RDWR, 0o600))
watch_owner()
print("mapped", flush=True)
time.sleep(60)
"""


@contextlib.contextmanager
def _mapped_segment(name: str, environment: dict[str, str]):
    """A process mapping a segment; yields it, the segment and the unmapped one."""
    mapped, unmapped = (Path(f"/dev/shm/mpich_shm_ddptest{name}{os.getpid()}_{n}") for n in (0, 1))
    process = subprocess.Popen(
        [sys.executable, "-c", MAPPER, str(mapped), str(unmapped)],
        env=environment,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert process.stdout.readline() == "mapped\n"
        yield process, mapped, unmapped
    finally:
        process.kill()
        process.wait()
        process.stdout.close()
        for path in (mapped, unmapped):
            path.unlink(missing_ok=True)


def test_a_rank_whose_owner_ended_removes_the_mpi_segment_it_mapped(tmp_path):
    owner_process = subprocess.Popen(["sleep", "60"])
    try:
        owner = Owner(owner_process.pid, start_ticks(owner_process.pid), machine_boot_id())
        environment = {**os.environ, OWNER_ENV: str(owner), CLUSTER_DIR_ENV: str(tmp_path)}
        with _mapped_segment("owner", environment) as (rank, mapped, unmapped):
            owner_process.kill()
            assert rank.wait(timeout=10) == OWNER_GONE_EXIT_CODE
            assert not mapped.exists()
            assert unmapped.exists()
    finally:
        owner_process.kill()
        owner_process.wait()


def test_stray_recovery_removes_the_mpi_segments_the_clusters_processes_mapped(temp_dir):
    workdir = _stray_cluster("mpi", cluster_json=None)
    environment = {**os.environ, CLUSTER_DIR_ENV: str(workdir)}
    try:
        with _mapped_segment("stray", environment) as (rank, mapped, unmapped):
            (workdir / "profile" / "security" / "cluster-1-abcd.json").write_text(_cluster_json([rank.pid]))
            assert stop_stray_clusters() == [f"stopped 1 processes of {workdir.name}, whose kernel had ended"]
            assert rank.wait(timeout=5) == -signal.SIGKILL
            assert not mapped.exists()
            assert unmapped.exists()
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
