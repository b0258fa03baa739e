"""The allocator sees what kube-scheduler sees: Node allocatable and every bound pod's requests,
through the real `kubernetes` client's list+watch against the in-process API server."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
from kubernetes import client as k8s

from services.allocator import Allocator, AllocatorSettings
from services.common.bus import Bus
from services.common.embedded_nats import EmbeddedNats
from services.simulators.apiserver import FakeApiServer

from .helpers import (
    container,
    eventually,
    filter_args,
    filter_then_bind,
    give_nodes,
    node_inventory,
    post,
)
from .helpers import pod as gpu_pod


@pytest.fixture
async def allocator(nats_server: EmbeddedNats, api: FakeApiServer) -> AsyncIterator[Allocator]:
    api.add_node("n1", allocatable={"cpu": "8", "memory": "32Gi", "pods": "3"})
    api.add_node("n2", allocatable={"cpu": "64", "memory": "256Gi", "pods": "110"})
    allocator = Allocator(
        AllocatorSettings(nats_url=nats_server.url, http_port=0, cluster="kubernetes",
                          kube_api_url=api.url, lease_bucket="")
    )  # fmt: skip
    await allocator.start()
    yield allocator
    await allocator.stop()


def cpu_pod(name: str, cpu: str, memory: str = "1Gi", **spec: Any) -> dict[str, Any]:
    """A pod asking for no GPU, as a user writes it (limits only: requests default to them)."""
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": "web"},
        "spec": {
            "containers": [{"name": "app", "resources": {"limits": {"cpu": cpu,
                                                                    "memory": memory}}}],
            **spec,
        },
    }  # fmt: skip


async def bind(api: FakeApiServer, name: str, node: str, namespace: str = "web") -> None:
    """Bind as kube-scheduler's DefaultBinder does: POST pods/<name>/binding."""
    configuration = k8s.Configuration()
    configuration.host = api.url
    core = k8s.CoreV1Api(k8s.ApiClient(configuration))
    body = {"apiVersion": "v1", "kind": "Binding", "metadata": {"name": name},
            "target": {"apiVersion": "v1", "kind": "Node", "name": node}}  # fmt: skip
    await asyncio.to_thread(
        core.create_namespaced_pod_binding, name, namespace, body, _preload_content=False
    )


def host(allocator: Allocator, node: str) -> tuple[int, int, int, int, int, int]:
    state = allocator.cluster.node(node)
    assert state is not None
    return (state.cpu_milli, state.host_memory_mib, state.max_pods,
            state.used_cpu_milli, state.used_memory_mib, state.used_pods)  # fmt: skip


async def test_node_allocatable_is_the_nodes_capacity_and_follows_changes(
    allocator: Allocator, api: FakeApiServer, bus: Bus
) -> None:
    hinted = node_inventory("n1")
    hinted.cpu_milli, hinted.host_memory_mib, hinted.max_pods = 1000, 1000, 5
    await give_nodes(bus, allocator, hinted, node_inventory("n3"))
    # The Node object wins over the agent's hints; a node without one keeps no check.
    assert host(allocator, "n1")[:3] == (8000, 32 * 1024, 3)
    assert host(allocator, "n3")[:3] == (0, 0, 0)

    await api.set_allocatable("n1", {"cpu": "7500m", "memory": "30Gi", "pods": "4"})
    await eventually(lambda: host(allocator, "n1")[:3] == (7500, 30 * 1024, 4))
    api.add_node("n3", allocatable={"cpu": "16", "memory": "64Gi"})
    await eventually(lambda: host(allocator, "n3")[:3] == (16000, 64 * 1024, 0))
    await api.delete_node("n1")  # gone from the cluster: only the agent's hints are left
    await eventually(lambda: host(allocator, "n1")[:3] == (1000, 1000, 5))


async def test_bound_pods_count_until_they_end_gpu_or_not(
    allocator: Allocator, api: FakeApiServer, bus: Bus
) -> None:
    await give_nodes(bus, allocator, node_inventory("n1"), node_inventory("n2"))
    await api.create_pod(cpu_pod("web-1", "2", "4Gi"))
    await api.create_pod(cpu_pod("web-2", "500m", "512Mi"))
    await api.create_pod(cpu_pod("pending", "1"))  # never bound: holds nothing
    await bind(api, "web-1", "n1")
    await bind(api, "web-2", "n1")
    await eventually(lambda: host(allocator, "n1")[3:] == (2500, 4608, 2))

    # A GPU pod bound by the extender counts once: reserved at bind, then observed.
    train = gpu_pod("train", [container("worker", mem=1000)], namespace="ml")
    train["spec"]["containers"][0]["resources"]["requests"] = {"cpu": "1", "memory": "1Gi"}
    created = await api.create_pod(train)
    async with aiohttp.ClientSession() as http:
        assert await filter_then_bind(http, allocator.url, created, "n1") == {"Error": ""}
    assert host(allocator, "n1")[3:] == (3500, 5632, 3)
    await asyncio.sleep(0.3)  # the watch reports the binding: still counted once
    assert host(allocator, "n1")[3:] == (3500, 5632, 3)

    await api.set_phase("web", "web-1", "Succeeded")
    await eventually(lambda: host(allocator, "n1")[3:] == (1500, 1536, 2))
    await api.delete_pod("web", "web-2")
    await eventually(lambda: host(allocator, "n1")[3:] == (1000, 1024, 1))
    await api.set_phase("ml", "train", "Failed")
    await eventually(lambda: host(allocator, "n1")[3:] == (0, 0, 0))


