"""Entry point for the cluster's controller: ``python -m ddp_magics.controller`` (ipcontroller's
arguments).

When the kernel that owns the cluster ends, the controller ends its schedulers, waits for the
engines (which watch the kernel too) and removes the cluster's directory.

Its heart monitor is ipyparallel's, but prompt: it pings a new engine's heart as soon as the
heart subscribes to the pings, and registers the heart at its first answer. ipyparallel's
waits for the next periodic ping and registers at the beat after the answer: one to two
heartbeat periods (1-2 s at the default 1000 ms) between an engine starting its heart and
the controller announcing it, on every start, restart and replacement.
"""

from __future__ import annotations

import asyncio
import logging
import os
from pathlib import Path

import zmq
from ipyparallel.controller.heartmonitor import HeartMonitor
from ipyparallel.util import bind, connect, set_hwm
from zmq.eventloop.zmqstream import ZMQStream

from ddp_magics.lifetime import CLUSTER_DIR_ENV, HEART_MONITOR_PID_FILE, watch_owner

SUBSCRIBE = b"\x01"  # the first byte of the message an XPUB socket receives as a peer subscribes


class PromptHeartMonitor(HeartMonitor):
    """A heart monitor whose ping socket is an XPUB (a PUB that hears its subscribers come)."""

    def start(self):
        super().start()
        self.ping_stream.on_recv(self._ping_new_subscribers)

    def _ping_new_subscribers(self, frames: list[bytes]) -> None:
        if any(frame.startswith(SUBSCRIBE) for frame in frames):
            # The ping of this period again: known hearts answer it as they did the first time.
            self.ping_stream.send(str(self.lifetime).encode("ascii"))
            self.ping_stream.flush()

    def handle_pong(self, msg):
        super().handle_pong(msg)
        heart = msg[0]
        if heart in self.responses and heart not in self.hearts:
            self.handle_new_hearts({heart})


def start_prompt_heart_monitor(
    ping_url,
    pong_url,
    monitor_url,
    log_level=logging.INFO,
    curve_publickey=None,
    curve_secretkey=None,
    **monitor_settings,
):
    """ipyparallel's ``start_heartmonitor`` (the target of the controller's heart monitor
    process), with an XPUB ping socket and :class:`PromptHeartMonitor`."""
    from ipyparallel.controller.app import IPController

    if os.environ.get(CLUSTER_DIR_ENV):
        (Path(os.environ[CLUSTER_DIR_ENV]) / HEART_MONITOR_PID_FILE).write_text(f"{os.getpid()}\n")
    context = zmq.Context()
    keys = dict(curve_publickey=curve_publickey, curve_secretkey=curve_secretkey)

    async def set_up() -> None:  # in the loop, as ipyparallel's: the streams take the running loop
        ping = context.socket(zmq.XPUB)
        ping.setsockopt(zmq.XPUB_VERBOSE, 1)  # every subscriber's subscription, not only the first
        bind(ping, ping_url, **keys)
        pong = context.socket(zmq.ROUTER)
        set_hwm(pong, 0)
        bind(pong, pong_url, **keys)
        monitor = context.socket(zmq.XPUB)
        connect(monitor, monitor_url, curve_serverkey=curve_publickey, **keys)
        monitor_settings["log"] = IPController(log_level=log_level).log  # logging, after the fork
        PromptHeartMonitor(
            ping_stream=ZMQStream(ping),
            pong_stream=ZMQStream(pong),
            monitor_stream=ZMQStream(monitor),
            **monitor_settings,
        ).start()

    loop = asyncio.new_event_loop()
    try:
        loop.run_until_complete(set_up())
        loop.run_forever()
    finally:
        loop.close()
        context.destroy()


if __name__ == "__main__":
    watch_owner(remove_cluster_dir=True)
    from ipyparallel.controller import app

    app.start_heartmonitor = start_prompt_heart_monitor  # the controller starts its monitor with it
    app.main()
