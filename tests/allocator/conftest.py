"""A real allocator on a real nats-server, with an in-memory cluster backend."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import aiohttp
import pytest

from services.allocator import Allocator, AllocatorSettings, LocalClusterBackend
from services.common.embedded_nats import EmbeddedNats

MakeAllocator = Callable[..., Awaitable[Allocator]]


@pytest.fixture
async def make_allocator(nats_server: EmbeddedNats) -> AsyncIterator[MakeAllocator]:
    started: list[Allocator] = []

    async def make(backend: LocalClusterBackend | None = None, **settings: Any) -> Allocator:
        allocator = Allocator(
            AllocatorSettings(nats_url=nats_server.url, http_port=0, **settings),
            backend or LocalClusterBackend(),
        )
        await allocator.start()
        started.append(allocator)
        return allocator

    yield make
    for allocator in started:
        await allocator.stop()


@pytest.fixture
async def allocator(make_allocator: MakeAllocator) -> Allocator:
    return await make_allocator()


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as session:
        yield session
