"""Bookings match the API server: a pod deleted frees its slices at once; a booking whose pod
never got bound, is bound elsewhere or does not exist is freed within the configured time;
the pending pods announced are those the API server has waiting, and they are withdrawn when
bound or deleted. A real allocator on a real nats-server, real HTTP, the in-memory API server.
"""

from __future__ import annotations

import asyncio
import time

import aiohttp
from prometheus_client import REGISTRY

from services.allocator import Allocator, LocalClusterBackend
from services.common import subjects
from services.common.bus import Bus
from services.common.schemas import ContainerAllocation, GpuSlice, PendingPod, PodAllocation

from .conftest import MakeAllocator
from .helpers import (
    admit_to_cluster,
    bind_args,
    container,
    eventually,
    filter_args,
    give_nodes,
    node_inventory,
    pod,
    post,
)

FAST = {"release_unbound_after_s": 0.5, "reconcile_interval_s": 0.1}


def released(reason: str) -> float:
    return (
        REGISTRY.get_sample_value("vgpu_allocator_reconciled_releases_total", {"reason": reason})
        or 0.0
    )


async def bound_pod(allocator: Allocator, name: str, node: str = "n1") -> dict:
    p = pod(name, [container("m", mem=10000)], namespace="ml")
    admit_to_cluster(allocator, p)
    async with aiohttp.ClientSession() as http:  # as kube-scheduler: filter, then bind
        status, answer = await post(
            http, f"{allocator.url}/scheduler/filter", filter_args(p, [node])
        )
        assert status == 200 and answer["NodeNames"] == [node], answer
        status, answer = await post(http, f"{allocator.url}/scheduler/bind", bind_args(p, node))
    assert status == 200 and answer == {"Error": ""}, answer
    return p


def booking_of(p: dict, node: str = "n1", age_s: float = 0.0) -> PodAllocation:
    """A decision as the store holds it (what a replica that died after storing it left)."""
    metadata = p["metadata"]
    return PodAllocation(
        namespace=metadata["namespace"], name=metadata["name"], uid=metadata["uid"], node=node,
        containers={"m": ContainerAllocation(container="m", slices=[
            GpuSlice(uuid="GPU-n1-0", index=0, memory_mib=10000, cores=0)])},
        bound_at=time.time() - age_s,
    )  # fmt: skip


async def test_a_deleted_pod_frees_its_slices_at_once(
    make_allocator: MakeAllocator, bus: Bus
) -> None:
    backend = LocalClusterBackend()
    allocator = await make_allocator(backend=backend)  # default grace: 60 s
    await give_nodes(bus, allocator, node_inventory("n1"))
    p = await bound_pod(allocator, "doomed")
    assert p["metadata"]["uid"] in allocator.ledger
    before = released("deleted")
    started = time.monotonic()
    backend.remove_pod("ml", "doomed")
    await eventually(lambda: p["metadata"]["uid"] not in allocator.ledger, timeout_s=5)
    assert time.monotonic() - started < 5  # at once, not after the 60 s grace
    await eventually(lambda: released("deleted") == before + 1)  # counted once stored


async def test_a_replica_that_does_not_lead_frees_a_deleted_pod_at_once(
    make_allocator: MakeAllocator, bus: Bus
) -> None:
    """A delete while no replica leads (the leader died, or lost its lease in a bus outage)
    is not held until a new leader relists: every replica hears it and frees the slices."""
    backend = LocalClusterBackend()
    leader = await make_allocator(backend=backend)
    # Its lease rounds every 20 s: it will not take over within this test.
    follower = await make_allocator(backend=backend, lease_ttl_s=60.0)
    assert leader.leading and not follower.leading
    for replica in (leader, follower):
        await give_nodes(bus, replica, node_inventory("n1"))
    p = await bound_pod(follower, "doomed")
    uid = p["metadata"]["uid"]
    await eventually(lambda: uid in leader.ledger)
    await leader.stop()  # the leader, and its pod watch, are gone
    before = released("deleted")
    started = time.monotonic()
    backend.remove_pod("ml", "doomed")
    await eventually(lambda: uid not in follower.ledger, timeout_s=5)
    assert time.monotonic() - started < 5 and not follower.leading
    await eventually(lambda: released("deleted") == before + 1)
    # And it is stored: a replica started now loads no booking for the pod.
    fresh = await make_allocator(backend=LocalClusterBackend(), lease_bucket="")
    assert uid not in fresh.ledger


