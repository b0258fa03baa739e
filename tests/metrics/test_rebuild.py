"""After a restart the picture is rebuilt from the allocator's JetStream KV bucket.

The bucket is filled here in the allocator journal's layout (docs/events.md): key
`node.<node>` holds `{"node": ..., "pods": [PodAllocation, ...]}`.
"""

from __future__ import annotations

import asyncio

import msgspec

from services.common import subjects
from services.common.bus import Bus
from services.common.embedded_nats import EmbeddedNats
from services.common.schemas import AllocationEvent, ContainerAllocation, GpuSlice, PodAllocation
from services.metrics.rebuild import Decisions, KvDecisionSource, NodeRecords
from services.metrics.service import REJECTED, MetricsService
from tests.metrics.helpers import ALLOCATION, INVENTORY, announce, get_json, settings, wait_for


def pod(uid: str, name: str, node: str = "node-a", gpu: str = "GPU-a1") -> PodAllocation:
    return PodAllocation(
        namespace="team", name=name, uid=uid, node=node,
        containers={"c": ContainerAllocation(
            container="c", slices=[GpuSlice(uuid=gpu, index=1, memory_mib=4096, cores=10)])},
    )  # fmt: skip


def records(node: str, *pods: PodAllocation) -> bytes:
    return msgspec.json.encode(NodeRecords(node=node, pods=list(pods)))


async def test_a_restarted_service_rebuilds_decisions_from_kv(
    nats_server: EmbeddedNats, bus: Bus
) -> None:
    kv = await bus.client.jetstream().create_key_value(bucket="vgpu-allocations")
    await kv.put("node.node-a", records("node-a", ALLOCATION))
    await kv.put("node.node-b", records("node-b", pod("uid-2", "two", "node-b"),
                                        pod("uid-3", "three", "node-b")))  # fmt: skip
    await kv.put("node.node-c", records("node-c", pod("uid-gone", "gone", "node-c")))
    await kv.delete("node.node-c")  # a node's records deleted: nothing to rebuild there
    await kv.put("node.node-d", b'{"node": "node-d", "pods": [{"namespace": 7}]}')
    await kv.put("lease", b"not a decision")  # other keys are not read
    rejected = REJECTED.labels(kind="kv_record", reason="undecodable")._value.get()

    service = MetricsService(settings(nats_server.url))
    await service.start()
    try:
        assert set(service.picture.pods) == {"uid-1", "uid-2", "uid-3"}
        assert REJECTED.labels(kind="kv_record", reason="undecodable")._value.get() == rejected + 1
        await announce(bus, service, INVENTORY)
        _, body = await get_json(service, "/api/v1/picture")
        assert isinstance(body, dict)
        assert body["nodes"][0]["gpus"][0]["memory_allocated_mib"] == 20480
        # Events go on from there.
        released = AllocationEvent(kind="released", allocation=pod("uid-2", "two", "node-b"))
        await bus.publish(subjects.alloc_events("node-b"), released)
        await wait_for(lambda: "uid-2" not in service.picture.pods)
    finally:
        await service.stop()


async def test_without_a_bucket_the_picture_fills_from_events(
    nats_server: EmbeddedNats, bus: Bus
) -> None:
    service = MetricsService(settings(nats_server.url, kv_bucket="no-such-bucket"))
    started = asyncio.get_running_loop().time()
    await service.start()
    try:
        assert asyncio.get_running_loop().time() - started < 3
        assert service.picture.pods == {}
        await announce(bus, service, INVENTORY)
        await bus.publish(subjects.alloc_events("node-a"),
                          AllocationEvent(kind="bound", allocation=ALLOCATION))  # fmt: skip
        await wait_for(lambda: service.picture.pods)
    finally:
        await service.stop()


class RecordsAfterRelease:
    """A source whose snapshot was taken before a release the service already saw."""

    async def load(self) -> Decisions:
        return Decisions(allocations=[ALLOCATION, pod("uid-2", "two")])


async def test_events_seen_during_the_rebuild_win_over_older_records(
    nats_server: EmbeddedNats,
) -> None:
    service = MetricsService(settings(nats_server.url), decisions=RecordsAfterRelease())
    service.picture.on_allocation(AllocationEvent(kind="released", allocation=ALLOCATION))
    await service.start()
    try:
        assert set(service.picture.pods) == {"uid-2"}
    finally:
        await service.stop()


async def test_kv_source_reads_latest_values_only(nats_server: EmbeddedNats, bus: Bus) -> None:
    kv = await bus.client.jetstream().create_key_value(bucket="decisions", history=5)
    await kv.put("node.n", records("n", pod("uid-9", "old")))
    await kv.put("node.n", records("n", pod("uid-9", "new")))
    loaded = await KvDecisionSource(bus.client, "decisions").load()
    assert loaded.found and [p.name for p in loaded.allocations] == ["new"]
    empty = await bus.client.jetstream().create_key_value(bucket="empty")
    assert empty is not None
    nothing = await KvDecisionSource(bus.client, "empty").load()
    assert nothing.found and nothing.allocations == []
