"""POST /scheduler/filter over real HTTP, nodes learnt from inventory on a real NATS."""

from __future__ import annotations

import asyncio
import time

import aiohttp
import msgspec

from services.allocator import Allocator
from services.common.bus import Bus

from .conftest import MakeAllocator
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

RESULT_KEYS = {"Nodes", "NodeNames", "FailedNodes", "FailedAndUnresolvableNodes", "Error"}


async def test_node_names_form_exact_keys(allocator: Allocator, bus: Bus, http) -> None:
    await give_nodes(bus, allocator, node_inventory("n1"), node_inventory("n2"))
    status, result = await post(
        http,
        f"{allocator.url}/scheduler/filter",
        filter_args(pod("p", [container("main", mem=1000)]), ["n1", "n2"]),
    )
    assert status == 200
    assert set(result) == RESULT_KEYS
    assert result == {
        "Nodes": None,
        "NodeNames": ["n1", "n2"],
        "FailedNodes": {},
        "FailedAndUnresolvableNodes": {},
        "Error": "",
    }


async def test_node_list_form_returns_the_passing_items(
    allocator: Allocator, bus: Bus, http
) -> None:
    await give_nodes(bus, allocator, node_inventory("n1"))
    items = [
        {"metadata": {"name": "n1", "labels": {"gpu": "a100"}}, "status": {}},
        {"metadata": {"name": "ghost"}},
    ]
    status, result = await post(
        http,
        f"{allocator.url}/scheduler/filter",
        {
            "Pod": pod("p", [container("main")]),
            "Nodes": {"apiVersion": "v1", "kind": "NodeList", "items": items},
            "NodeNames": None,
        },
    )
    assert status == 200 and set(result) == RESULT_KEYS
    assert result["NodeNames"] is None
    assert result["Nodes"] == {"apiVersion": "v1", "kind": "NodeList", "items": [items[0]]}
    assert list(result["FailedNodes"]) == ["ghost"]


async def test_unknown_node_reason(allocator: Allocator, bus: Bus, http) -> None:
    await give_nodes(bus, allocator, node_inventory("n1"))
    _, result = await post(
        http,
        f"{allocator.url}/scheduler/filter",
        filter_args(pod("p", [container("main")]), ["n1", "ghost"]),
    )
    assert result["NodeNames"] == ["n1"]
    reason = result["FailedNodes"]["ghost"]
    assert "'ghost'" in reason and "no GPU inventory received from its vgpu node agent" in reason


async def test_stale_node_reason(make_allocator: MakeAllocator, bus: Bus, http) -> None:
    allocator = await make_allocator(node_timeout_s=1.0)
    await give_nodes(bus, allocator, node_inventory("old"))
    await asyncio.sleep(1.2)
    await give_nodes(bus, allocator, node_inventory("fresh"))
    _, result = await post(
        http,
        f"{allocator.url}/scheduler/filter",
        filter_args(pod("p", [container("main")]), ["old", "fresh"]),
    )
    assert result["NodeNames"] == ["fresh"]
    reason = result["FailedNodes"]["old"]
    assert "'old'" in reason and "silent for 1." in reason and "after 1s" in reason


async def test_never_fits_is_unresolvable_everywhere(allocator: Allocator, bus: Bus, http) -> None:
    await give_nodes(bus, allocator, node_inventory("n1"), node_inventory("n2", count=4))
    for bad, words in (
        (container("huge", mem=50000), ["'huge'", "nvidia.com/gpumem: 50000", "largest GPU"]),
        (container("wide", gpus=5), ["'wide'", "nvidia.com/gpu: 5", "most GPUs on one node: 4"]),
        (container("odd", cores=150), ["'odd'", "nvidia.com/gpucores", "0-100"]),
    ):
        _, result = await post(
            http,
            f"{allocator.url}/scheduler/filter",
            filter_args(pod("p", [container("ok", mem=10), bad]), ["n1", "n2", "ghost"]),
        )
        assert result["NodeNames"] == [] and result["FailedNodes"] == {}
        unresolvable = result["FailedAndUnresolvableNodes"]
        assert list(unresolvable) == ["n1", "n2", "ghost"]
        for word in words:
            assert word in unresolvable["n1"], (word, unresolvable["n1"])


async def test_node_too_small_for_the_pod_is_unresolvable_there(
    allocator: Allocator, bus: Bus, http
) -> None:
    await give_nodes(bus, allocator, node_inventory("small", count=1), node_inventory("big", 4))
    _, result = await post(
        http,
        f"{allocator.url}/scheduler/filter",
        filter_args(pod("p", [container("main", gpus=2)]), ["small", "big"]),
    )
    assert result["NodeNames"] == ["big"]
    reason = result["FailedAndUnresolvableNodes"]["small"]
    assert "'small' can never hold it" in reason and "'main'" in reason


