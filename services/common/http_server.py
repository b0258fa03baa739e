"""Serve an aiohttp application on a host and port (0 = any free one): the one start-up
every HTTP edge of vgpu shares (extender, webhook, metrics, simulators, local API).

``bounded_app`` makes an application whose request bodies are capped: a body announced
(Content-Length) or found (chunked) to be over the limit is answered 413 naming the limit and
the setting that raises it, before anything is parsed, and counted in
``vgpu_http_rejected_requests_total{server, reason="body_too_large"}``.
"""

from __future__ import annotations

import ssl
from collections.abc import Awaitable, Callable

import msgspec
from aiohttp import web
from prometheus_client import Counter

REJECTED = Counter(
    "vgpu_http_rejected_requests_total",
    "HTTP requests refused before their handler ran, by server and reason",
    ["server", "reason"],
)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def too_large(
    server: str, limit: int, size: int | None, setting: str, error_key: str
) -> web.Response:
    """The 413 answer: says how big the body was (when known), the limit and its setting."""
    REJECTED.labels(server=server, reason="body_too_large").inc()
    got = f"of {size} bytes " if size is not None else ""
    message = f"request body {got}is over the {limit}-byte limit (setting {setting})"
    return web.Response(
        body=msgspec.json.encode({error_key: message}),
        status=413,
        content_type="application/json",
    )


def bounded_app(
    server: str,
    max_body_bytes: int,
    *,
    setting: str = "max_body_bytes",
    error_key: str = "error",
    middlewares: tuple[Callable[..., Awaitable[web.StreamResponse]], ...] = (),
) -> web.Application:
    """An application whose request bodies may not exceed `max_body_bytes` (413 past it).
    `middlewares` run first (outermost): an identity check refuses before the size does."""

    @web.middleware
    async def limit_body(request: web.Request, handler: Handler) -> web.StreamResponse:
        size = request.content_length
        if size is not None and size > max_body_bytes:
            return too_large(server, max_body_bytes, size, setting, error_key)
        try:
            return await handler(request)
        except web.HTTPRequestEntityTooLarge:  # chunked: found while reading
            return too_large(server, max_body_bytes, None, setting, error_key)

    return web.Application(client_max_size=max_body_bytes, middlewares=[*middlewares, limit_body])


async def serve(
    app: web.Application,
    host: str,
    port: int = 0,
    *,
    ssl_context: ssl.SSLContext | None = None,
    shutdown_timeout: float = 60.0,
) -> tuple[web.AppRunner, int]:
    """The started runner (`await runner.cleanup()` stops it) and the port it got."""
    runner = web.AppRunner(app, access_log=None, shutdown_timeout=shutdown_timeout)
    await runner.setup()
    try:
        await web.TCPSite(runner, host, port, ssl_context=ssl_context).start()
    except BaseException:
        await runner.cleanup()  # a port in use must not leave the runner behind
        raise
    return runner, int(runner.addresses[0][1])
