"""The Starlette application: routes, error bodies (every one in `protocol.ErrorBody`'s shape), the one middleware
that observes each response for the access log and the metrics, and the lifespan that starts loading and feeds the
watchdog."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from shardstack.serve import routes
from shardstack.serve.accesslog import SCOPE_KEY, AccessLog, JournalSink, api_key_name, request_id, resolve_mode
from shardstack.serve.apierror import ApiError, clip
from shardstack.serve.lifecycle import Service, feed_watchdog
from shardstack.serve.metrics import ServeMetrics

log = logging.getLogger(__name__)


def _error_response(err: ApiError) -> Response:
    return Response(err.json(), status_code=err.status, headers=err.headers, media_type="application/json")


async def _api_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, ApiError)
    return _error_response(exc)


async def _http_error(request: Request, exc: Exception) -> Response:
    """The router's 404 (no such path) and 405 (wrong method) in the same shape as every other error."""
    assert isinstance(exc, HTTPException)
    code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
    headers = dict(exc.headers or {})
    if exc.status_code == 404:
        message = f"no route {clip(request.method, 16)} {clip(request.url.path)}"
    elif exc.status_code == 405:
        message = f"method {clip(request.method, 16)} is not allowed here (allowed: {headers.get('Allow', '')})"
    else:
        message = str(exc.detail)
    return _error_response(ApiError(exc.status_code, message, code=code, headers=headers))


async def _server_error(request: Request, exc: Exception) -> Response:
    log.error("unhandled error on %s %s", request.method, request.url.path, exc_info=exc)
    return _error_response(ApiError(500, "internal server error", code="internal_error"))


class ObserveResponses:
    """The one wrapper around `send`: every HTTP response's status, bytes and time to its last byte are observed
    here once, and both the access log and the /v1/* metrics are fed from that. It also gives each request its id
    (echoed as X-Request-ID) and the dict routes add access-log fields to."""

    def __init__(self, app: ASGIApp, access: AccessLog, metrics: ServeMetrics) -> None:
        self.app = app
        self.access = access
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.monotonic()
        rid = request_id(scope)
        extra: dict[str, Any] = {}
        scope[SCOPE_KEY] = extra
        status, sent = 500, 0  # what the client sees if the app raises before answering
        ended: float | None = None  # when the last body byte went out

        async def send_wrapper(message: Message) -> None:
            nonlocal status, sent, ended
            if message["type"] == "http.response.start":
                status = message["status"]
                message["headers"] = [*message.get("headers", []), (b"x-request-id", rid.encode())]
            elif message["type"] == "http.response.body":
                sent += len(message.get("body", b""))
                if not message.get("more_body"):
                    ended = time.monotonic()
            await send(message)

        try:
            await self.app(scope, receive, send_wrapper)
        finally:
            seconds = (ended if ended is not None else time.monotonic()) - started
            self.access.write(scope, status, sent, seconds * 1000, rid, extra)
            if scope["path"].startswith("/v1/"):
                self._count(scope, status, seconds if ended is not None else None)

    def _count(self, scope: Scope, status: int, seconds: float | None) -> None:
        """Responses by status code and named API key (499: nobody got it), and the time of successful completions
        and chat completions (streamed ones to the last byte)."""
        if status == 499:
            return
        self.metrics.requests.labels(code=str(status), api_key=api_key_name(scope)).inc()
        if seconds is not None and 200 <= status < 300 and scope["path"] in routes.GENERATE_PATHS:
            self.metrics.request_duration.observe(seconds)


def create_app(service: Service) -> Starlette:
    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        service.start_loading()
        watchdog = asyncio.ensure_future(feed_watchdog(service))
        try:
            yield
        finally:
            watchdog.cancel()
            await asyncio.to_thread(service.shutdown)

    mode = resolve_mode(service.settings.access_log, service.settings.journal_socket)
    sink = JournalSink(service.settings.journal_socket) if mode == "journal" else None
    app = Starlette(
        routes=[
            Route(routes.COMPLETIONS_PATH, routes.completions, methods=["POST"]),
            Route(routes.CHAT_PATH, routes.chat_completions, methods=["POST"]),
            Route("/v1/models", routes.models, methods=["GET"]),
            Route("/health", routes.health, methods=["GET"]),
            Route("/info", routes.info, methods=["GET"]),
            Route("/metrics", routes.metrics, methods=["GET"]),
        ],
        # Around the router: it sees every response, its 404s and 405s included (an unhandled error as 500).
        middleware=[Middleware(ObserveResponses, access=AccessLog(mode, sink), metrics=service.metrics)],
        exception_handlers={ApiError: _api_error, HTTPException: _http_error, Exception: _server_error},
        lifespan=lifespan,
    )
    app.state.service = service
    return app
