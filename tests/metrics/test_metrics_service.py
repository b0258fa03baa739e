"""The metrics service over a real nats-server and real HTTP: families, labels, staleness,
malformed events and pending pods."""

from __future__ import annotations

import asyncio

from services.common import subjects
from services.common.bus import UNDECODABLE, Bus
from services.common.embedded_nats import EmbeddedNats
from services.common.schemas import (
    AllocationEvent,
    ContainerAllocation,
    ContainerRequest,
    GpuSlice,
    NodeInventory,
    NodeUsage,
    PendingPod,
    PendingReason,
    PodAllocation,
)
from services.metrics.service import REJECTED, MetricsService
from tests.metrics.helpers import (
    ALLOCATION,
    GPU,
    INVENTORY,
    MIB,
    USAGE,
    feed,
    get_json,
    key,
    scrape,
    settings,
    wait_for,
)

GPU_KEY = key(node="node-a", uuid="GPU-a0", index="0", model="A100-40GB")
CONTAINER_KEY = key(node="node-a", namespace="team", pod="half", container="main",
                    uuid="GPU-a0", index="0", model="A100-40GB")  # fmt: skip
CONTAINER_ONLY = key(node="node-a", namespace="team", pod="half", container="main")


async def test_gpu_and_container_families_with_labels(metrics: MetricsService, bus: Bus) -> None:
    await feed(bus, metrics)
    found = await scrape(metrics)
    assert found["vgpu_node_up"][key(node="node-a")] == 1.0
    gpu = {name: found[name][GPU_KEY] for name in found if GPU_KEY in found[name]}
    assert gpu == {
        "vgpu_gpu_memory_total_bytes": 40960 * MIB,
        "vgpu_gpu_memory_allocated_bytes": 20480 * MIB,
        "vgpu_gpu_memory_used_bytes": 1024 * MIB,
        "vgpu_gpu_core_allocated_ratio": 0.5,
        "vgpu_gpu_sm_utilization_ratio": 0.25,
        "vgpu_gpu_slices": 1,
        "vgpu_gpu_healthy": 1.0,
        "vgpu_gpu_stranded_memory_bytes": 0.0,
        "vgpu_gpu_memory_scaling": 1.0,
        "vgpu_gpu_memory_oversubscribed": 0.0,
        "vgpu_gpu_cores_scaling": 1.0,
    }
    container = {name: found[name][CONTAINER_KEY] for name in found
                 if CONTAINER_KEY in found[name]}  # fmt: skip
    assert container == {
        "vgpu_container_memory_requested_bytes": 20480 * MIB,
        "vgpu_container_memory_limit_bytes": 20480 * MIB,
        "vgpu_container_memory_used_bytes": 8192 * MIB,
        "vgpu_container_memory_spilled_bytes": 0.0,
        "vgpu_container_core_requested_ratio": 0.5,
        "vgpu_container_core_limit_ratio": 0.5,
        "vgpu_container_core_used_ratio": 0.3,
    }
    assert found["vgpu_container_throttled_seconds_total"][CONTAINER_ONLY] == 2.5
    assert found["vgpu_container_processes"][CONTAINER_ONLY] == 2
    assert found["vgpu_cluster_memory_total_bytes"][()] == 2 * 40960 * MIB
    assert found["vgpu_cluster_free_memory_bytes"][()] == (40960 + 20480) * MIB
    assert found["vgpu_pending_pods"][key(unresolvable="false")] == 0

    await bus.publish(subjects.alloc_events("node-a"),
                      AllocationEvent(kind="released", allocation=ALLOCATION))  # fmt: skip
    await wait_for(lambda: not metrics.picture.pods)
    found = await scrape(metrics)
    assert found["vgpu_gpu_memory_allocated_bytes"][GPU_KEY] == 0
    assert found["vgpu_gpu_slices"][GPU_KEY] == 0
    assert not any(name.startswith("vgpu_container_") for name in found)


