"""The shared HTTP start-up: a free port when asked for 0, a clean failure on a taken one."""

from __future__ import annotations

import aiohttp
import pytest
from aiohttp import web

from services.common.http_server import serve


async def _up(request: web.Request) -> web.Response:
    return web.Response(text="up")


async def test_serves_on_a_free_port_and_a_taken_port_fails_cleanly() -> None:
    app = web.Application()
    app.router.add_get("/", _up)
    runner, port = await serve(app, "127.0.0.1")
    try:
        assert port > 0
        async with (
            aiohttp.ClientSession() as session,
            session.get(f"http://127.0.0.1:{port}/") as response,
        ):
            assert await response.text() == "up"
        with pytest.raises(OSError):
            await serve(web.Application(), "127.0.0.1", port)
    finally:
        await runner.cleanup()
