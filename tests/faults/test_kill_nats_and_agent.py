"""kill -9 of the nats-server and of a node agent under a running system: every booking made
before the kill is still there after it, nothing is decided while the store is away, nothing
is double-booked when placing resumes, and each recovery is timed.

Two nodes of 2 simulated A100-40GB with 10 slices each (40 places of 4096 MiB): half are
bound before the fault and the rest after it, so a booking forgotten by the fault would show
as a GPU promised past its memory or a 41st pod placed.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time

import aiohttp
import pytest

from bench.fault_rig import (
    Processes,
    allocations_of,
    audit,
    free_port,
    http_status,
    kill9,
    place,
    place_all,
    pod,
    schedule,
    wait_for_nodes,
    wait_until_ready,
)
from services.common.bus import Bus
from services.common.embedded_nats import EmbeddedNats
from services.simulators.apiserver import FakeApiServer

NODES = ["n0", "n1"]
POD_MIB = 4096  # 10 on an A100-40GB
PLACES = 2 * 2 * 10


async def start_system(
    procs: Processes, api: FakeApiServer, http: aiohttp.ClientSession
) -> tuple[str, list[dict]]:
    """One allocator, two nodes; PLACES + 2 pods in the API server. The allocator's URL."""
    port = free_port()
    procs.allocator(port, "only", lease_ttl_s=1.0)
    for name in NODES:
        procs.node(name, gpus=2, split_count=10)
    url = f"http://127.0.0.1:{port}"
    await wait_until_ready(http, url)
    pods = [await api.create_pod(pod(f"p{i}", POD_MIB)) for i in range(PLACES + 2)]
    await wait_for_nodes(http, url, pods[0], NODES)
    return url, pods


@pytest.mark.timeout(180)
async def test_kill_9_of_nats_loses_no_booking_and_everything_reconnects(
    procs: Processes,
    api: FakeApiServer,
    bus: Bus,
    http: aiohttp.ClientSession,
    nats_server: EmbeddedNats,
) -> None:
    url, pods = await start_system(procs, api, http)
    before = await place_all(http, url, pods[:20], NODES)
    assert None not in before.values()
    (await audit(api, bus)).assert_sound()

    assert nats_server.pid is not None
    os.kill(nats_server.pid, signal.SIGKILL)
    killed_at = time.monotonic()
    assert await nats_server.wait_exit() == -signal.SIGKILL
    # Without the store no decision is made: once the allocator knows its bus is down, a
    # bind is refused at once (not after the store's write timeout), not half-made.
    while await http_status(http, f"{url}/healthz") == 200:
        assert time.monotonic() - killed_at < 30, "the allocator never noticed NATS die"
        await asyncio.sleep(0.05)
    refused_at = time.monotonic()
    refused = await place(http, [url], pods[20], NODES)
    assert refused.node is None and "the store is unreachable" in refused.error, refused.error
    assert time.monotonic() - refused_at < 3  # three quick refusals, no write timeout
    assert pods[20]["metadata"]["name"] not in {
        name for (_, name), p in api.pods.items() if p["spec"].get("nodeName")
    }
    down_s = time.monotonic() - killed_at

    await nats_server.start_async()  # same port, same JetStream store, as `vgpu up` does
    restarted_at = time.monotonic()
    ready_s = await wait_until_ready(http, url)
    inventory_s = await wait_for_nodes(http, url, pods[20], NODES)
    first = await place(http, [url], pods[20], NODES)
    first_bind_s = time.monotonic() - restarted_at
    assert first.node is not None, f"{first.error}\n{procs.log_tails()}"

    after = await place_all(http, url, pods[21:], NODES)
    result = await audit(api, bus)
    result.assert_sound()
    assert set(before) <= set(result.bound)  # every pre-kill booking survived
    assert (
        len(result.bound) == PLACES and list(after.values()).count(None) == 2
    )  # 42 pods, 40 places
    assert await allocations_of(http, url) == result.bound
    print(
        f"\nnats kill -9: server down {down_s:.2f}s (restarted by the test); after the restart "
        f"allocator ready in {ready_s:.2f}s, agents' inventory in {ready_s + inventory_s:.2f}s, "
        f"first bind {first_bind_s:.2f}s; {len(result.bound)} bound, 0 lost, 0 double-booked"
    )
    assert first_bind_s < 30


@pytest.mark.timeout(180)
async def test_kill_9_of_a_node_agent_keeps_its_bookings_and_it_comes_back(
    procs: Processes, api: FakeApiServer, bus: Bus, http: aiohttp.ClientSession
) -> None:
    url, pods = await start_system(procs, api, http)
    before = await place_all(http, url, pods[:15], NODES)  # n0 filled first, not full
    assert None not in before.values()
    booked = await allocations_of(http, url)
    on_n0 = {uid for uid, node in booked.items() if node == "n0"}

    agent = procs.nodes["n0"].agent
    assert agent is not None
    kill9(agent)
    # The node's bookings stay: its pods still run whether or not its agent does.
    assert {u for u, n in (await allocations_of(http, url)).items() if n == "n0"} == on_n0
    (await audit(api, bus)).assert_sound()

    procs.start_agent("n0", gpus=2, split_count=10)
    restarted_at = time.monotonic()
    n0_only = await schedule(http, [url], pods[20], ["n0"])
    while n0_only is None and time.monotonic() - restarted_at < 60:
        n0_only = await schedule(http, [url], pods[20], ["n0"])
    back_s = time.monotonic() - restarted_at
    assert n0_only == "n0" and on_n0, on_n0

    after = await place_all(http, url, pods[15:20] + pods[21:], NODES)
    result = await audit(api, bus)
    result.assert_sound()
    assert set(before) <= set(result.bound)
    assert (
        len(result.bound) == PLACES and list(after.values()).count(None) == 2
    )  # 42 pods, 40 places
    print(
        f"\nnode agent kill -9: {len(on_n0)} bookings on n0 kept; restarted agent's node "
        f"placing again {back_s:.2f}s after its start; {len(result.bound)} bound, 0 lost, "
        f"0 double-booked"
    )
    assert back_s < 60
