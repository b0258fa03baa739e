"""The HTTP edge never answers 500, readiness follows the lease, silent nodes keep their pods."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
from aiohttp import web

from services.allocator import Allocator
from services.allocator.extender import build_app
from services.common import subjects
from services.common.bus import Bus
from services.common.schemas import PendingPod

from .conftest import MakeAllocator
from .helpers import (
    admit_to_cluster,
    bind_args,
    container,
    eventually,
    filter_args,
    filter_then_bind,
    give_nodes,
    node_inventory,
    pod,
    post,
)


class Exploding:
    """An engine whose every verb hits a bug: only the edge's answer is under test."""

    def filter(self, pod: dict[str, Any], names: list[str]) -> Any:
        raise RuntimeError("boom")

    def prioritize(self, pod: dict[str, Any], names: list[str]) -> Any:
        raise RuntimeError("boom")

    async def bind(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("boom")


async def test_bugs_are_answered_200_in_the_verbs_own_shape() -> None:
    app = build_app(Exploding(), lambda: (True, {}))  # type: ignore[arg-type]
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    url = f"http://127.0.0.1:{runner.addresses[0][1]}/scheduler"
    try:
        async with aiohttp.ClientSession() as http:
            p = pod("p", [container("m")])
            status, answer = await post(http, f"{url}/filter", filter_args(p, ["n1"]))
            assert status == 200 and "internal error in filter" in answer["Error"]
            assert set(answer) == {
                "Nodes",
                "NodeNames",
                "FailedNodes",
                "FailedAndUnresolvableNodes",
                "Error",
            }
            status, answer = await post(http, f"{url}/prioritize", filter_args(p, ["n1", "n2"]))
            assert status == 200 and answer == [
                {"Host": "n1", "Score": 0},
                {"Host": "n2", "Score": 0},
            ]
            status, answer = await post(http, f"{url}/bind", bind_args(p, "n1"))
            assert status == 200 and "internal error in bind" in answer["Error"]
    finally:
        await runner.cleanup()


async def test_readiness_follows_the_lease(make_allocator: MakeAllocator) -> None:
    leader = await make_allocator(lease_ttl_s=1.0)
    standby = await make_allocator(lease_ttl_s=1.0)
    async with aiohttp.ClientSession() as http:
        async with http.get(f"{leader.url}/readyz") as response:
            assert response.status == 200 and (await response.json())["role"] == "leader"
        async with http.get(f"{standby.url}/readyz") as response:
            assert response.status == 503 and (await response.json())["role"] == "standby"
        await leader.stop()  # hands the lease over at once
        for _ in range(100):
            async with http.get(f"{standby.url}/readyz") as response:
                if response.status == 200:
                    break
            await asyncio.sleep(0.05)
        assert standby.leading


async def test_a_silent_node_takes_nothing_new_and_keeps_its_pods(
    make_allocator: MakeAllocator, bus: Bus
) -> None:
    allocator: Allocator = await make_allocator(node_timeout_s=2.0)
    await give_nodes(bus, allocator, node_inventory("n1", count=1))
    p = pod("p", [container("m", mem=1000)])
    admit_to_cluster(allocator, p)
    async with aiohttp.ClientSession() as http:
        assert await filter_then_bind(http, allocator.url, p, "n1") == {"Error": ""}
        await asyncio.sleep(2.5)
        _, result = await post(
            http,
            f"{allocator.url}/scheduler/filter",
            filter_args(pod("q", [container("m", mem=1)]), ["n1"]),
        )
        assert "silent for" in result["FailedNodes"]["n1"]
        assert [a.name for a in allocator.engine.allocations()] == ["p"]
        assert allocator.ledger.reserved("n1")["GPU-n1-0"].memory_mib == 1000
        await bus.publish(
            subjects.inventory("n1"), node_inventory("n1", count=1)
        )  # it speaks again
        await eventually(lambda: allocator.cluster.status("n1").available)
        _, result = await post(
            http,
            f"{allocator.url}/scheduler/filter",
            filter_args(pod("q", [container("m", mem=1)]), ["n1"]),
        )
        assert result["NodeNames"] == ["n1"]


async def test_a_pod_no_node_takes_is_published_as_pending(allocator: Allocator, bus: Bus) -> None:
    await give_nodes(bus, allocator, node_inventory("n1", count=1), node_inventory("n2", count=1))
    seen: list[PendingPod] = []

    async def on_pending(message: PendingPod) -> None:
        seen.append(message)

    await bus.subscribe(subjects.alloc_pending(), PendingPod, on_pending)
    await bus.client.flush()
    big = pod("big", [container("m", mem=50000)], namespace="ml")
    admit_to_cluster(allocator, big)  # pending in the API server: only such pods are shown
    async with aiohttp.ClientSession() as http:
        await post(
            http, f"{allocator.url}/scheduler/filter", filter_args(big, ["n1", "n2", "ghost"])
        )
    await eventually(lambda: len(seen) == 1)
    (pending,) = seen
    assert (pending.namespace, pending.name, pending.uid) == ("ml", "big", big["metadata"]["uid"])
    assert pending.unresolvable and pending.requests[0].memory_mib == 50000
    (reason,) = pending.reasons
    assert reason.node_count == 3 and "can never fit" in reason.message
