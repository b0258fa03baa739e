"""The Kubernetes backend through the real `kubernetes` client against the in-process API
server: Binding, the decision annotation, Events, the pod watch and the rebuild."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator

import aiohttp
import pytest

from services.allocator import ALLOCATION_ANNOTATION, Allocator, AllocatorSettings
from services.allocator.kube import KubernetesBackend
from services.common.bus import Bus
from services.common.embedded_nats import EmbeddedNats
from services.simulators.apiserver import FakeApiServer

from .helpers import (
    bind_args,
    container,
    eventually,
    filter_args,
    filter_then_bind,
    give_nodes,
    node_inventory,
    pod,
    post,
)


@pytest.fixture
async def kube_allocators(
    nats_server: EmbeddedNats, api: FakeApiServer
) -> AsyncIterator[list[Allocator]]:
    started: list[Allocator] = []
    yield started
    for allocator in started:
        await allocator.stop()


async def start(started: list[Allocator], nats_url: str, api: FakeApiServer, **extra) -> Allocator:
    settings = AllocatorSettings(
        nats_url=nats_url, http_port=0, cluster="kubernetes", kube_api_url=api.url,
        lease_ttl_s=1.0, **extra,
    )  # fmt: skip
    allocator = Allocator(settings)
    await allocator.start()
    started.append(allocator)
    return allocator


async def test_bind_annotates_binds_and_the_watch_releases(
    kube_allocators: list[Allocator], nats_server: EmbeddedNats, api: FakeApiServer, bus: Bus
) -> None:
    allocator = await start(kube_allocators, nats_server.url, api)
    await give_nodes(bus, allocator, node_inventory("n1", count=2))
    created = await api.create_pod(
        pod("train", [container("worker", mem=8000), container("side", mem=1000)], namespace="ml")
    )
    async with aiohttp.ClientSession() as http:
        _, result = await post(
            http, f"{allocator.url}/scheduler/filter", filter_args(created, ["n1"])
        )
        assert result["NodeNames"] == ["n1"]
        _, answer = await post(http, f"{allocator.url}/scheduler/bind", bind_args(created, "n1"))
    assert answer == {"Error": ""}
    stored = api.pods[("ml", "train")]
    assert stored["spec"]["nodeName"] == "n1"
    assert api.bindings[-1]["metadata"]["uid"] == created["metadata"]["uid"]
    annotation = json.loads(stored["metadata"]["annotations"][ALLOCATION_ANNOTATION])
    assert set(annotation) == {"worker", "side"} and annotation["worker"][0]["memory_mib"] == 8000

    await eventually(lambda: allocator.leading)
    await api.set_phase("ml", "train", "Succeeded")
    await eventually(lambda: len(allocator.ledger) == 0)

    other = await api.create_pod(pod("other", [container("m", mem=100)], namespace="ml"))
    async with aiohttp.ClientSession() as http:
        assert await filter_then_bind(http, allocator.url, other, "n1") == {"Error": ""}
    assert len(allocator.ledger) == 1
    await api.delete_pod("ml", "other")
    await eventually(lambda: len(allocator.ledger) == 0)


async def test_unschedulable_pod_gets_an_event(
    kube_allocators: list[Allocator], nats_server: EmbeddedNats, api: FakeApiServer, bus: Bus
) -> None:
    allocator = await start(kube_allocators, nats_server.url, api)
    await give_nodes(bus, allocator, node_inventory("n1", count=1))
    await eventually(lambda: allocator.leading)
    huge = await api.create_pod(pod("huge", [container("m", mem=10**6)], namespace="ml"))
    async with aiohttp.ClientSession() as http:
        await post(http, f"{allocator.url}/scheduler/filter", filter_args(huge, ["n1"]))
    await eventually(lambda: len(api.events) == 1)
    event = api.events[0]
    assert event["reason"] == "VgpuUnschedulable" and event["type"] == "Warning"
    assert event["involvedObject"]["uid"] == huge["metadata"]["uid"]
    assert "nvidia.com/gpumem: 1000000" in event["message"]


async def test_rebuild_from_pod_annotations_when_the_store_is_empty(
    kube_allocators: list[Allocator], nats_server: EmbeddedNats, api: FakeApiServer, bus: Bus
) -> None:
    first = await start(kube_allocators, nats_server.url, api, state_bucket="")
    await give_nodes(bus, first, node_inventory("n1", count=1))
    p = await api.create_pod(
        pod("keep", [container("m", mem=5000)], init=[container("i", mem=100)])
    )
    gone = await api.create_pod(pod("gone", [container("m", mem=5000)]))
    async with aiohttp.ClientSession() as http:
        for each in (p, gone):
            assert await filter_then_bind(http, first.url, each, "n1") == {"Error": ""}
    await first.stop()
    kube_allocators.remove(first)
    await api.delete_pod("default", "gone")  # deleted while no allocator ran

    second = await start(kube_allocators, nats_server.url, api, state_bucket="")
    await give_nodes(bus, second, node_inventory("n1", count=1))
    await eventually(lambda: len(second.ledger) == 1)
    (rebuilt,) = second.engine.allocations()
    assert rebuilt.uid == p["metadata"]["uid"] and rebuilt.containers["i"].init
    assert second.ledger.reserved("n1")["GPU-n1-0"].memory_mib == 5000


async def test_an_api_server_that_never_answers_fails_each_call_in_bounded_time() -> None:
    """A socket that takes requests and answers nothing (a stalled API server): every call
    the allocator's binds make fails after the request timeout instead of hanging forever."""

    async def swallow(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(ConnectionError):
            while await reader.read(65536):
                pass  # read the request, never answer
        writer.close()

    server = await asyncio.start_server(swallow, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    backend = KubernetesBackend.for_url(f"http://127.0.0.1:{port}", request_timeout_s=0.5)
    calls = {
        "bind": backend.bind("ml", "p", "uid-p", "n1"),
        "annotate": backend.annotate("ml", "p", {"a": "b"}),
        "read": backend.get_pod("ml", "p"),
        "event": backend.emit_event("ml", "p", "uid-p", "Reason", "message"),
    }
    try:
        for what, call in calls.items():
            started = time.monotonic()
            with pytest.raises(Exception) as raised:
                await asyncio.wait_for(call, timeout=30)
            assert not isinstance(raised.value, TimeoutError), f"{what} hung"
            assert time.monotonic() - started < 10, what
    finally:
        await backend.close()
        server.close()
        await server.wait_closed()
