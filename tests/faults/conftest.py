"""A nats-server whose store outlives a kill -9, the fake API server, and the processes."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import aiohttp
import pytest

from bench.fault_rig import Processes
from services.common.bus import Bus
from services.common.embedded_nats import EmbeddedNats
from services.simulators.apiserver import FakeApiServer


@pytest.fixture
def nats_server(tmp_path: Path) -> Iterator[EmbeddedNats]:
    """On a store directory of the test's, so that a restarted server finds every booking."""
    server = EmbeddedNats(store_dir=str(tmp_path / "jetstream"))
    server.start()
    yield server
    server.stop()


@pytest.fixture
async def bus(nats_server: EmbeddedNats) -> AsyncIterator[Bus]:
    connected = await Bus.connect(nats_server.url, "faults-auditor")
    yield connected
    await connected.close()


@pytest.fixture
def procs(tmp_path: Path, nats_server: EmbeddedNats, api: FakeApiServer) -> Iterator[Processes]:
    processes = Processes(tmp_path, nats_server.url, api.url)
    yield processes
    processes.close()


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as session:
        yield session
