"""The controller's heart monitor registers a new heart as soon as it answers, not at a beat."""

from __future__ import annotations

import json
import multiprocessing
import threading
import uuid

import zmq
from ipyparallel.controller.heartmonitor import Heart
from traitlets.config import Config

from ddp_magics.controller import start_prompt_heart_monitor

HOUR_MS = 3_600_000


def test_a_new_heart_is_registered_without_waiting_for_a_beat(tmp_path):
    """With a period of an hour no periodic ping comes after the first: ipyparallel's own
    monitor would register the heart an hour later; the prompt one pings it as it subscribes
    and tells the hub at its first answer. (Unix sockets in the test's directory: no port.)"""
    ping_url, pong_url, monitor_url = (f"ipc://{tmp_path}/{name}" for name in ("ping", "pong", "monitor"))
    context = zmq.Context()
    hub = context.socket(zmq.SUB)  # the hub's end of the monitor channel
    hub.setsockopt(zmq.SUBSCRIBE, b"")
    hub.bind(monitor_url)
    config = Config()
    config.HeartMonitor.period = HOUR_MS
    config.Session.key = b"secret"
    forked = multiprocessing.get_context("fork")
    monitor = forked.Process(
        target=start_prompt_heart_monitor,
        kwargs=dict(ping_url=ping_url, pong_url=pong_url, monitor_url=monitor_url, config=config),
        daemon=True,
    )
    monitor.start()
    heart_id = uuid.uuid4().hex.encode()
    heart = forked.Process(target=beat, args=(ping_url, pong_url, heart_id), daemon=True)
    heart.start()
    try:
        assert hub.poll(20_000), "the monitor told the hub nothing within 20 s"
        frames = hub.recv_multipart()
        header, content = json.loads(frames[-4]), json.loads(frames[-1])
        assert header["msg_type"] == "new_heart"
        assert content["hearts"] == [heart_id.decode()]
    finally:
        for process in (heart, monitor):  # stand-ins with nothing to clean up
            process.kill()
            process.join(30)
        hub.close(linger=0)
        context.term()
    assert heart.exitcode is not None and monitor.exitcode is not None


def beat(ping_url: str, pong_url: str, heart_id: bytes) -> None:
    """An engine's heart (what ipyparallel's engine starts as it registers), until terminated."""
    Heart(ping_url, pong_url, heart_id=heart_id).start()
    threading.Event().wait()