async def test_an_ended_pod_frees_its_slices(make_allocator: MakeAllocator, bus: Bus) -> None:
    backend = LocalClusterBackend()
    allocator = await make_allocator(backend=backend)
    await give_nodes(bus, allocator, node_inventory("n1"))
    p = await bound_pod(allocator, "done")
    backend.set_phase("ml", "done", "Succeeded")
    await eventually(lambda: p["metadata"]["uid"] not in allocator.ledger)


async def test_a_booking_whose_pod_never_got_bound_is_freed_after_the_grace(
    make_allocator: MakeAllocator, bus: Bus
) -> None:
    backend = LocalClusterBackend()
    allocator = await make_allocator(backend=backend, **FAST)
    await give_nodes(bus, allocator, node_inventory("n1"))
    p = pod("stuck", [container("m", mem=10000)], namespace="ml")
    admit_to_cluster(allocator, p)  # exists, never bound
    before = released("never_bound")
    assert await allocator.engine.adopt(booking_of(p))
    await eventually(lambda: released("never_bound") == before + 1, timeout_s=5)
    # A pod bound as it should be is kept past the grace.
    kept = await bound_pod(allocator, "kept")
    await asyncio.sleep(1.0)  # twice the grace, ten reconcile rounds
    assert kept["metadata"]["uid"] in allocator.ledger
    assert released("never_bound") == before + 1


async def test_bookings_without_a_pod_or_bound_elsewhere_are_freed(
    make_allocator: MakeAllocator, bus: Bus
) -> None:
    backend = LocalClusterBackend()
    allocator = await make_allocator(backend=backend, **FAST)
    await give_nodes(bus, allocator, node_inventory("n1"), node_inventory("n2"))
    ghost = pod("ghost", [container("m", mem=10000)], namespace="ml")  # never created
    gone_before, elsewhere_before = released("gone"), released("bound_elsewhere")
    assert await allocator.engine.adopt(booking_of(ghost))
    await eventually(lambda: ghost["metadata"]["uid"] not in allocator.ledger, timeout_s=5)
    await eventually(lambda: released("gone") == gone_before + 1)

    moved = pod("moved", [container("m", mem=10000)], namespace="ml")
    admit_to_cluster(allocator, moved)
    assert await allocator.engine.adopt(booking_of(moved, "n1"))
    await backend.bind("ml", "moved", moved["metadata"]["uid"], "n2")  # another scheduler
    await eventually(lambda: moved["metadata"]["uid"] not in allocator.ledger, timeout_s=5)
    await eventually(lambda: released("bound_elsewhere") == elsewhere_before + 1)


async def test_only_pods_the_api_server_has_waiting_are_announced_as_pending(
    make_allocator: MakeAllocator, bus: Bus
) -> None:
    backend = LocalClusterBackend()
    allocator = await make_allocator(backend=backend)
    await give_nodes(bus, allocator, node_inventory("n1", count=1))
    seen: list[PendingPod] = []

    async def on_pending(message: PendingPod) -> None:
        seen.append(message)

    await bus.subscribe(subjects.alloc_pending(), PendingPod, on_pending)
    await bus.client.flush()
    async with aiohttp.ClientSession() as http:
        # A flood of made-up pods (never created): none is announced.
        for i in range(50):
            made_up = pod(f"fake-{i}", [container("m", mem=10**6)])
            await post(http, f"{allocator.url}/scheduler/filter", filter_args(made_up, ["n1"]))
        real = pod("real", [container("m", mem=10**6)], namespace="ml")
        admit_to_cluster(allocator, real)
        await post(http, f"{allocator.url}/scheduler/filter", filter_args(real, ["n1"]))
        await eventually(lambda: any(m.name == "real" for m in seen))
        assert {m.name for m in seen} == {"real"}, [m.name for m in seen]
        # Deleted in the API server: withdrawn.
        backend.remove_pod("ml", "real")
        await eventually(lambda: any(m.name == "real" and not m.waiting for m in seen))

        # A refusal that came before the watch listed the pod is announced once it does.
        late = pod("late", [container("m", mem=10**6)], namespace="ml")
        await post(http, f"{allocator.url}/scheduler/filter", filter_args(late, ["n1"]))
        assert not any(m.name == "late" for m in seen)
        admit_to_cluster(allocator, late)
        await eventually(lambda: any(m.name == "late" and m.waiting for m in seen))
        # Bound (here by a plain bind, as for a pod that later fitted): withdrawn.
        await backend.bind("ml", "late", late["metadata"]["uid"], "n1")
        await eventually(lambda: any(m.name == "late" and not m.waiting for m in seen))
