"""The metrics service when the bus goes and comes back: the live stream's `bus` frame turns
the dashboard's badge to "bus down since ..." and back, and what was decided while it could
not hear (a release, a new booking) is read from the allocator's KV state on reconnection.

The partition is real: the service reaches the real nats-server through a TCP relay that the
test cuts and restores, while the test's own client (the "allocator") keeps the server.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from typing import Any

import aiohttp

from services.common import subjects
from services.common.bus import Bus
from services.common.embedded_nats import EmbeddedNats
from services.common.schemas import AllocationEvent
from services.metrics.service import MetricsService
from tests.metrics.helpers import ALLOCATION, settings, wait_for
from tests.metrics.test_rebuild import pod, records


class Partition:
    """A TCP relay to the NATS port that can be cut (open connections reset, new ones
    refused) and restored on the same port."""

    def __init__(self, target_port: int) -> None:
        self._target = target_port
        self._server: asyncio.Server | None = None
        self._links: set[asyncio.StreamWriter] = set()
        self.port = 0

    async def restore(self) -> None:
        self._server = await asyncio.start_server(self._link, "127.0.0.1", self.port)
        self.port = self._server.sockets[0].getsockname()[1]

    async def cut(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
            self._server = None
        for writer in list(self._links):
            writer.transport.abort()
        self._links.clear()

    async def _link(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self._target)
        self._links.update((writer, up_writer))

        async def pump(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
            with contextlib.suppress(Exception):
                while data := await src.read(65536):
                    dst.write(data)
                    await dst.drain()
            dst.transport.abort()

        await asyncio.gather(pump(reader, up_writer), pump(up_reader, writer))


async def bus_frames(url: str, frames: list[dict[str, Any]]) -> None:
    async with (
        aiohttp.ClientSession() as http,
        http.get(f"{url}/api/v1/events") as response,
    ):
        event = ""
        async for raw in response.content:
            line = raw.decode().rstrip("\n")
            if line.startswith("event: "):
                event = line.removeprefix("event: ")
            elif line.startswith("data: ") and event == "bus":
                frames.append(json.loads(line.removeprefix("data: ")))


async def test_a_partitioned_metrics_service_shows_the_bus_down_and_resyncs(
    nats_server: EmbeddedNats, bus: Bus
) -> None:
    kv = await bus.client.jetstream().create_key_value(bucket="vgpu-allocations")
    await kv.put("node.node-a", records("node-a", ALLOCATION))
    partition = Partition(nats_server.port)
    await partition.restore()
    service = MetricsService(settings(f"nats://127.0.0.1:{partition.port}"))
    await service.start()
    frames: list[dict[str, Any]] = []
    stream = asyncio.create_task(bus_frames(service.url, frames))
    try:
        assert set(service.picture.pods) == {"uid-1"}
        await wait_for(lambda: frames and frames[-1]["connected"] is True)

        await partition.cut()
        await wait_for(lambda: frames[-1]["connected"] is False)
        assert isinstance(frames[-1]["nats_down_since"], float)
        # Meanwhile the allocator releases uid-1 and books uid-2; the events are lost to it.
        await kv.put("node.node-a", records("node-a", pod("uid-2", "two")))
        released = AllocationEvent(kind="released", allocation=ALLOCATION)
        await bus.publish(subjects.alloc_events("node-a"), released)
        await asyncio.sleep(0.3)
        assert set(service.picture.pods) == {"uid-1"}

        await partition.restore()
        await wait_for(lambda: frames[-1]["connected"] is True, timeout=10)
        await wait_for(lambda: set(service.picture.pods) == {"uid-2"}, timeout=10)
    finally:
        stream.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await stream
        await service.stop()
        await partition.cut()
