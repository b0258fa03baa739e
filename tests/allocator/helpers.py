"""Builders for pods and inventories, and small helpers to talk to a running allocator."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Callable
from typing import Any

import aiohttp
import msgspec
from nats.js.errors import KeyNotFoundError

from services.allocator import Allocator, LocalClusterBackend
from services.allocator.journal import NodeRecords, node_key
from services.common import subjects
from services.common.bus import Bus
from services.common.schemas import AllocationEvent, GpuDevice, NodeInventory, PodAllocation

A100_MIB = 40960


def gpu(node: str, index: int, memory_mib: int = A100_MIB, healthy: bool = True) -> GpuDevice:
    return GpuDevice(
        uuid=f"GPU-{node}-{index}",
        index=index,
        model="A100-40GB",
        memory_mib=memory_mib,
        healthy=healthy,
    )


def node_inventory(node: str, count: int = 2, memory_mib: int = A100_MIB) -> NodeInventory:
    return NodeInventory(node=node, gpus=[gpu(node, i, memory_mib) for i in range(count)])


def container(
    name: str,
    gpus: int | None = 1,
    mem: int | None = None,
    percent: int | None = None,
    cores: int | None = None,
) -> dict[str, Any]:
    limits: dict[str, Any] = {}
    for key, value in (
        ("nvidia.com/gpu", gpus),
        ("nvidia.com/gpumem", mem),
        ("nvidia.com/gpumem-percentage", percent),
        ("nvidia.com/gpucores", cores),
    ):
        if value is not None:
            limits[key] = str(value)
    return {"name": name, "image": "cuda", "resources": {"limits": limits}}


def pod(
    name: str,
    containers: list[dict[str, Any]],
    init: list[dict[str, Any]] | None = None,
    namespace: str = "default",
    uid: str | None = None,
    scheduler: str = "vgpu-scheduler",
) -> dict[str, Any]:
    # As the admission webhook leaves it: binds check the scheduler's name.
    spec: dict[str, Any] = {"containers": containers, "schedulerName": scheduler}
    if init:
        spec["initContainers"] = init
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": namespace, "uid": uid or str(uuid.uuid4())},
        "spec": spec,
    }


async def give_nodes(bus: Bus, allocator: Allocator, *inventories: NodeInventory) -> None:
    """Publish inventories as node agents do and wait until the allocator holds them."""
    for inventory in inventories:
        await bus.publish(subjects.inventory(inventory.node), inventory)
    await eventually(
        lambda: all(allocator.inventory.gpus(i.node) == tuple(i.gpus) for i in inventories)
    )


async def eventually(condition: Callable[[], bool], timeout_s: float = 5.0) -> None:
    """Poll `condition` until it holds; fail the test after `timeout_s`."""
    for _ in range(int(timeout_s / 0.01)):
        if condition():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"condition not met within {timeout_s}s")


async def post(
    http: aiohttp.ClientSession, url: str, body: Any, headers: dict[str, str] | None = None
) -> tuple[int, Any]:
    data = body if isinstance(body, bytes) else msgspec.json.encode(body)
    async with http.post(url, data=data, headers=headers) as response:
        return response.status, msgspec.json.decode(await response.read())


def filter_args(p: dict[str, Any], nodes: list[str]) -> dict[str, Any]:
    return {"Pod": p, "Nodes": None, "NodeNames": nodes}


def bind_args(p: dict[str, Any], node: str) -> dict[str, Any]:
    metadata = p["metadata"]
    return {
        "PodName": metadata["name"],
        "PodNamespace": metadata["namespace"],
        "PodUID": metadata["uid"],
        "Node": node,
    }


async def filter_then_bind(
    http: aiohttp.ClientSession, url: str, p: dict[str, Any], node: str, bind_url: str = ""
) -> dict[str, Any]:
    """kube-scheduler's order: the filter passes `node` (a bind needs it), then the bind, on
    `bind_url` when given (another replica). The bind's answer."""
    _, result = await post(http, f"{url}/scheduler/filter", filter_args(p, [node]))
    assert node in (result.get("NodeNames") or []), result
    _, answer = await post(http, f"{bind_url or url}/scheduler/bind", bind_args(p, node))
    return answer


def admit_to_cluster(allocator: Allocator, *pods: dict[str, Any]) -> None:
    """Make pods exist in the allocator's in-memory cluster (as the API server would)."""
    backend = allocator.backend
    assert isinstance(backend, LocalClusterBackend)
    for p in pods:
        backend.add_pod(p)


async def collect_events(bus: Bus, node: str) -> list[AllocationEvent]:
    """Allocation events published for `node` from now on, appended as they arrive."""
    events: list[AllocationEvent] = []

    async def on_event(event: AllocationEvent) -> None:
        events.append(event)

    await bus.subscribe(subjects.alloc_events(node), AllocationEvent, on_event)
    await bus.client.flush()
    return events


async def stored_pods(bus: Bus, node: str, bucket: str = "vgpu-allocations") -> list[PodAllocation]:
    """What the allocator's JetStream KV store holds for `node` (nothing without a key)."""
    kv = await bus.client.jetstream().key_value(bucket)
    try:
        entry = await kv.get(node_key(node))
    except KeyNotFoundError:
        return []
    return msgspec.json.decode(entry.value or b"", type=NodeRecords).pods
