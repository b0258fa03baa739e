"""Bind trusts nothing it did not decide: only a pending pod of vgpu's scheduler, with the UID
given, on a node this extender's filter passed for it within the bind window (issue 20)."""

from __future__ import annotations

import asyncio

from prometheus_client import REGISTRY

from services.allocator import Allocator, LocalClusterBackend
from services.allocator.bind_guard import FilterPasses
from services.common.bus import Bus

from .conftest import MakeAllocator
from .helpers import (
    admit_to_cluster,
    bind_args,
    container,
    filter_args,
    filter_then_bind,
    give_nodes,
    node_inventory,
    pod,
    post,
)


def refused(reason: str) -> float:
    value = REGISTRY.get_sample_value("vgpu_allocator_bind_refused_total", {"reason": reason})
    return value or 0.0


async def _bind(http, allocator: Allocator, p: dict, node: str) -> str:
    _, answer = await post(http, f"{allocator.url}/scheduler/bind", bind_args(p, node))
    return answer["Error"]


def _backend(allocator: Allocator) -> LocalClusterBackend:
    assert isinstance(allocator.backend, LocalClusterBackend)
    return allocator.backend


async def test_bind_to_a_node_the_filter_did_not_pass_is_refused(
    allocator: Allocator, bus: Bus, http
) -> None:
    # The attack of issue 20: a pod whose filter passed node n1 only (say its nodeSelector
    # matched nothing else), bound by a caller to n2.
    await give_nodes(bus, allocator, node_inventory("n1"), node_inventory("n2"))
    p = pod("victim", [container("main", mem=1000)], namespace="tenant-b")
    admit_to_cluster(allocator, p)
    before = refused("not_filtered")
    assert "not passed" in await _bind(http, allocator, p, "n2")  # never filtered at all
    _, result = await post(http, f"{allocator.url}/scheduler/filter", filter_args(p, ["n1"]))
    assert result["NodeNames"] == ["n1"]
    error = await _bind(http, allocator, p, "n2")
    assert "tenant-b/victim" in error and "for node 'n2'" in error
    assert refused("not_filtered") == before + 2
    assert _backend(allocator).node_of("tenant-b", "victim") is None
    assert allocator.engine.allocations() == []
    assert await _bind(http, allocator, p, "n1") == ""  # what the filter passed


async def test_bind_of_a_pod_of_another_scheduler_is_refused(
    allocator: Allocator, bus: Bus, http
) -> None:
    await give_nodes(bus, allocator, node_inventory("n1"))
    before = refused("other_scheduler")
    for scheduler in ("default-scheduler", "volcano"):
        p = pod(f"of-{scheduler}", [container("main", mem=1000)], scheduler=scheduler)
        admit_to_cluster(allocator, p)
        _, result = await post(http, f"{allocator.url}/scheduler/filter", filter_args(p, ["n1"]))
        assert result["NodeNames"] == ["n1"]  # a filter only looks
        error = await _bind(http, allocator, p, "n1")
        assert f"scheduled by '{scheduler}', not 'vgpu-scheduler'" in error
    unnamed = pod("unnamed", [container("main")])
    del unnamed["spec"]["schedulerName"]  # the API server's default: default-scheduler
    admit_to_cluster(allocator, unnamed)
    await post(http, f"{allocator.url}/scheduler/filter", filter_args(unnamed, ["n1"]))
    assert "'default-scheduler'" in await _bind(http, allocator, unnamed, "n1")
    assert refused("other_scheduler") == before + 3
    assert allocator.engine.allocations() == []


