"""A metrics service on a real nats-server, per test."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from services.common.embedded_nats import EmbeddedNats
from services.metrics.service import MetricsService
from tests.metrics.helpers import settings


@pytest.fixture
async def metrics(nats_server: EmbeddedNats) -> AsyncIterator[MetricsService]:
    service = MetricsService(settings(nats_server.url))
    await service.start()
    yield service
    await service.stop()
