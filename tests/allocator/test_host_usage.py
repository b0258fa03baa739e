"""Host usage (every bound pod's CPU, memory and pod slot) and how Node objects and pods are
read, without I/O: one count per pod whichever source reports it first."""

from __future__ import annotations

from typing import Any

import pytest

from services.allocator.cluster import Allocatable, ClusterState
from services.allocator.cluster_watch import BoundPodHandler, NodeHandler, node_allocatable
from services.allocator.host_usage import HostUsage
from services.common.host_requests import HostRequests, pod_host_requests
from services.common.quantity import QuantityError
from services.common.schemas import NodeInventory

from .helpers import gpu


def cluster_with(*names: str) -> ClusterState:
    cluster = ClusterState(15)
    for name in names:
        cluster.update(NodeInventory(node=name, gpus=[gpu(name, 0)], cpu_milli=1000))
    return cluster


def used(cluster: ClusterState, node: str) -> tuple[int, int, int]:
    state = cluster.node(node)
    assert state is not None
    return state.used_cpu_milli, state.used_memory_mib, state.used_pods


def test_a_reservation_never_overrides_what_the_cluster_says() -> None:
    cluster = cluster_with("n1")
    host = HostUsage(cluster)
    host.reserve("u1", "n1", 500, 100)  # bound by this allocator
    assert used(cluster, "n1") == (500, 100, 1)
    host.observe("u1", "n1", 600, 128)  # the watch: authoritative
    host.reserve("u1", "n1", 0, 0)  # a record from storage knows no requests
    assert used(cluster, "n1") == (600, 128, 1)
    host.unreserve("u1")  # the GPU record goes; the pod is still bound
    assert used(cluster, "n1") == (600, 128, 1)
    assert host.end("u1") and not host.end("u1")
    assert used(cluster, "n1") == (0, 0, 0)
    host.reserve("u2", "n1", 10, 1)
    host.unreserve("u2")
    assert used(cluster, "n1") == (0, 0, 0) and len(host) == 0


def test_pods_on_a_node_heard_of_later_are_charged_when_it_reports() -> None:
    cluster = cluster_with()
    host = HostUsage(cluster)
    host.observe("u1", "late", 250, 64)
    cluster.update(NodeInventory(node="late", gpus=[gpu("late", 0)]))
    cluster.reset_usage("late")
    host.reapply("late")
    assert used(cluster, "late") == (250, 64, 1)


async def test_a_list_replaces_what_the_watch_knew() -> None:
    cluster = cluster_with("n1", "n2")
    host = HostUsage(cluster)
    handler = BoundPodHandler(host)

    def bound(uid: str, node: str, cpu: str, phase: str = "Running") -> dict[str, Any]:
        return {"metadata": {"uid": uid, "name": uid, "namespace": "ns"},
                "spec": {"nodeName": node, "containers": [
                    {"name": "c", "resources": {"requests": {"cpu": cpu}}}]},
                "status": {"phase": phase}}  # fmt: skip

    await handler.on_list([bound("a", "n1", "1"), bound("b", "n2", "250m")], 0.0)
    assert (used(cluster, "n1")[0], used(cluster, "n2")[0]) == (1000, 250)
    await handler.on_change("MODIFIED", bound("b", "n2", "250m", "Failed"))
    await handler.on_change("ADDED", bound("c", "n1", "1"))
    assert (used(cluster, "n1")[0], used(cluster, "n2")[0]) == (2000, 0)
    await handler.on_list([bound("c", "n1", "1")], 0.0)  # a missed: gone
    assert used(cluster, "n1") == (1000, 0, 1)
    bad = bound("d", "n2", "lots")  # unreadable (the API server validates): held as 0
    await handler.on_change("ADDED", bad)
    assert used(cluster, "n2") == (0, 0, 1)


async def test_node_objects_set_capacity_and_forget_it_when_deleted() -> None:
    cluster = cluster_with("n1")
    handler = NodeHandler(cluster)
    allocatable = {"cpu": "3500m", "memory": "1Gi", "pods": "1e2"}
    node = {"metadata": {"name": "n1"}, "status": {"allocatable": allocatable}}
    await handler.on_list([node], 0.0)
    state = cluster.node("n1")
    assert state is not None and (state.cpu_milli, state.host_memory_mib, state.max_pods) == (
        3500, 1024, 100,
    )  # fmt: skip
    await handler.on_list([], 0.0)  # gone from the list: the agent's hint again
    state = cluster.node("n1")
    assert state is not None and (state.cpu_milli, state.max_pods) == (1000, 0)
    assert node_allocatable({"status": {"allocatable": {"cpu": "x", "memory": "1.5Mi"}}}) == (
        Allocatable(0, 1, 0)  # unreadable: not stated; memory rounded down to MiB
    )


def spec(**fields: Any) -> dict[str, Any]:
    return {"spec": fields}


def ctr(cpu: str | None = None, memory: str | None = None, **extra: Any) -> dict[str, Any]:
    requests = {k: v for k, v in (("cpu", cpu), ("memory", memory)) if v is not None}
    return {"name": "c", "resources": {"requests": requests}, **extra}


@pytest.mark.parametrize(
    ("pod", "cpu", "memory"),
    [
        (spec(containers=[ctr("1", "1Gi"), ctr("500m", "512Mi")]), 1500, 1536),
        (spec(containers=[ctr("1")], initContainers=[ctr("3")]), 3000, 0),
        # A sidecar adds to the app containers and to every later init container.
        (spec(containers=[ctr("1")], initContainers=[ctr("500m", restartPolicy="Always"),
                                                     ctr("2")]), 2500, 0),
        (spec(containers=[ctr("1")], overhead={"cpu": "250m", "memory": "64Mi"}), 1250, 64),
        (spec(containers=[ctr("1")], resources={"requests": {"cpu": "4"}}), 4000, 0),
        (spec(containers=[{"name": "c", "resources": {"limits": {"cpu": "2", "memory": "1G"}}}]),
         2000, 954),  # limits only: requests default to them; 10^9 bytes round up to MiB
        (spec(containers=[ctr("0.1m")]), 1, 0),  # MilliValue rounds up
    ],
)  # fmt: skip
def test_pod_requests_are_counted_as_kube_scheduler_counts(
    pod: dict[str, Any], cpu: int, memory: int
) -> None:
    needs = pod_host_requests(pod)
    assert (needs.cpu_milli, needs.memory_mib) == (cpu, memory)
    assert isinstance(needs, HostRequests)


def test_bad_host_quantities_name_the_field() -> None:
    with pytest.raises(QuantityError, match=r"spec\.initContainers\[0\]\.resources\.requests\.cpu"):
        pod_host_requests(spec(containers=[ctr("1")], initContainers=[ctr("1 core")]))
    with pytest.raises(QuantityError, match=r"spec\.overhead\.memory: must not be negative"):
        pod_host_requests(spec(containers=[ctr("1")], overhead={"memory": "-1"}))
