"""A node whose agent states memory scaling > 1 (4paradigm's --device-memory-scaling) is
shown oversubscribed in the metrics and in `vgpu inspect`, over a real nats-server and HTTP."""

from __future__ import annotations

import asyncio

import msgspec

from services.cli.inspect import fetch_picture, render
from services.common import subjects
from services.common.bus import Bus
from services.common.schemas import AllocationEvent, NodeInventory
from services.metrics.service import MetricsService
from tests.metrics.helpers import (
    ALLOCATION,
    CONTAINER_USAGE,
    GPU,
    GPU_B,
    MIB,
    announce,
    key,
    scrape,
    wait_for,
)

SCALED = NodeInventory(
    node="node-a",
    gpus=[msgspec.structs.replace(g, memory_scaling=1.5, cores_scaling=2.0) for g in (GPU, GPU_B)],
)


async def test_scaled_gpus_are_shown_oversubscribed(metrics: MetricsService, bus: Bus) -> None:
    await announce(bus, metrics, SCALED)
    await bus.publish(subjects.alloc_events("node-a"),
                      AllocationEvent(kind="bound", allocation=ALLOCATION))  # fmt: skip
    await wait_for(lambda: metrics.picture.pods)
    found = await scrape(metrics)
    labels = key(node="node-a", uuid="GPU-a0", index="0", model="A100-40GB")
    assert found["vgpu_gpu_memory_scaling"][labels] == 1.5
    assert found["vgpu_gpu_memory_oversubscribed"][labels] == 1.0
    assert found["vgpu_gpu_cores_scaling"][labels] == 2.0
    device = key(node="node-a", device_uuid="GPU-a0", device_index="0",
                 device_type="NVIDIA-A100-40GB", zone="vGPU")  # fmt: skip
    assert found["hami_gpu_memory_limit_bytes"][device] == 61440 * MIB  # as HAMi registers it
    assert found["hami_gpu_core_limit_ratio"][device] == 200

    table = render(await asyncio.to_thread(fetch_picture, metrics.url, 5.0))
    assert "20480/40960 (50%) oversubscribed x1.5" in table
    assert "50/200%" in table
    assert "Allocated/Total compute in cluster:    50/400%" in table


async def test_unscaled_gpus_placed_with_the_allocators_scaling(
    metrics: MetricsService, bus: Bus
) -> None:
    """An agent that states nothing: the figure the allocator placed with is shown."""
    await announce(bus, metrics, NodeInventory(node="node-a", gpus=[GPU, GPU_B]))
    placed = msgspec.structs.replace(ALLOCATION, memory_scaling=2.0)
    await bus.publish(subjects.alloc_events("node-a"),
                      AllocationEvent(kind="bound", allocation=placed))  # fmt: skip
    await wait_for(lambda: metrics.picture.pods)
    found = await scrape(metrics)
    assert (
        found["vgpu_gpu_memory_oversubscribed"][
            key(node="node-a", uuid="GPU-a0", index="0", model="A100-40GB")
        ]
        == 1.0
    )
    assert (
        found["vgpu_gpu_memory_oversubscribed"][
            key(node="node-a", uuid="GPU-a1", index="1", model="A100-40GB")
        ]
        == 0.0
    )


async def test_spilled_memory_is_reported_apart(metrics: MetricsService, bus: Bus) -> None:
    """Virtual device memory: what a container's hook spilled is a gauge of its own and shows
    in `vgpu inspect -d` beside the memory used (of which it is part)."""
    await announce(bus, metrics, SCALED)
    await bus.publish(subjects.alloc_events("node-a"),
                      AllocationEvent(kind="bound", allocation=ALLOCATION))  # fmt: skip
    device = msgspec.structs.replace(CONTAINER_USAGE.devices[0], spilled_mib=3000)
    await bus.publish(subjects.container_usage("node-a"),
                      msgspec.structs.replace(CONTAINER_USAGE, devices=[device]))  # fmt: skip
    await wait_for(lambda: metrics.picture.pods and metrics.picture.containers)
    found = await scrape(metrics)
    labels = key(node="node-a", namespace="team", pod="half", container="main",
                 uuid="GPU-a0", index="0", model="A100-40GB")  # fmt: skip
    assert found["vgpu_container_memory_spilled_bytes"][labels] == 3000 * MIB
    assert found["vgpu_container_memory_used_bytes"][labels] == 8192 * MIB
    table = render(await asyncio.to_thread(fetch_picture, metrics.url, 5.0), details=True)
    assert "8192 (3000 spilled)" in table
