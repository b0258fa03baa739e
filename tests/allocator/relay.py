"""A TCP relay between a client and a real server (nats-server, the API server) that loses
what a broken network loses, on demand: the bytes of one direction, the answer to one
request, or every connection at once. The client reconnects through it."""

from __future__ import annotations

import asyncio
import contextlib


class Relay:
    def __init__(self, target_port: int) -> None:
        self._target = target_port
        self._links: set[asyncio.StreamWriter] = set()
        self._server: asyncio.Server | None = None
        self.drop_answers = False  # server -> client bytes are lost
        self.drop_requests = False  # client -> server bytes are lost
        # A request whose bytes hold this marker reaches the server, but its answer is lost
        # and the connection breaks (the server acted; the client never hears of it).
        self.lose_answer_to: bytes | None = None
        self.answers_lost = 0
        self.down_after_loss = False  # and then refuse connections until `start` again
        self.port = 0

    async def start(self) -> Relay:
        if self._server is not None:
            return self
        self._server = await asyncio.start_server(self._link, "127.0.0.1", self.port)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    @property
    def url(self) -> str:
        return f"127.0.0.1:{self.port}"

    def reset(self) -> None:
        """Break every connection through the relay (as a killed server or a cut cable)."""
        for writer in list(self._links):
            writer.transport.abort()
        self._links.clear()

    async def stop(self) -> None:
        """Refuse new connections and break the open ones (`start` again to restore)."""
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
            self._server = None
        self.reset()

    async def _link(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self._target)
        self._links.update((writer, up_writer))
        losing = asyncio.Event()  # this link's next answer is to be lost

        async def requests() -> None:
            with contextlib.suppress(Exception):
                while data := await reader.read(65536):
                    if self.lose_answer_to is not None and self.lose_answer_to in data:
                        self.lose_answer_to = None
                        losing.set()
                    if not self.drop_requests:
                        up_writer.write(data)
                        await up_writer.drain()
            up_writer.transport.abort()

        async def answers() -> None:
            with contextlib.suppress(Exception):
                while data := await up_reader.read(65536):
                    if losing.is_set():
                        self.answers_lost += 1
                        if self.down_after_loss and self._server is not None:
                            self._server.close()
                            self._server = None
                            self.reset()
                        break
                    if not self.drop_answers:
                        writer.write(data)
                        await writer.drain()
            writer.transport.abort()
            up_writer.transport.abort()

        await asyncio.gather(requests(), answers())
