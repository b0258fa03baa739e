"""Decisions in JetStream KV: rebuilt on restart, compare-and-set between replicas, and a
replica killed (SIGKILL) in the middle of a burst of binds loses and double-books nothing."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import aiohttp
import pytest

from services.allocator import Allocator, AllocatorSettings, LocalClusterBackend
from services.common.bus import Bus
from services.common.embedded_nats import EmbeddedNats
from services.simulators.apiserver import FakeApiServer

from .conftest import MakeAllocator
from .helpers import (
    A100_MIB,
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
    stored_pods,
)

ROOT = Path(__file__).resolve().parents[2]


async def test_restart_rebuilds_from_the_store(make_allocator: MakeAllocator, bus: Bus) -> None:
    backend = LocalClusterBackend()
    first = await make_allocator(backend=backend)
    await give_nodes(bus, first, node_inventory("n1", count=1))
    pods = [pod(f"p{i}", [container("m", mem=10000)]) for i in range(3)]
    admit_to_cluster(first, *pods)
    async with aiohttp.ClientSession() as http:
        for p in pods:
            assert await filter_then_bind(http, first.url, p, "n1") == {"Error": ""}
    await first.stop()

    second = await make_allocator(backend=backend)
    assert {a.uid for a in second.engine.allocations()} == {p["metadata"]["uid"] for p in pods}
    await give_nodes(bus, second, node_inventory("n1", count=1))
    assert second.ledger.reserved("n1")["GPU-n1-0"].memory_mib == 30000
    late = pod("late", [container("m", mem=20000)])
    admit_to_cluster(second, late)
    async with aiohttp.ClientSession() as http:
        _, result = await post(http, f"{second.url}/scheduler/filter", filter_args(late, ["n1"]))
    assert result["NodeNames"] == [] and "n1" in result["FailedNodes"]  # 30000 MiB promised


async def test_two_replicas_never_promise_the_same_memory(
    make_allocator: MakeAllocator, bus: Bus
) -> None:
    backend = LocalClusterBackend()
    one = await make_allocator(backend=backend)
    two = await make_allocator(backend=backend)
    await give_nodes(bus, one, node_inventory("n1", count=1))
    await give_nodes(bus, two, node_inventory("n1", count=1))
    pods = [pod(f"p{i}", [container("m", mem=15000)]) for i in range(6)]
    admit_to_cluster(one, *pods)
    async with aiohttp.ClientSession() as http:
        for i, p in enumerate(pods):  # filtered on one replica, bound on either
            _, passed = await post(
                http, f"{(one, two)[i % 3 % 2].url}/scheduler/filter", filter_args(p, ["n1"])
            )
            assert passed["NodeNames"] == ["n1"]
        answers = await asyncio.gather(
            *(
                post(http, f"{(one, two)[i % 2].url}/scheduler/bind", bind_args(p, "n1"))
                for i, p in enumerate(pods)
            )
        )
    bound = [p for p, (_, a) in zip(pods, answers, strict=True) if a["Error"] == ""]
    # Every refusal is for room, none for a filter that ran on the other replica.
    assert all("not passed" not in a["Error"] for _, a in answers), answers
    assert len(bound) == 2  # 2 x 15000 of 40960 MiB
    await eventually(lambda: len(one.ledger) == len(two.ledger) == 2)
    assert one.ledger.reserved("n1") == two.ledger.reserved("n1")
    assert one.ledger.reserved("n1")["GPU-n1-0"].memory_mib == 30000


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def _wait_http(url: str, timeout_s: float = 30.0) -> None:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=1)) as http:
        for _ in range(int(timeout_s / 0.1)):
            try:
                async with http.get(f"{url}/healthz") as response:
                    if response.status == 200:
                        return
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.1)
    raise AssertionError(f"{url} did not come up")


@pytest.mark.timeout(90)
async def test_killing_the_active_replica_mid_burst_loses_and_double_books_nothing(
    nats_server: EmbeddedNats, api: FakeApiServer, bus: Bus
) -> None:
    port = _free_port()
    env = {
        **os.environ,
        "VGPU_CLUSTER": "kubernetes",
        "VGPU_KUBE_API_URL": api.url,
        "VGPU_LEASE_TTL_S": "1.0",
        "VGPU_LOG_LEVEL": "warning",
    }
    active = subprocess.Popen(  # noqa: ASYNC220 - a short start, once
        [sys.executable, "-m", "services.cli.main", "allocator", "--nats-url", nats_server.url,
         "--http-port", str(port)],
        cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    standby: Allocator | None = None
    try:
        active_url = f"http://127.0.0.1:{port}"
        await _wait_http(active_url)
        standby = Allocator(
            AllocatorSettings(
                nats_url=nats_server.url, http_port=0, cluster="kubernetes",
                kube_api_url=api.url, lease_ttl_s=1.0,
            )
        )  # fmt: skip
        await standby.start()
        nodes = [node_inventory(f"n{i}", count=2) for i in range(4)]
        await give_nodes(bus, standby, *nodes)
        await asyncio.sleep(0.3)  # the active one subscribed before us: it has them too
        pods = [
            await api.create_pod(pod(f"p{i}", [container("m", mem=10000)], namespace="burst"))
            for i in range(40)
        ]  # 40 pods for 4 nodes x 2 GPUs x 4 slices of 10000 MiB = 32 places
        bound: dict[str, str] = {}
        refused: list[str] = []
        done = 0
        killed = asyncio.Event()

        async def schedule(http: aiohttp.ClientSession, p: dict, first: str) -> None:
            nonlocal done
            names = [n.node for n in nodes]
            for url in (first, standby.url, standby.url):  # retried as kube-scheduler would
                try:
                    _, result = await post(http, f"{url}/scheduler/filter", filter_args(p, names))
                    for node in result["NodeNames"] or []:
                        _, answer = await post(http, f"{url}/scheduler/bind", bind_args(p, node))
                        if answer["Error"] == "":
                            bound[p["metadata"]["uid"]] = node
                            return
                except (TimeoutError, aiohttp.ClientError):
                    continue  # the replica died under us
                finally:
                    done += 1
                    if done == 12 and not killed.is_set():
                        active.send_signal(signal.SIGKILL)
                        killed.set()
                refused.append(p["metadata"]["name"])
                return

        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as http:
            gate = asyncio.Semaphore(6)

            async def limited(i: int, p: dict) -> None:
                async with gate:
                    await schedule(http, p, active_url if i % 3 else standby.url)

            await asyncio.gather(*(limited(i, p) for i, p in enumerate(pods)))
        assert killed.is_set() and active.wait(timeout=5) == -signal.SIGKILL
        # A bind the killed replica completed but could not answer is bound all the same.
        in_cluster = {p["metadata"]["uid"]: p["spec"].get("nodeName") for p in api.pods.values()}
        assert all(in_cluster[uid] == node for uid, node in bound.items())
        bound = {uid: node for uid, node in in_cluster.items() if node}
        assert len(bound) == 32, (len(bound), refused)

        # Nothing lost: every bind answered OK is recorded by the survivor, on its node, and
        # bound in the cluster; nothing double-booked: no GPU holds more than it has.
        records = {a.uid: a for a in standby.engine.allocations()}
        for uid, node in bound.items():
            assert records[uid].node == node
        for node in nodes:
            for gpu, held in standby.ledger.reserved(node.node).items():
                assert held.memory_mib <= A100_MIB, (gpu, held)
        # And the store says the same as the survivor.
        stored: dict[str, str] = {}
        for node in nodes:
            for allocation in await stored_pods(bus, node.node):
                stored[allocation.uid] = allocation.node
        assert stored == bound
        await eventually(lambda: standby.leading, timeout_s=10)
    finally:
        if active.poll() is None:
            active.kill()
            active.wait()
        if standby is not None:
            await standby.stop()
