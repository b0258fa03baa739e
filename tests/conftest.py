"""Shared fixtures: a fresh real nats-server per test, the in-process API server, and an
in-memory span exporter."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator

import pytest
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from services.common.bus import Bus
from services.common.embedded_nats import EmbeddedNats
from services.common.tracing import setup_tracing
from services.simulators.apiserver import FakeApiServer

_exporter = InMemorySpanExporter()
setup_tracing("vgpu-tests", extra_processor=SimpleSpanProcessor(_exporter))


@pytest.fixture
def nats_server() -> Iterator[EmbeddedNats]:
    with EmbeddedNats() as server:
        yield server


@pytest.fixture
async def bus(nats_server: EmbeddedNats) -> AsyncIterator[Bus]:
    connected = await Bus.connect(nats_server.url, "test-client")
    yield connected
    await connected.close()


@pytest.fixture
async def api() -> AsyncIterator[FakeApiServer]:
    """The in-process Kubernetes API server (modules needing tokens override it)."""
    server = FakeApiServer()
    await server.start()
    yield server
    await server.stop()


@pytest.fixture
def spans() -> Iterator[InMemorySpanExporter]:
    """Finished spans of this test only."""
    _exporter.clear()
    yield _exporter
    _exporter.clear()
