"""The metrics service over a real nats-server and real HTTP."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from services.common import subjects
from services.common.bus import UNDECODABLE, Bus
from services.common.embedded_nats import EmbeddedNats
from services.common.schemas import (
    AllocationEvent,
    ContainerAllocation,
    GpuDevice,
    GpuSlice,
    GpuUsage,
    NodeInventory,
    NodeUsage,
    PodAllocation,
)
from services.metrics.service import MetricsService
from services.metrics.settings import MetricsSettings

MIB = 1024 * 1024
GPU = GpuDevice(uuid="GPU-a0", index=0, model="A100-40GB", memory_mib=40960, sm_count=108)
ALLOCATION = PodAllocation(
    namespace="team", name="half", uid="uid-1", node="node-a",
    containers={"main": ContainerAllocation(
        container="main", slices=[GpuSlice(uuid="GPU-a0", index=0, memory_mib=20480, cores=50)])},
)  # fmt: skip


@pytest.fixture
async def metrics(nats_server: EmbeddedNats) -> AsyncIterator[MetricsService]:
    service = MetricsService(MetricsSettings(nats_url=nats_server.url, http_port=0))
    await service.start()
    yield service
    await service.stop()


async def scrape(service: MetricsService) -> dict[str, dict[tuple[tuple[str, str], ...], float]]:
    async with aiohttp.ClientSession() as session, session.get(f"{service.url}/metrics") as resp:
        assert resp.status == 200
        text = await resp.text()
    found: dict[str, dict[tuple[tuple[str, str], ...], float]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            found.setdefault(sample.name, {})[tuple(sorted(sample.labels.items()))] = sample.value
    return found


async def wait_for(condition: object, timeout: float = 3.0) -> None:
    for _ in range(int(timeout / 0.02)):
        if callable(condition) and condition():
            return
        await asyncio.sleep(0.02)
    raise AssertionError("condition not met in time")


GPU_KEY = (("index", "0"), ("model", "A100-40GB"), ("node", "node-a"), ("uuid", "GPU-a0"))


async def test_gpu_and_container_families_with_labels(metrics: MetricsService, bus: Bus) -> None:
    await bus.publish(subjects.inventory("node-a"), NodeInventory(node="node-a", gpus=[GPU]))
    await wait_for(lambda: "node-a" in metrics.picture.nodes)
    usage = NodeUsage(node="node-a", gpus=[GpuUsage(uuid="GPU-a0", memory_used_mib=1024,
                                                    sm_util_percent=25.0)])  # fmt: skip
    await bus.publish(subjects.usage("node-a"), usage)
    await bus.publish(
        subjects.alloc_events("node-a"), AllocationEvent(kind="bound", allocation=ALLOCATION)
    )
    await wait_for(lambda: metrics.picture.pods and metrics.picture.nodes["node-a"].usage)

    found = await scrape(metrics)
    assert found["vgpu_node_up"][(("node", "node-a"),)] == 1.0
    assert found["vgpu_gpu_memory_total_bytes"][GPU_KEY] == 40960 * MIB
    assert found["vgpu_gpu_memory_used_bytes"][GPU_KEY] == 1024 * MIB
    assert found["vgpu_gpu_sm_utilization_ratio"][GPU_KEY] == 0.25
    assert found["vgpu_gpu_memory_allocated_bytes"][GPU_KEY] == 20480 * MIB
    assert found["vgpu_gpu_core_allocated_ratio"][GPU_KEY] == 0.5
    assert found["vgpu_gpu_slices"][GPU_KEY] == 1
    container_key = (("container", "main"), ("index", "0"), ("namespace", "team"),
                     ("node", "node-a"), ("pod", "half"), ("uuid", "GPU-a0"))  # fmt: skip
    assert found["vgpu_container_memory_limit_bytes"][container_key] == 20480 * MIB

    await bus.publish(
        subjects.alloc_events("node-a"), AllocationEvent(kind="released", allocation=ALLOCATION)
    )
    await wait_for(lambda: not metrics.picture.pods)
    found = await scrape(metrics)
    assert found["vgpu_gpu_memory_allocated_bytes"][GPU_KEY] == 0
    assert "vgpu_container_memory_limit_bytes" not in found


async def test_a_silent_node_is_down_not_idle(nats_server: EmbeddedNats, bus: Bus) -> None:
    service = MetricsService(
        MetricsSettings(nats_url=nats_server.url, http_port=0, stale_after_s=0.2)
    )
    await service.start()
    try:
        await bus.publish(subjects.inventory("node-a"), NodeInventory(node="node-a", gpus=[GPU]))
        usage = NodeUsage(node="node-a", gpus=[GpuUsage(uuid="GPU-a0", memory_used_mib=0,
                                                        sm_util_percent=0.0)])  # fmt: skip
        await bus.publish(subjects.usage("node-a"), usage)
        await wait_for(lambda: service.picture.nodes.get("node-a") is not None)
        await asyncio.sleep(0.4)
        found = await scrape(service)
        assert found["vgpu_node_up"][(("node", "node-a"),)] == 0.0
        assert GPU_KEY not in found.get("vgpu_gpu_memory_used_bytes", {})
    finally:
        await service.stop()


async def test_malformed_events_are_counted_and_later_ones_still_land(
    metrics: MetricsService, bus: Bus
) -> None:
    subject = subjects.alloc_events("node-a")
    before = UNDECODABLE.labels(subject=subject)._value.get()
    await bus.client.publish(subject, b'{"kind": "bound", "allocation": {"namespace": 1}}')
    await bus.publish(subject, AllocationEvent(kind="bound", allocation=ALLOCATION))
    await wait_for(lambda: metrics.picture.pods)
    assert UNDECODABLE.labels(subject=subject)._value.get() == before + 1
    found = await scrape(metrics)
    assert (("subject", subject),) in found["vgpu_bus_undecodable_messages_total"]


async def test_picture_api_serves_nodes_and_pods(metrics: MetricsService, bus: Bus) -> None:
    await bus.publish(subjects.inventory("node-a"), NodeInventory(node="node-a", gpus=[GPU]))
    await bus.publish(
        subjects.alloc_events("node-a"), AllocationEvent(kind="bound", allocation=ALLOCATION)
    )
    await wait_for(lambda: metrics.picture.pods and metrics.picture.nodes)
    async with (
        aiohttp.ClientSession() as session,
        session.get(f"{metrics.url}/api/v1/picture") as resp,
    ):
        body = await resp.json()
    assert body["nodes"]["node-a"]["up"] is True
    assert body["nodes"]["node-a"]["gpus"][0]["uuid"] == "GPU-a0"
    assert body["pods"][0]["containers"]["main"]["slices"][0]["memory_mib"] == 20480
