"""Serve an aiohttp application on a host and port (0 = any free one): the one start-up
every HTTP edge of vgpu shares (extender, webhook, metrics, simulators, local API)."""

from __future__ import annotations

import ssl

from aiohttp import web


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