async def test_pods_already_bound_at_start_are_counted_as_kube_scheduler_counts(
    nats_server: EmbeddedNats, api: FakeApiServer, bus: Bus
) -> None:
    api.add_node("n1", allocatable={"cpu": "32", "memory": "128Gi", "pods": "110"})
    sidecar = cpu_pod("mesh", "1", "1Gi", overhead={"cpu": "250m", "memory": "128Mi"})
    sidecar["spec"]["initContainers"] = [
        {"name": "proxy", "restartPolicy": "Always",
         "resources": {"requests": {"cpu": "500m", "memory": "256Mi"}}},
        {"name": "migrate", "resources": {"requests": {"cpu": "4", "memory": "2Gi"}}},
    ]  # fmt: skip
    await api.create_pod(sidecar)
    await bind(api, "mesh", "n1")
    allocator = Allocator(
        AllocatorSettings(nats_url=nats_server.url, http_port=0, cluster="kubernetes",
                          kube_api_url=api.url, lease_bucket="")
    )  # fmt: skip
    await allocator.start()
    try:
        await give_nodes(bus, allocator, node_inventory("n1"))
        # max(app 1 + sidecar 0.5, init 4 + sidecar 0.5) + overhead 0.25 CPU;
        # max(1Gi + 256Mi, 2Gi + 256Mi) + 128Mi memory.
        assert host(allocator, "n1")[3:] == (4750, 2432, 1)
    finally:
        await allocator.stop()


async def test_cpu_and_pod_slots_taken_by_cpu_pods_keep_gpu_pods_off(
    allocator: Allocator, api: FakeApiServer, bus: Bus
) -> None:
    await give_nodes(bus, allocator, node_inventory("n1"), node_inventory("n2"))
    for index in range(3):  # n1 takes 3 pods at most
        await api.create_pod(cpu_pod(f"w{index}", "100m"))
        await bind(api, f"w{index}", "n1")
    await eventually(lambda: host(allocator, "n1")[5] == 3)
    train = gpu_pod("train", [container("worker", mem=1000)], namespace="ml")
    async with aiohttp.ClientSession() as http:
        _, result = await post(
            http, f"{allocator.url}/scheduler/filter", filter_args(train, ["n1", "n2"])
        )
    assert result["NodeNames"] == ["n2"]
    assert "already runs 3 pods, its most (3)" in result["FailedNodes"]["n1"]


async def test_the_watch_lists_again_after_the_api_server_was_away(
    nats_server: EmbeddedNats, bus: Bus
) -> None:
    first = FakeApiServer()
    await first.start()
    first.add_node("n1", allocatable={"cpu": "8", "memory": "32Gi", "pods": "110"})
    await first.create_pod(cpu_pod("web-1", "2"))
    await bind(first, "web-1", "n1")
    allocator = Allocator(
        AllocatorSettings(nats_url=nats_server.url, http_port=0, cluster="kubernetes",
                          kube_api_url=first.url, lease_bucket="")
    )  # fmt: skip
    await allocator.start()
    second = FakeApiServer(port=int(first.url.rsplit(":", 1)[1]))
    try:
        await give_nodes(bus, allocator, node_inventory("n1"))
        assert host(allocator, "n1")[0] == 8000 and host(allocator, "n1")[3] == 2000
        await first.stop()  # the watches break; the allocator keeps what it knew
        await asyncio.sleep(0.5)
        assert host(allocator, "n1")[3] == 2000
        second.add_node("n1", allocatable={"cpu": "16", "memory": "64Gi", "pods": "110"})
        await second.create_pod(cpu_pod("web-2", "3"))
        await second.start()
        await bind(second, "web-2", "n1")
        await eventually(
            lambda: host(allocator, "n1")[0] == 16000 and host(allocator, "n1")[3] == 3000,
            timeout_s=15,
        )
    finally:
        await allocator.stop()
        await second.stop()
