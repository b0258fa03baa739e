"""Binds whose call to the API server fails although the API server acted on it (issue 15: a
pod bound but not booked). The allocator reaches the real in-process API server through a
TCP relay (tests/allocator/relay.py) that lets the Binding through and loses its answer:

- the pod can be read back and is bound to the booking's node: the bind stands, the
  booking stays (it was rolled back before: a pod bound that nothing booked);
- the pod cannot be read back (the API server is unreachable now): the outcome is unknown,
  the bind fails and the booking stays; the reconciler frees it later if the pod is never
  bound (tests/allocator/test_reconcile.py).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any
from urllib.parse import urlparse

import aiohttp
import pytest

from services.allocator import Allocator, AllocatorSettings
from services.common.bus import Bus
from services.common.embedded_nats import EmbeddedNats
from services.simulators.apiserver import FakeApiServer

from .helpers import (
    bind_args,
    container,
    filter_args,
    give_nodes,
    node_inventory,
    pod,
    post,
    stored_pods,
)
from .relay import Relay


@pytest.fixture
async def relayed(
    nats_server: EmbeddedNats, api: FakeApiServer, bus: Bus
) -> AsyncIterator[tuple[Relay, Allocator]]:
    relay = await Relay(urlparse(api.url).port or 0).start()
    settings = AllocatorSettings(
        nats_url=nats_server.url, http_port=0, cluster="kubernetes",
        kube_api_url=f"http://{relay.url}", lease_ttl_s=1.0,
    )  # fmt: skip
    allocator = Allocator(settings)
    await allocator.start()
    await give_nodes(bus, allocator, node_inventory("n1", count=1))
    yield relay, allocator
    await relay.start()
    await allocator.stop()
    await relay.stop()


async def stored_uids(bus: Bus) -> set[str]:
    return {a.uid for a in await stored_pods(bus, "n1")}


async def bind_losing_its_answer(
    relay: Relay, allocator: Allocator, p: dict[str, Any]
) -> dict[str, Any]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as http:
        _, passed = await post(http, f"{allocator.url}/scheduler/filter", filter_args(p, ["n1"]))
        assert passed["NodeNames"] == ["n1"], passed
        relay.lose_answer_to = b"/binding"
        _, answer = await post(http, f"{allocator.url}/scheduler/bind", bind_args(p, "n1"))
    assert relay.answers_lost == 1
    return answer


async def test_a_binding_made_whose_answer_was_lost_keeps_its_booking(
    api: FakeApiServer, bus: Bus, relayed: tuple[Relay, Allocator]
) -> None:
    relay, allocator = relayed
    p = await api.create_pod(pod("answer-lost", [container("m", mem=10000)], namespace="ml"))
    uid = p["metadata"]["uid"]
    answer = await bind_losing_its_answer(relay, allocator, p)
    assert answer == {"Error": ""}
    assert api.pods[("ml", "answer-lost")]["spec"]["nodeName"] == "n1"
    assert uid in allocator.ledger and uid in await stored_uids(bus)


async def test_a_binding_whose_outcome_cannot_be_read_keeps_its_booking_and_fails(
    api: FakeApiServer, bus: Bus, relayed: tuple[Relay, Allocator]
) -> None:
    relay, allocator = relayed
    p = await api.create_pod(pod("unknown", [container("m", mem=10000)], namespace="ml"))
    uid = p["metadata"]["uid"]
    relay.down_after_loss = True  # and the API server is unreachable afterwards
    answer = await bind_losing_its_answer(relay, allocator, p)
    assert "cannot be read back" in answer["Error"] and "booking is kept" in answer["Error"]
    assert api.pods[("ml", "unknown")]["spec"]["nodeName"] == "n1"  # it was bound
    assert uid in allocator.ledger and uid in await stored_uids(bus)
