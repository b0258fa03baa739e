"""The JSON API and the server-sent-event stream, over real HTTP."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp

from services.common import subjects
from services.common.bus import Bus
from services.common.embedded_nats import EmbeddedNats
from services.common.schemas import AllocationEvent
from services.metrics.service import MetricsService
from services.metrics.stream import DROPPED
from tests.metrics.helpers import (
    ALLOCATION,
    CONTAINER_USAGE,
    INVENTORY,
    USAGE,
    announce,
    get_json,
    settings,
    wait_for,
)


async def next_event(
    content: aiohttp.StreamReader, timeout: float = 5.0, skip: tuple[str, ...] = ("bus",)
) -> tuple[str, Any]:
    """The next SSE event (comments and retry lines skipped, and `bus` frames unless asked
    for: tests/metrics/test_bus_resync.py covers them) as (name, decoded data)."""
    name, data = "message", ""
    async with asyncio.timeout(timeout):
        while True:
            line = (await content.readline()).decode()
            if line == "":
                raise EOFError("the stream ended")
            line = line.rstrip("\n")
            if line.startswith("event: "):
                name = line[7:]
            elif line.startswith("data: "):
                data += line[6:]
            elif line == "" and data:
                if name not in skip:
                    return name, json.loads(data)
                name, data = "message", ""


async def test_picture_pod_and_pending_endpoints(metrics: MetricsService, bus: Bus) -> None:
    await announce(bus, metrics, INVENTORY)
    await bus.publish(subjects.usage("node-a"), USAGE)
    await bus.publish(subjects.alloc_events("node-a"),
                      AllocationEvent(kind="bound", allocation=ALLOCATION))  # fmt: skip
    await bus.publish(subjects.container_usage("node-a"), CONTAINER_USAGE)
    await wait_for(lambda: metrics.picture.containers and metrics.picture.pods)

    status, body = await get_json(metrics, "/api/v1/picture")
    assert status == 200 and isinstance(body, dict)
    assert body["totals"] == {
        "nodes": 1, "nodes_up": 1, "gpus": 2, "gpus_healthy": 2, "memory_mib": 81920,
        "memory_allocated_mib": 20480, "memory_used_mib": 1024, "cores": 200,
        "cores_allocated": 50, "slices": 1, "pods": 1, "pending_pods": 0,
        "free_memory_mib": 61440, "stranded_memory_mib": 0,
    }  # fmt: skip
    gpu = body["nodes"][0]["gpus"][0]
    figures = (gpu["uuid"], gpu["memory_allocated_mib"], gpu["memory_used_mib"])
    assert figures == ("GPU-a0", 20480, 1024)
    assert gpu["slices"] == [{
        "namespace": "team", "pod": "half", "pod_uid": "uid-1", "container": "main",
        "init": False, "claimed": True, "memory_mib": 20480, "cores": 50,
        "memory_limit_mib": 20480, "cores_limit": 50, "memory_used_mib": 8192,
        "sm_util_percent": 30.0, "measured_mib": None, "violation": "", "spilled_mib": 0,
        "over_limit": False, "tampering": False, "over_compute": False, "violation_reasons": [],
        "violation_since": None,
    }]  # fmt: skip

    status, pod = await get_json(metrics, "/api/v1/pods/team/half")
    assert status == 200 and isinstance(pod, dict)
    container = pod["containers"][0]
    assert (container["name"], container["processes"], container["throttled_ms"]) == (
        "main", 2, 2500)  # fmt: skip
    assert container["devices"][0]["memory_used_mib"] == 8192

    status, missing = await get_json(metrics, "/api/v1/pods/team/nope")
    assert status == 404 and missing == {"error": "no GPU pod team/nope is known"}
    status, health = await get_json(metrics, "/healthz")
    assert status == 200 and health == {"ok": True, "nats_connected": True, "nodes": 1,
                                        "pods": 1, "nats_url": metrics.settings.nats_url,
                                        "nats_down_since": None}  # fmt: skip


async def test_stream_sends_a_snapshot_then_changes(metrics: MetricsService, bus: Bus) -> None:
    await announce(bus, metrics, INVENTORY)
    async with (
        aiohttp.ClientSession() as session,
        session.get(f"{metrics.url}/api/v1/events") as resp,
    ):
        assert resp.headers["Content-Type"] == "text/event-stream"
        name, snapshot = await next_event(resp.content)
        assert name == "snapshot"
        assert [n["name"] for n in snapshot["nodes"]] == ["node-a"] and snapshot["pods"] == []

        await bus.publish(subjects.alloc_events("node-a"),
                          AllocationEvent(kind="bound", allocation=ALLOCATION))  # fmt: skip
        name, change = await next_event(resp.content)
        assert name == "change"
        assert [p["name"] for p in change["pods"]] == ["half"]
        assert change["nodes"][0]["gpus"][0]["slices"][0]["pod"] == "half"
        assert change["totals"]["slices"] == 1 and change["pending"] is None

        await bus.publish(subjects.alloc_events("node-a"),
                          AllocationEvent(kind="released", allocation=ALLOCATION))  # fmt: skip
        name, change = await next_event(resp.content)
        assert change["removed_pods"] == ["uid-1"]
        assert change["nodes"][0]["gpus"][0]["slices"] == []


async def test_a_stream_ends_when_the_service_stops(nats_server: EmbeddedNats) -> None:
    service = MetricsService(settings(nats_server.url))
    await service.start()
    async with (
        aiohttp.ClientSession() as session,
        session.get(f"{service.url}/api/v1/events") as resp,
    ):
        assert (await next_event(resp.content))[0] == "snapshot"
        name, bus = await next_event(resp.content, skip=())
        assert name == "bus" and bus["connected"] is True
        started = asyncio.get_running_loop().time()
        await service.stop()
        assert await resp.content.read() == b""  # ended, not hanging
        assert asyncio.get_running_loop().time() - started < 3
    await service.stop()  # idempotent


async def test_a_client_that_lags_is_dropped_and_can_start_again(
    nats_server: EmbeddedNats, bus: Bus
) -> None:
    service = MetricsService(settings(nats_server.url, stream_queue=1))
    await service.start()
    try:
        dropped = DROPPED._value.get()
        client = service.stream.subscribe()  # a client that never reads
        await announce(bus, service, INVENTORY)
        for _ in range(50):  # each flush makes a batch; the second one overflows its queue
            await bus.publish(subjects.usage("node-a"), USAGE)
            await asyncio.sleep(0.1)
            if DROPPED._value.get() > dropped:
                break
        assert DROPPED._value.get() == dropped + 1
        assert not service.stream.has_clients
        drained = [client.queue.get_nowait() for _ in range(client.queue.qsize())]
        assert drained == [None]  # its stream is told to end; EventSource reconnects
        _, body = await get_json(service, "/api/v1/picture")
        assert isinstance(body, dict) and body["totals"]["nodes"] == 1
    finally:
        await service.stop()


async def test_api_requests_join_the_callers_trace(metrics: MetricsService, spans: Any) -> None:
    trace_id = "4bf92f3577b34da6a3ce929d0e0e4736"
    headers = {"traceparent": f"00-{trace_id}-00f067aa0ba902b7-01"}
    async with (
        aiohttp.ClientSession() as session,
        session.get(f"{metrics.url}/api/v1/pods/a/b", headers=headers) as resp,
    ):
        assert resp.status == 404
    served = [s for s in spans.get_finished_spans() if s.name.startswith("metrics GET")]
    assert [s.name for s in served] == ["metrics GET /api/v1/pods/{namespace}/{name}"]
    assert format(served[0].context.trace_id, "032x") == trace_id