async def test_does_not_fit_now_is_a_plain_failure(allocator: Allocator, bus: Bus, http) -> None:
    await give_nodes(bus, allocator, node_inventory("n1", count=1), node_inventory("n2", 1))
    first = pod("first", [container("main", mem=30000)])
    admit_to_cluster(allocator, first)
    url = allocator.url
    await post(http, f"{url}/scheduler/filter", filter_args(first, ["n1"]))
    _, bound = await post(http, f"{url}/scheduler/bind", bind_args(first, "n1"))
    assert bound == {"Error": ""}

    _, result = await post(
        http,
        f"{url}/scheduler/filter",
        filter_args(pod("second", [container("main", mem=20000)]), ["n1", "n2"]),
    )
    assert result["NodeNames"] == ["n2"]
    assert result["FailedAndUnresolvableNodes"] == {}
    reason = result["FailedNodes"]["n1"]
    assert "'n1'" in reason and "'main'" in reason and "20000 MiB" in reason
    assert "0 of 1 GPUs have that room" in reason


async def test_pod_without_gpu_passes_every_node(allocator: Allocator, http) -> None:
    cpu_only = pod("web", [{"name": "nginx", "resources": {"limits": {"cpu": "1"}}}])
    _, result = await post(
        http, f"{allocator.url}/scheduler/filter", filter_args(cpu_only, ["a", "b"])
    )
    assert result["NodeNames"] == ["a", "b"] and result["FailedNodes"] == {}


async def test_only_input_names_come_back(allocator: Allocator, bus: Bus, http) -> None:
    await give_nodes(bus, allocator, *(node_inventory(f"n{i}") for i in range(4)))
    _, result = await post(
        http,
        f"{allocator.url}/scheduler/filter",
        filter_args(pod("p", [container("main")]), ["n2", "n0", "n2"]),
    )
    assert result["NodeNames"] == ["n2", "n0"]


async def test_prioritize_binpacks_on_memory(make_allocator: MakeAllocator, bus: Bus, http) -> None:
    allocator = await make_allocator(node_policy="binpack", gpu_policy="binpack")
    await give_nodes(bus, allocator, node_inventory("n1", 1), node_inventory("n2", 1))
    busy = pod("busy", [container("main", mem=20480)])
    admit_to_cluster(allocator, busy)
    await post(http, f"{allocator.url}/scheduler/filter", filter_args(busy, ["n2"]))
    assert (await post(http, f"{allocator.url}/scheduler/bind", bind_args(busy, "n2")))[1] == {
        "Error": ""
    }

    status, scores = await post(
        http,
        f"{allocator.url}/scheduler/prioritize",
        filter_args(pod("p", [container("main", mem=10240)]), ["n1", "n2", "ghost"]),
    )
    assert status == 200
    assert scores == [
        {"Host": "n1", "Score": 2},  # 10240 of 40960 MiB after placing
        {"Host": "n2", "Score": 8},  # 30720 of 40960
        {"Host": "ghost", "Score": 0},
    ]


async def test_metrics_count_calls_by_verb_and_outcome(allocator: Allocator, http) -> None:
    async def count(outcome: str) -> float:
        async with http.get(f"{allocator.url}/metrics") as response:
            text = await response.text()
        prefix = f'vgpu_allocator_extender_requests_total{{outcome="{outcome}",verb="filter"}} '
        for line in text.splitlines():
            if line.startswith(prefix):
                return float(line.removeprefix(prefix))
        return 0.0

    before = await count("no_fit"), await count("bad_request")
    await post(
        http, f"{allocator.url}/scheduler/filter", filter_args(pod("p", [container("m")]), ["x"])
    )
    await post(http, f"{allocator.url}/scheduler/filter", b"{")
    assert (await count("no_fit"), await count("bad_request")) == (before[0] + 1, before[1] + 1)
    async with http.get(f"{allocator.url}/metrics") as response:
        assert "vgpu_allocator_extender_request_seconds_bucket" in await response.text()


async def test_healthz(allocator: Allocator, http: aiohttp.ClientSession) -> None:
    async with http.get(f"{allocator.url}/healthz") as response:
        assert response.status == 200
        body = await response.json()
    assert body["status"] == "ok" and body["nats_connected"] is True


async def test_every_verb_says_its_time_in_the_allocator(
    allocator: Allocator, bus: Bus, http: aiohttp.ClientSession
) -> None:
    """Server-Timing (W3C, milliseconds): the allocator's own part of each call's round
    trip, as bench/allocator_extender.py reports beside the client's figures; a refused
    body says it too."""
    await give_nodes(bus, allocator, node_inventory("n1"))
    p = pod("timed", [container("main", mem=1000)])
    admit_to_cluster(allocator, p)
    calls = [
        ("filter", filter_args(p, ["n1"])),
        ("prioritize", filter_args(p, ["n1"])),
        ("bind", bind_args(p, "n1")),
        ("filter", b"{not json"),
    ]
    for verb, body in calls:
        data = body if isinstance(body, bytes) else msgspec.json.encode(body)
        started = time.perf_counter()
        async with http.post(f"{allocator.url}/scheduler/{verb}", data=data) as response:
            await response.read()
            round_trip_ms = (time.perf_counter() - started) * 1000
            timing = response.headers.get("Server-Timing", "")
        assert response.status == (400 if isinstance(body, bytes) else 200)
        name, _, duration = timing.partition(";dur=")
        assert name == "allocator", timing
        assert 0 < float(duration) <= round_trip_ms, (verb, timing, round_trip_ms)
