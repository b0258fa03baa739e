"""A minimal HTTP/1.1 client with one keep-alive connection, standing in for kube-scheduler's
Go client (net/http keeps its connection to the extender open): a request is one write and
the answer one read of its headers and Content-Length body. aiohttp's client costs about
0.4 ms a call of Python on each side of the measurement, more than Go's does, so timings
taken with it describe this client rather than the extender."""

from __future__ import annotations

import asyncio
import contextlib
import ssl
from urllib.parse import urlsplit


class HttpError(RuntimeError):
    pass


class KeepAliveClient:
    def __init__(self, url: str, context: ssl.SSLContext | None = None) -> None:
        parts = urlsplit(url)
        self.host, self.port = parts.hostname or "127.0.0.1", parts.port or 80
        self.context = context
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None

    async def post(self, path: str, body: bytes) -> tuple[int, dict[str, str], bytes]:
        """(status, headers with lower-case names, body); reconnects once if the server
        closed the kept-alive connection."""
        for attempt in (0, 1):
            if self._writer is None:
                self._reader, self._writer = await asyncio.open_connection(
                    self.host, self.port, ssl=self.context
                )
            assert self._reader is not None
            head = (
                f"POST {path} HTTP/1.1\r\nHost: {self.host}:{self.port}\r\n"
                f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
            )
            self._writer.write(head.encode() + body)
            try:
                answer = await self._answer(self._reader)
            except (asyncio.IncompleteReadError, ConnectionError):
                await self.close()  # closed while idle: the next attempt opens another
                if attempt:
                    raise
                continue
            if answer[1].get("connection", "").lower() == "close":
                await self.close()
            return answer
        raise AssertionError("unreachable")

    @staticmethod
    async def _answer(reader: asyncio.StreamReader) -> tuple[int, dict[str, str], bytes]:
        status_line, *lines = (await reader.readuntil(b"\r\n\r\n")).decode().split("\r\n")
        headers = {}
        for line in lines:
            name, sep, value = line.partition(":")
            if sep:
                headers[name.strip().lower()] = value.strip()
        if "content-length" not in headers:
            raise HttpError(f"answer without Content-Length: {status_line}")
        data = await reader.readexactly(int(headers["content-length"]))
        return int(status_line.split()[1]), headers, data

    async def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            with contextlib.suppress(ConnectionError, ssl.SSLError):  # already gone
                await self._writer.wait_closed()
        self._reader = self._writer = None
