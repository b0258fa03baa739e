"""The bus against a real nats-server: typed messages, trace context, bad input, outages."""

from __future__ import annotations

import asyncio

import msgspec
import pytest
from opentelemetry import trace

from services.common import subjects
from services.common.bus import UNDECODABLE, Bus, BusError, ReplyError
from services.common.embedded_nats import EmbeddedNats
from services.common.schemas import (
    ClaimReply,
    ClaimRequest,
    GpuDevice,
    NodeInventory,
)
from services.common.tracing import tracer

INVENTORY = NodeInventory(
    node="node-a",
    gpus=[GpuDevice(uuid="GPU-1", index=0, model="A100-40GB", memory_mib=40960, sm_count=108)],
)
CLAIM = ClaimRequest(
    node="node-a", namespace="default", pod="p", container="c", device_ids=["GPU-1::0"],
    gpu_uuids=["GPU-1"],
)  # fmt: skip


async def _collect(bus: Bus, subject: str) -> asyncio.Queue[tuple[NodeInventory, str]]:
    received: asyncio.Queue[tuple[NodeInventory, str]] = asyncio.Queue()

    async def on_inventory(message: NodeInventory) -> None:
        trace_id = trace.get_current_span().get_span_context().trace_id
        await received.put((message, f"{trace_id:032x}"))

    await bus.subscribe(subject, NodeInventory, on_inventory)
    return received


async def test_publish_delivers_typed_message_inside_the_senders_trace(bus: Bus) -> None:
    received = await _collect(bus, subjects.INVENTORY_ALL)
    with tracer("test").start_as_current_span("send") as span:
        await bus.publish(subjects.inventory("node-a"), INVENTORY)
        sent_trace = f"{span.get_span_context().trace_id:032x}"
    message, trace_id = await asyncio.wait_for(received.get(), 2)
    assert message.gpus[0].memory_mib == 40960
    assert trace_id == sent_trace


@pytest.mark.parametrize(
    "payload",
    [b"not json", b'{"node": "node-a", "gpus": [{"uuid": "GPU-1"', b'{"node": 7, "gpus": []}', b""],
    ids=["garbage", "truncated", "wrong-type", "empty"],
)
async def test_undecodable_messages_are_counted_and_the_subscription_survives(
    bus: Bus, payload: bytes
) -> None:
    subject = subjects.inventory("node-a")
    before = UNDECODABLE.labels(subject=subject)._value.get()
    received = await _collect(bus, subjects.INVENTORY_ALL)
    await bus.client.publish(subject, payload)
    await bus.publish(subject, INVENTORY)
    message, _ = await asyncio.wait_for(received.get(), 2)
    assert message.node == "node-a"
    assert received.empty()
    assert UNDECODABLE.labels(subject=subject)._value.get() == before + 1


async def test_request_reply_round_trip_and_described_errors(bus: Bus) -> None:
    async def handle(request: ClaimRequest) -> ClaimReply:
        if request.container == "unknown":
            raise ReplyError(f"no allocation for container {request.container!r}")
        if request.container == "boom":
            raise RuntimeError("secret internal detail")
        return ClaimReply(pod_uid="uid-1")

    await bus.serve(subjects.ALLOC_CLAIM, ClaimRequest, handle, queue=subjects.ALLOCATOR_QUEUE)
    reply = await bus.request(subjects.ALLOC_CLAIM, CLAIM, ClaimReply)
    assert reply.pod_uid == "uid-1"

    with pytest.raises(BusError, match="no allocation for container 'unknown'"):
        await bus.request(
            subjects.ALLOC_CLAIM, msgspec.structs.replace(CLAIM, container="unknown"), ClaimReply
        )
    with pytest.raises(BusError, match="internal error") as failure:
        await bus.request(
            subjects.ALLOC_CLAIM, msgspec.structs.replace(CLAIM, container="boom"), ClaimReply
        )
    assert "secret" not in str(failure.value)


async def test_undecodable_request_gets_an_error_reply_not_silence(bus: Bus) -> None:
    async def handle(request: ClaimRequest) -> ClaimReply:
        return ClaimReply(pod_uid="never")

    await bus.serve(subjects.ALLOC_CLAIM, ClaimRequest, handle)
    reply = await bus.client.request(subjects.ALLOC_CLAIM, b'{"node": "n"', timeout=2)
    assert b"undecodable ClaimRequest" in reply.data


async def test_request_without_responder_names_the_subject(bus: Bus) -> None:
    with pytest.raises(BusError, match=r"vgpu\.v1\.alloc\.claim"):
        await bus.request(subjects.ALLOC_CLAIM, CLAIM, ClaimReply, timeout=0.5)


async def test_connect_to_an_absent_server_fails_clearly() -> None:
    with pytest.raises(BusError, match=r"cannot reach NATS at nats://127\.0\.0\.1:1 "):
        await Bus.connect("nats://127.0.0.1:1", "test", connect_timeout_s=0.5)


async def test_subscriptions_resume_after_a_nats_outage() -> None:
    first = EmbeddedNats().start()
    port = first.port
    bus = await Bus.connect(first.url, "outage-test")
    try:
        received = await _collect(bus, subjects.INVENTORY_ALL)
        await bus.publish(subjects.inventory("node-a"), INVENTORY)
        await asyncio.wait_for(received.get(), 2)
        first.stop()
        await asyncio.sleep(0.3)
        with EmbeddedNats(port=port):
            for _ in range(100):  # wait for the client's own reconnect
                if bus.client.is_connected:
                    break
                await asyncio.sleep(0.05)
            await bus.publish(subjects.inventory("node-a"), INVENTORY)
            message, _ = await asyncio.wait_for(received.get(), 5)
            assert message.node == "node-a"
    finally:
        await bus.close()
        first.stop()
