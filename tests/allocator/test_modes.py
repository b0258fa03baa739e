"""Placement by sharing mode, and the extender's filter refusing what a node's mode cannot
serve, with the reason; over real HTTP and NATS."""

from __future__ import annotations

from typing import Any

import msgspec

from services.allocator import Allocator
from services.common.bus import Bus
from services.common.schemas import NodeInventory

from .helpers import (
    admit_to_cluster,
    bind_args,
    container,
    filter_args,
    give_nodes,
    node_inventory,
    pod,
    post,
)


def moded(node: str, mode: str, replicas: int, count: int = 2) -> NodeInventory:
    inventory = node_inventory(node, count)
    gpus = [
        msgspec.structs.replace(g, sharing_mode=mode, replicas=replicas) for g in inventory.gpus
    ]
    return NodeInventory(node=node, gpus=gpus)


async def place(allocator: Allocator, http: Any, p: dict[str, Any], node: str) -> dict[str, Any]:
    admit_to_cluster(allocator, p)
    # As kube-scheduler: filter first (bind trusts only what the filter passed), then bind.
    _, passed = await post(http, f"{allocator.url}/scheduler/filter", filter_args(p, [node]))
    assert passed["NodeNames"] == [node], passed
    status, result = await post(http, f"{allocator.url}/scheduler/bind", bind_args(p, node))
    assert status == 200 and not result.get("Error"), result
    uid = p["metadata"]["uid"]
    allocation = next(a for a in allocator.engine.allocations() if a.uid == uid)
    return {name: c.slices for name, c in allocation.containers.items()}


async def test_filter_refuses_what_each_mode_cannot_serve_naming_the_reason(
    allocator: Allocator, bus: Bus, http: Any
) -> None:
    await give_nodes(
        bus, allocator,
        moded("ts", "time-slicing", 4), moded("ex", "exclusive", 1), moded("mps", "mps", 4),
        node_inventory("vg"),
    )  # fmt: skip
    nodes = ["ts", "ex", "mps", "vg"]
    half = pod("half", [container("main", mem=8000)])
    _, result = await post(http, f"{allocator.url}/scheduler/filter", filter_args(half, nodes))
    assert sorted(result["NodeNames"]) == ["mps", "vg"]
    refused = {**result["FailedNodes"], **result["FailedAndUnresolvableNodes"]}
    assert "time-slicing mode refuse it" in refused["ts"]
    assert "hold no memory or compute limit" in refused["ts"]
    assert "exclusive mode refuse it" in refused["ex"] and "given whole" in refused["ex"]
    two = pod("two", [container("main", gpus=2, mem=1000)])
    _, result = await post(http, f"{allocator.url}/scheduler/filter", filter_args(two, nodes))
    assert sorted(result["NodeNames"]) == ["vg"]
    refused = {**result["FailedNodes"], **result["FailedAndUnresolvableNodes"]}
    assert "one GPU's control daemon" in refused["mps"]
    bare = pod("bare", [container("main")])
    _, result = await post(http, f"{allocator.url}/scheduler/filter", filter_args(bare, nodes))
    assert sorted(result["NodeNames"]) == sorted(nodes)


async def test_time_slicing_replicas_least_shared_first_then_full(
    allocator: Allocator, bus: Bus, http: Any
) -> None:
    await give_nodes(bus, allocator, moded("ts", "time-slicing", 2))
    a, b = (g.uuid for g in moded("ts", "time-slicing", 2).gpus)
    used = []
    for index in range(4):
        slices = await place(allocator, http, pod(f"p{index}", [container("main")]), "ts")
        (piece,) = slices["main"]
        assert (piece.memory_mib, piece.cores) == (0, 0)  # no limit: a replica of the GPU
        used.append(piece.uuid)
    assert used == [a, b, a, b]  # the least-shared GPU first
    full = pod("p4", [container("main")])
    _, result = await post(http, f"{allocator.url}/scheduler/filter", filter_args(full, ["ts"]))
    assert result["NodeNames"] == [] and "ts" in result["FailedNodes"]


async def test_two_replicas_get_two_gpus(allocator: Allocator, bus: Bus, http: Any) -> None:
    await give_nodes(bus, allocator, moded("ts", "time-slicing", 4))
    slices = await place(allocator, http, pod("two", [container("main", gpus=2)]), "ts")
    assert len({piece.uuid for piece in slices["main"]}) == 2


async def test_exclusive_takes_whole_gpus_one_pod_each(
    allocator: Allocator, bus: Bus, http: Any
) -> None:
    await give_nodes(bus, allocator, moded("ex", "exclusive", 1))
    first = await place(allocator, http, pod("a", [container("main")]), "ex")
    second = await place(allocator, http, pod("b", [container("main", percent=100)]), "ex")
    assert {first["main"][0].uuid, second["main"][0].uuid} == {
        g.uuid for g in moded("ex", "exclusive", 1).gpus
    }
    assert first["main"][0].cores == 100 and first["main"][0].memory_mib == 40960
    third = pod("c", [container("main")])
    _, result = await post(http, f"{allocator.url}/scheduler/filter", filter_args(third, ["ex"]))
    assert result["NodeNames"] == []


async def test_mps_slices_as_asked_and_equal_shares_for_a_bare_count(
    allocator: Allocator, bus: Bus, http: Any
) -> None:
    await give_nodes(bus, allocator, moded("mps", "mps", 4, count=1))
    asked = await place(allocator, http, pod("a", [container("main", mem=8000, cores=30)]), "mps")
    assert (asked["main"][0].memory_mib, asked["main"][0].cores) == (8000, 30)
    bare = await place(allocator, http, pod("b", [container("main")]), "mps")
    assert (bare["main"][0].memory_mib, bare["main"][0].cores) == (40960 // 4, 25)


async def test_one_replica_per_container_is_refused_by_the_filter_not_at_admission(
    allocator: Allocator, bus: Bus, http: Any
) -> None:
    inventory = moded("ts1", "time-slicing", 4)
    strict = NodeInventory(
        node="ts1",
        gpus=[msgspec.structs.replace(g, one_replica_per_container=True) for g in inventory.gpus],
    )
    await give_nodes(bus, allocator, strict)
    two = pod("two", [container("main", gpus=2)])
    _, result = await post(http, f"{allocator.url}/scheduler/filter", filter_args(two, ["ts1"]))
    assert result["NodeNames"] == []
    refused = {**result["FailedNodes"], **result["FailedAndUnresolvableNodes"]}
    assert "one replica per container (failRequestsGreaterThanOne)" in refused["ts1"]
    one = pod("one", [container("main")])
    _, result = await post(http, f"{allocator.url}/scheduler/filter", filter_args(one, ["ts1"]))
    assert result["NodeNames"] == ["ts1"]
