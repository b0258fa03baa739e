"""The benchmarks' stand-in for kube-scheduler's HTTP client, against a real aiohttp server:
one connection for every call, a new one when the server closed it, and a clear error for
an answer it cannot frame."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
from aiohttp import web

from bench.http_client import HttpError, KeepAliveClient


@pytest.fixture
async def server() -> AsyncIterator[tuple[str, list[object]]]:
    """(base URL, the transport of every request: one per connection, each kept alive here
    so that no two share an id)."""
    transports: list[object] = []

    async def echo(request: web.Request) -> web.Response:
        transports.append(request.transport)
        body = await request.read()
        response = web.Response(body=body[::-1], headers={"Server-Timing": "x;dur=1"})
        if request.query.get("close") == "1":
            response.force_close()  # says Connection: close, and closes after the answer
        return response

    async def chunked(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse()
        response.enable_chunked_encoding()
        await response.prepare(request)
        await response.write(b"part")
        await response.write_eof()
        return response

    app = web.Application()
    app.router.add_post("/echo", echo)
    app.router.add_post("/chunked", chunked)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    yield f"http://127.0.0.1:{port}", transports
    await runner.cleanup()


async def test_calls_share_one_connection(server: tuple[str, list[object]]) -> None:
    url, transports = server
    client = KeepAliveClient(url)
    try:
        for body in (b"abc", b"", b"x" * 100_000):
            status, headers, answer = await client.post("/echo", body)
            assert (status, answer) == (200, body[::-1])
            assert headers["server-timing"] == "x;dur=1"
    finally:
        await client.close()
    assert len(transports) == 3 and len(set(map(id, transports))) == 1


async def test_a_closed_connection_is_opened_again(server: tuple[str, list[object]]) -> None:
    url, transports = server
    client = KeepAliveClient(url)
    try:
        assert (await client.post("/echo?close=1", b"one"))[2] == b"eno"
        assert (await client.post("/echo", b"two"))[2] == b"owt"
    finally:
        await client.close()
    assert len(set(map(id, transports))) == 2


async def test_a_connection_the_server_dropped_while_idle_is_opened_again() -> None:
    async def ok(request: web.Request) -> web.Response:
        return web.Response(body=b"ok")

    app = web.Application()
    app.router.add_post("/", ok)
    runner = web.AppRunner(app, access_log=None, keepalive_timeout=0.1)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    client = KeepAliveClient(f"http://127.0.0.1:{runner.addresses[0][1]}")
    try:
        assert (await client.post("/", b""))[2] == b"ok"
        await asyncio.sleep(0.5)  # the server closes the idle connection meanwhile
        assert (await client.post("/", b""))[2] == b"ok"
    finally:
        await client.close()
        await runner.cleanup()


async def test_an_answer_without_content_length_is_named(server: tuple[str, list[object]]) -> None:
    url, _ = server
    client = KeepAliveClient(url)
    try:
        with pytest.raises(HttpError, match="without Content-Length"):
            await client.post("/chunked", b"")
    finally:
        await client.close()