async def test_hami_names_labels_and_units(metrics: MetricsService, bus: Bus) -> None:
    await feed(bus, metrics)
    found = await scrape(metrics)
    device = key(node="node-a", device_uuid="GPU-a0", device_index="0",
                 device_type="NVIDIA-A100-40GB", zone="vGPU")  # fmt: skip
    assert found["hami_gpu_memory_limit_bytes"][device] == 40960 * MIB
    assert found["hami_gpu_memory_allocated_bytes"][device] == 20480 * MIB
    assert found["hami_gpu_core_allocated_ratio"][device] == 50  # HAMi's unit: percent
    assert found["hami_gpu_shared_count"][device] == 1
    allocated = key(namespace="team", node="node-a", pod="half", container="main",
                    container_index="main", device_uuid="GPU-a0", zone="vGPU")  # fmt: skip
    assert found["hami_vgpu_memory_allocated_bytes"][allocated] == 20480 * MIB
    assert found["hami_vgpu_core_allocated_ratio"][allocated] == 50
    host = key(node="node-a", device_index="0", device_uuid="GPU-a0",
               device_type="NVIDIA-A100-40GB")  # fmt: skip
    assert found["hami_host_gpu_memory_used_bytes"][host] == 1024 * MIB
    assert found["hami_host_gpu_utilization_ratio"][host] == 25.0
    used = key(namespace="team", pod="half", container="main", vdevice_index="0",
               device_uuid="GPU-a0", node="node-a")  # fmt: skip
    assert found["hami_vgpu_memory_used_bytes"][used] == 8192 * MIB
    assert found["hami_vgpu_memory_limit_bytes"][used] == 20480 * MIB
    assert found["hami_container_device_utilization_ratio"][used] == 30.0
    legacy = key(podnamespace="team", podname="half", ctrname="main", vdeviceid="0",
                 deviceuuid="GPU-a0")  # fmt: skip
    assert found["vGPU_device_memory_usage_in_bytes"][legacy] == 8192 * MIB
    assert found["vGPU_device_memory_limit_in_bytes"][legacy] == 20480 * MIB
    legacy_host = key(nodeid="node-a", deviceidx="0", deviceuuid="GPU-a0",
                      devicetype="NVIDIA-A100-40GB")  # fmt: skip
    assert found["HostGPUMemoryUsage"][legacy_host] == 1024 * MIB
    assert found["HostCoreUtilization"][legacy_host] == 25.0


async def test_hami_names_can_be_turned_off(nats_server: EmbeddedNats, bus: Bus) -> None:
    service = MetricsService(settings(nats_server.url, hami_legacy_metrics=False))
    await service.start()
    try:
        await feed(bus, service)
        found = await scrape(service)
        assert "hami_vgpu_memory_used_bytes" in found
        assert "vGPU_device_memory_usage_in_bytes" not in found
        assert "HostGPUMemoryUsage" not in found
    finally:
        await service.stop()


async def test_a_silent_node_is_shown_silent_not_idle(nats_server: EmbeddedNats, bus: Bus) -> None:
    service = MetricsService(settings(nats_server.url, stale_after_s=0.3))
    await service.start()
    try:
        await feed(bus, service)
        await asyncio.sleep(0.5)  # no heartbeat: the node goes silent
        found = await scrape(service)
        assert found["vgpu_node_up"][key(node="node-a")] == 0.0
        assert found["vgpu_node_silent_seconds"][key(node="node-a")] >= 0.3
        # Unknown, not zero: no used-memory or utilisation series at all.
        for family in (
            "vgpu_gpu_memory_used_bytes",
            "vgpu_gpu_sm_utilization_ratio",
            "vgpu_container_memory_used_bytes",
            "hami_host_gpu_memory_used_bytes",
        ):
            assert not found.get(family), family  # fmt: skip
        # What was handed out is still handed out.
        assert found["vgpu_gpu_memory_allocated_bytes"][GPU_KEY] == 20480 * MIB
        _, body = await get_json(service, "/api/v1/picture")
        assert isinstance(body, dict)
        node = body["nodes"][0]
        assert node["state"] == "silent" and node["gpus"][0]["memory_used_mib"] is None
        assert body["totals"]["nodes_up"] == 0 and body["totals"]["free_memory_mib"] == 0
        assert body["pods"][0]["node_state"] == "silent"

        await bus.publish(subjects.inventory("node-a"), INVENTORY)  # it speaks again
        await wait_for(lambda: service.picture.is_up("node-a"))
        found = await scrape(service)
        assert found["vgpu_node_up"][key(node="node-a")] == 1.0
    finally:
        await service.stop()


