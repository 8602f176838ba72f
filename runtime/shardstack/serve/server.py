"""Run the app under uvicorn, with a drain on SIGTERM instead of uvicorn's immediate close.

uvicorn's own handler stops listening at once, so a load balancer would see refused connections. Here the
first SIGTERM (or SIGINT) keeps the socket open, answers new completions with 503 (and /health with 503, so
the balancer takes the replica out), lets in-flight requests finish and waits until the balancer has stopped
sending (drain.py), for up to `drain_seconds` in all, aborts what is left, then shuts uvicorn down and exits 0.
A second SIGINT forces an immediate exit.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import socket
from pathlib import Path
from types import FrameType

import uvicorn

from shardstack.serve.app import create_app
from shardstack.serve.lifecycle import Service

log = logging.getLogger(__name__)


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, service: Service) -> None:
        super().__init__(config)
        self.service = service
        self.exit_code = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain_task: asyncio.Task[None] | None = None
        self._drain_requested = False

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        self.service.on_failure = self._on_load_failure
        await super().startup(sockets)
        if self.started:
            self.service.mark_listening()

    def _on_load_failure(self) -> None:  # called from the loader thread
        self.exit_code = 1
        self.should_exit = True

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # Not recorded in _captured_signals: uvicorn would re-raise it after shutdown and we would die by it
        # instead of exiting 0 after a clean drain.
        name = signal.Signals(sig).name
        if self._drain_requested:
            if sig == signal.SIGINT:  # a second interrupt: stop now, skip the graceful close
                log.warning("signal %s during drain: exiting now", name)
                self.force_exit = self.should_exit = True
            return
        if self._loop is None or self.service.phase != "ready":  # loading or failed: nothing to drain
            log.info("signal %s while %s: exiting", name, self.service.phase)
            self.should_exit = True
            return
        self._drain_requested = True
        log.info("signal %s: draining (no new requests; in-flight ones get %.0fs)",
                 name, self.service.settings.drain_seconds)
        self._loop.call_soon_threadsafe(self._start_drain)

    def _start_drain(self) -> None:
        if self.service.begin_drain():
            self._drain_task = asyncio.ensure_future(self._drain())

    async def _drain(self) -> None:
        engine, clock = self.service.engine, self.service.drain
        assert clock is not None  # begin_drain set it
        while not clock.done(engine.in_flight() if engine is not None else 0):
            await asyncio.sleep(0.05)
        if engine is not None and engine.in_flight():
            n = engine.abort_all("server shutting down")
            log.warning("drain timed out; aborted %d request(s)", n)
        log.info("drain complete; shutting down")
        self.should_exit = True


def serve(service: Service, host: str, port: int, *, log_level: str = "info", tls_cert: Path | None = None,
          tls_key: Path | None = None) -> int:
    """Serve until drained or failed; the return value is the process exit code. With `tls_cert` and `tls_key`
    (PEM): HTTPS only on the port."""
    config = uvicorn.Config(
        create_app(service),
        host=host,
        port=port,
        log_level=log_level,
        access_log=False,  # ours instead (accesslog.py): structured fields under journald
        lifespan="on",
        # After the drain only finished responses are left to flush; keep-alive sockets close at once.
        timeout_graceful_shutdown=5,
        timeout_keep_alive=5,
        # uvicorn builds its context with ssl.PROTOCOL_TLS_SERVER, whose floor is TLS 1.2 since Python 3.10 (we
        # need 3.11): older clients are refused (tested). No client certificates: the bearer token authenticates.
        ssl_certfile=str(tls_cert) if tls_cert else None,
        ssl_keyfile=str(tls_key) if tls_key else None,
    )
    server = DrainingServer(config, service)
    server.run()
    if not server.started and server.exit_code == 0:
        return 1  # e.g. the port was taken; uvicorn logged why
    return server.exit_code
