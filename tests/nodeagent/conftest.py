"""Fixtures shared by the node-agent tests: a node's directories and a real allocator."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from services.allocator import Allocator, AllocatorSettings, LocalClusterBackend
from services.common.embedded_nats import EmbeddedNats
from tests.nodeagent.harness import NodeDirs, node_dirs


@pytest.fixture
async def dirs() -> AsyncIterator[NodeDirs]:
    async with node_dirs() as made:
        yield made


@pytest.fixture
async def allocator(nats_server: EmbeddedNats) -> AsyncIterator[Allocator]:
    started = Allocator(
        AllocatorSettings(nats_url=nats_server.url, http_port=0), LocalClusterBackend()
    )
    await started.start()
    yield started
    await started.stop()
