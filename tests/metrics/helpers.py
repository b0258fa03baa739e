"""What node agents and the allocator send the metrics service, and ways to read it back."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from services.common import subjects
from services.common.bus import Bus
from services.common.schemas import (
    AllocationEvent,
    ContainerAllocation,
    ContainerDeviceUsage,
    ContainerUsage,
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
GPU_B = GpuDevice(uuid="GPU-a1", index=1, model="A100-40GB", memory_mib=40960, sm_count=108)
INVENTORY = NodeInventory(node="node-a", gpus=[GPU, GPU_B], agent_version="0.1.0")
USAGE = NodeUsage(node="node-a", gpus=[
    GpuUsage(uuid="GPU-a0", memory_used_mib=1024, sm_util_percent=25.0),
    GpuUsage(uuid="GPU-a1", memory_used_mib=0, sm_util_percent=0.0),
])  # fmt: skip
ALLOCATION = PodAllocation(
    namespace="team", name="half", uid="uid-1", node="node-a",
    containers={"main": ContainerAllocation(
        container="main", claimed=True,
        slices=[GpuSlice(uuid="GPU-a0", index=0, memory_mib=20480, cores=50)])},
)  # fmt: skip
CONTAINER_USAGE = ContainerUsage(
    node="node-a", namespace="team", pod="half", container="main",
    devices=[ContainerDeviceUsage(uuid="GPU-a0", index=0, memory_used_mib=8192,
                                  memory_limit_mib=20480, cores_limit=50,
                                  sm_util_percent=30.0)],
    processes=2, launches=1000, throttled_ms=2500,
)  # fmt: skip

Samples = dict[str, dict[tuple[tuple[str, str], ...], float]]


def settings(nats_url: str, **overrides: object) -> MetricsSettings:
    values: dict[str, object] = {"nats_url": nats_url, "http_port": 0, "stream_interval_s": 0.05}
    values.update(overrides)
    return MetricsSettings(**values)  # type: ignore[arg-type]


async def scrape(service: MetricsService) -> Samples:
    async with aiohttp.ClientSession() as session, session.get(f"{service.url}/metrics") as resp:
        assert resp.status == 200
        text = await resp.text()
    found: Samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            found.setdefault(sample.name, {})[tuple(sorted(sample.labels.items()))] = sample.value
    return found


async def get_json(service: MetricsService, path: str) -> tuple[int, object]:
    async with aiohttp.ClientSession() as session, session.get(f"{service.url}{path}") as resp:
        return resp.status, await resp.json()


async def wait_for(condition: Callable[[], object], timeout: float = 5.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not condition():
        if loop.time() > deadline:
            raise AssertionError("condition not met in time")
        await asyncio.sleep(0.02)


async def announce(bus: Bus, service: MetricsService, inventory: NodeInventory) -> None:
    """Publish a node's inventory until the service holds it, as an agent's heartbeat would.

    Every later message waits for this one, so none is dropped as coming before inventory.
    """
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 10
    while inventory.node not in service.picture.nodes:
        assert loop.time() < deadline, f"inventory of {inventory.node} never arrived"
        await bus.publish(subjects.inventory(inventory.node), inventory)
        await asyncio.sleep(0.1)


def key(**labels: str) -> tuple[tuple[str, str], ...]:
    return tuple(sorted(labels.items()))


async def feed(bus: Bus, service: MetricsService) -> None:
    """A node with two GPUs, its usage, one bound pod and that pod's hook report."""
    await announce(bus, service, INVENTORY)
    await bus.publish(subjects.usage("node-a"), USAGE)
    await bus.publish(subjects.alloc_events("node-a"),
                      AllocationEvent(kind="bound", allocation=ALLOCATION))  # fmt: skip
    await bus.publish(subjects.container_usage("node-a"), CONTAINER_USAGE)
    await wait_for(lambda: service.picture.pods and service.picture.containers
                   and service.picture.nodes["node-a"].usage)  # fmt: skip