async def test_malformed_events_are_counted_and_later_ones_still_land(
    metrics: MetricsService, bus: Bus
) -> None:
    subject = subjects.alloc_events("node-a")
    undecodable = UNDECODABLE.labels(subject=subject)._value.get()
    duplicate = REJECTED.labels(kind="inventory", reason="bad_gpu")._value.get()
    unknown = REJECTED.labels(kind="usage", reason="unknown_node")._value.get()
    bad_slice = REJECTED.labels(kind="allocation", reason="bad_slice")._value.get()

    await feed(bus, metrics)  # the service is listening on every subject

    await bus.client.publish(subject, b'{"kind": "bound", "allocation": {"namespace": 1}}')
    await bus.client.publish(subject, b"\xff not json")
    await bus.publish(subjects.inventory("node-x"), NodeInventory(node="node-x", gpus=[GPU, GPU]))
    await bus.publish(subjects.usage("node-y"), NodeUsage(node="node-y", gpus=[]))
    broken = GpuSlice(uuid="GPU-a0", index=0, memory_mib=1, cores=150)
    bad = AllocationEvent(kind="bound", allocation=PodAllocation(
        namespace="team", name="bad", uid="uid-bad", node="node-a",
        containers={"c": ContainerAllocation(container="c", slices=[broken])}))  # fmt: skip
    await bus.publish(subject, bad)
    # Later events on the same subjects still land (each subject keeps its order).
    await bus.publish(subject, AllocationEvent(kind="released", allocation=ALLOCATION))
    await bus.publish(subjects.inventory("node-a"), NodeInventory(
        node="node-a", gpus=INVENTORY.gpus[:1]))  # fmt: skip
    await bus.publish(subjects.usage("node-a"), NodeUsage(node="node-a", gpus=USAGE.gpus[:1]))
    await wait_for(lambda: not metrics.picture.pods
                   and len(metrics.picture.nodes["node-a"].inventory.gpus) == 1
                   and len(metrics.picture.nodes["node-a"].usage) == 1)  # fmt: skip

    assert UNDECODABLE.labels(subject=subject)._value.get() == undecodable + 2
    assert REJECTED.labels(kind="inventory", reason="bad_gpu")._value.get() == duplicate + 1
    assert REJECTED.labels(kind="usage", reason="unknown_node")._value.get() == unknown + 1
    assert REJECTED.labels(kind="allocation", reason="bad_slice")._value.get() == bad_slice + 1
    assert set(metrics.picture.nodes) == {"node-a"} and metrics.picture.pods == {}
    found = await scrape(metrics)
    assert (("subject", subject),) in found["vgpu_bus_undecodable_messages_total"]
    assert found["vgpu_metrics_rejected_events_total"][key(kind="inventory", reason="bad_gpu")]


async def test_pending_pods_and_stranded_memory(metrics: MetricsService, bus: Bus) -> None:
    await feed(bus, metrics)
    # Needs 30000 MiB on one GPU: fits GPU-a1 (empty), not GPU-a0 (20480 MiB free).
    wants = PendingPod(
        namespace="team", name="wide", uid="uid-wide",
        requests=[ContainerRequest(container="c", gpus=1, memory_mib=30000)],
        reasons=[PendingReason(message="no GPU with 30000 MiB free", nodes=["node-b"],
                               node_count=1)],
    )  # fmt: skip
    await bus.publish(subjects.alloc_pending(), wants)
    await wait_for(lambda: metrics.picture.pending)
    found = await scrape(metrics)
    assert found["vgpu_pending_pods"][key(unresolvable="false")] == 1
    assert found["vgpu_gpu_stranded_memory_bytes"][GPU_KEY] == 20480 * MIB
    assert found["vgpu_cluster_stranded_memory_bytes"][()] == 20480 * MIB
    status, pending = await get_json(metrics, "/api/v1/pending")
    assert status == 200 and isinstance(pending, list)
    assert pending[0]["name"] == "wide"
    assert pending[0]["summary"] == "1 node: no GPU with 30000 MiB free"

    # A pod that can never fit strands nothing; a bound pod stops waiting.
    huge = [ContainerRequest(container="c", gpus=1, memory_mib=90000)]
    never = PendingPod(namespace="team", name="huge", uid="uid-huge", unresolvable=True,
                       requests=huge)  # fmt: skip
    await bus.publish(subjects.alloc_pending(), never)
    bound = AllocationEvent(kind="bound", allocation=PodAllocation(
        namespace="team", name="wide", uid="uid-wide", node="node-a", containers={}))  # fmt: skip
    await bus.publish(subjects.alloc_events("node-a"), bound)
    await wait_for(lambda: set(metrics.picture.pending) == {"uid-huge"})
    found = await scrape(metrics)
    assert found["vgpu_pending_pods"][key(unresolvable="true")] == 1
    assert found["vgpu_cluster_stranded_memory_bytes"][()] == 0
    gone = PendingPod(namespace="team", name="huge", uid="uid-huge", waiting=False)
    await bus.publish(subjects.alloc_pending(), gone)
    await wait_for(lambda: not metrics.picture.pending)