async def test_the_cluster_decides_uid_and_pending_not_the_caller(
    allocator: Allocator, bus: Bus, http
) -> None:
    await give_nodes(bus, allocator, node_inventory("n1"))
    backend = _backend(allocator)

    # The filter saw one pod; the cluster now has another of the same name (re-created).
    old = pod("p", [container("main", mem=1000)])
    await post(http, f"{allocator.url}/scheduler/filter", filter_args(old, ["n1"]))
    admit_to_cluster(allocator, pod("p", [container("main", mem=1000)]))
    before = refused("uid_mismatch")
    assert "it is another pod" in await _bind(http, allocator, old, "n1")
    assert refused("uid_mismatch") == before + 1

    # A pod that ended, or is being deleted, is not pending.
    done = pod("done", [container("main", mem=1000)])
    admit_to_cluster(allocator, done)
    backend.set_phase("default", "done", "Succeeded")
    await post(http, f"{allocator.url}/scheduler/filter", filter_args(done, ["n1"]))
    before = refused("not_pending")
    assert "is Succeeded, not pending" in await _bind(http, allocator, done, "n1")
    assert refused("not_pending") == before + 1

    # A pod someone else bound already.
    taken = pod("taken", [container("main", mem=1000)])
    admit_to_cluster(allocator, taken)
    await post(http, f"{allocator.url}/scheduler/filter", filter_args(taken, ["n1"]))
    await backend.bind("default", "taken", taken["metadata"]["uid"], "n1")
    before = refused("already_bound")
    assert "already bound to node 'n1'" in await _bind(http, allocator, taken, "n1")
    assert refused("already_bound") == before + 1
    assert allocator.engine.allocations() == []


async def test_a_filter_pass_older_than_the_window_is_refused(
    make_allocator: MakeAllocator, bus: Bus, http
) -> None:
    allocator = await make_allocator(bind_window_s=0.2)
    await give_nodes(bus, allocator, node_inventory("n1"))
    p = pod("slow", [container("main", mem=1000)])
    admit_to_cluster(allocator, p)
    await post(http, f"{allocator.url}/scheduler/filter", filter_args(p, ["n1"]))
    await asyncio.sleep(0.3)
    before = refused("filter_expired")
    assert "bind window of 0.2s" in await _bind(http, allocator, p, "n1")
    assert refused("filter_expired") == before + 1
    assert await filter_then_bind(http, allocator.url, p, "n1") == {"Error": ""}


async def test_a_replica_binds_what_another_replica_filtered(
    make_allocator: MakeAllocator, bus: Bus, http
) -> None:
    # kube-scheduler reaches the replicas through one Service: filter and bind of a pod may
    # land on two of them. The pass record is asked for over NATS.
    backend = LocalClusterBackend()
    one = await make_allocator(backend=backend)
    two = await make_allocator(backend=backend)
    for replica in (one, two):
        await give_nodes(bus, replica, node_inventory("n1"), node_inventory("n2"))
    p = pod("p", [container("main", mem=1000)])
    backend.add_pod(p)
    answer = await filter_then_bind(http, one.url, p, "n1", bind_url=two.url)
    assert answer == {"Error": ""}
    assert backend.node_of("default", "p") == "n1"
    q = pod("q", [container("main", mem=1000)])
    backend.add_pod(q)
    await post(http, f"{one.url}/scheduler/filter", filter_args(q, ["n1"]))
    assert "not passed" in await _bind(http, two, q, "n2")  # neither replica passed n2


def test_pass_records_are_bounded_by_age_pods_and_node_names() -> None:
    passes = FilterPasses(keep_s=10.0, capacity=3, node_entries=5)
    passes.record("a", ["n1", "n2"], now=0.0)
    assert passes.age("a", "n2", now=4.0) == 4.0
    assert passes.age("a", "n3", now=4.0) is None  # a node its filter did not pass
    passes.record("b", ["n1"], now=5.0)
    passes.record("a", ["n3"], now=6.0)  # a new filter of a pod replaces its record
    assert passes.age("a", "n1", now=6.0) is None and passes.age("a", "n3", now=6.0) == 0.0
    passes.record("c", ["n1", "n2", "n3"], now=7.0)  # 5 names: at the bound
    assert len(passes) == 3
    passes.record("d", ["n1"], now=8.0)  # 6 names, 4 pods: the oldest (b) goes
    assert passes.age("b", "n1", now=8.0) is None and len(passes) == 3
    passes.record("e", ["n9"], now=17.5)  # a (6.0) and c (7.0) older than keep_s
    assert passes.age("a", "n3", now=17.5) is None and passes.age("c", "n1", now=17.5) is None
    assert passes.age("d", "n1", now=17.5) == 9.5
