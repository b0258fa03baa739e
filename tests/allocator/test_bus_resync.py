"""An allocator replica cut off from the bus while another one books a pod learns of it on
reconnection. The partition is real: the replica reaches the real nats-server through a TCP
relay that the test cuts and restores, while the other replica keeps the server.

Measured: the KV watch (an ordered consumer) caught up by itself here, also without the
re-read the allocator does on reconnection (Journal.resync); the re-read covers a consumer
the server lost (a restarted server without its store)."""

from __future__ import annotations

import aiohttp

from services.allocator import Allocator, AllocatorSettings, LocalClusterBackend
from services.common.bus import Bus
from services.common.embedded_nats import EmbeddedNats
from tests.metrics.test_bus_resync import Partition

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


async def test_a_partitioned_replica_reads_the_bookings_it_missed(
    nats_server: EmbeddedNats, bus: Bus
) -> None:
    backend = LocalClusterBackend()
    partition = Partition(nats_server.port)
    await partition.restore()
    cut_off = Allocator(
        AllocatorSettings(nats_url=f"nats://127.0.0.1:{partition.port}", http_port=0),
        backend,
    )
    other = Allocator(AllocatorSettings(nats_url=nats_server.url, http_port=0), backend)
    await cut_off.start()
    await other.start()
    try:
        await give_nodes(bus, other, node_inventory("n1"))
        await partition.cut()
        await eventually(lambda: not cut_off._health()[0], timeout_s=10)
        p = pod("while-cut", [container("m", mem=10000)], namespace="ml")
        admit_to_cluster(other, p)
        async with aiohttp.ClientSession() as http:
            _, answer = await post(http, f"{other.url}/scheduler/filter", filter_args(p, ["n1"]))
            assert answer["NodeNames"] == ["n1"], answer
            _, answer = await post(http, f"{other.url}/scheduler/bind", bind_args(p, "n1"))
            assert answer == {"Error": ""}, answer
        uid = p["metadata"]["uid"]
        assert uid in other.ledger and uid not in cut_off.ledger

        await partition.restore()
        await eventually(lambda: uid in cut_off.ledger, timeout_s=15)
        assert cut_off.ledger.get(uid).node == "n1"  # type: ignore[union-attr]
    finally:
        await cut_off.stop()
        await other.stop()
        await partition.cut()
