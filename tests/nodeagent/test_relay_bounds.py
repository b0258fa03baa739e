"""The relay bounds what a container can make it do: figures past the device's size, lines
that are not UTF-8 and connections past the per-container cap are refused and counted by
reason, and the refusals are logged once per interval, not once per connection."""

from __future__ import annotations

import asyncio
import logging

import pytest

from services.common import subjects
from services.common.bus import Bus
from services.common.embedded_nats import EmbeddedNats
from services.common.schemas import ClaimRequest, ContainerUsage
from tests.nodeagent.harness import NODE, NodeDirs, gpu_pod, running_node, wait_until
from tests.nodeagent.test_relay import (
    FAST,
    Inbox,
    admitted_dir,
    closed_by_agent,
    connect,
    hello,
    rejected,
    usage,
)
from tests.nodeagent.test_resolver import ClaimResponder


@pytest.fixture
async def inbox(bus: Bus) -> Inbox:  # as test_relay's
    received = Inbox()
    await bus.subscribe(subjects.container_usage(NODE), ContainerUsage, received)
    await bus.serve(
        subjects.ALLOC_CLAIM, ClaimRequest, ClaimResponder(), queue=subjects.ALLOCATOR_QUEUE
    )
    await bus.client.flush()
    return received


async def test_figures_past_the_device_and_non_utf8_lines_are_refused_and_counted(
    nats_server: EmbeddedNats, inbox: Inbox, dirs: NodeDirs, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="vgpu.nodeagent")
    async with running_node(nats_server.url, dirs, **FAST) as (kubelet, agent):
        directory = await admitted_dir(kubelet, dirs, gpu_pod("big", {"main": 1}))
        size = next(g.memory_mib for g in agent.gpus if g.uuid in
                    (directory / "config" / "limits").read_text())  # fmt: skip
        cases = [
            ("over_device_size", hello() + usage(10**12), "used_mib = 1000000000000 MiB"),
            ("over_device_size", hello() + usage(size + 1), ""),  # logged once a minute per reason
            ("not_utf8", b'{"v":1,"type":"exit","pid":1,"x":"\xff"}\n', "byte 0xff at offset"),
            ("not_utf8", hello() + b"\xc3\x28\n", ""),
        ]
        for reason, payload, says in cases:
            before = rejected(reason)
            reader, writer = await connect(directory)
            writer.write(payload)
            await writer.drain()
            assert await closed_by_agent(reader), payload[:60]
            await wait_until(lambda r=reason, b=before: rejected(r) > b, what=f"{reason} counted")
            writer.close()
            if says:
                assert any(says in r.getMessage() for r in caplog.records), says

        # A figure at the device's size is a real one: it is relayed.
        reader, writer = await connect(directory)
        writer.write(hello() + usage(size))
        await writer.drain()
        await wait_until(
            lambda: [m for m in inbox.where(pod="big") if m.devices[0].memory_used_mib == size],
            what="a usage at the device's size relayed",
        )
        # Nothing absurd was ever published.
        assert all(d.memory_used_mib <= size for m in inbox.messages for d in m.devices)
        writer.close()


async def test_connections_past_the_cap_are_refused_counted_and_logged_once(
    nats_server: EmbeddedNats, inbox: Inbox, dirs: NodeDirs, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="vgpu.nodeagent")
    async with running_node(nats_server.url, dirs, **FAST) as (kubelet, _):
        directory = await admitted_dir(kubelet, dirs, gpu_pod("many", {"main": 1}))
        before = rejected("too_many_connections")
        kept = []
        for _ in range(16):  # the default cap
            reader, writer = await connect(directory)
            writer.write(hello())
            await writer.drain()
            kept.append((reader, writer))
        await wait_until(lambda: inbox.where(pod="many", processes=16), what="16 hooks known")
        refused = 0
        for _ in range(100):
            reader, writer = await connect(directory)
            refused += await closed_by_agent(reader)
            writer.close()
        assert refused == 100
        await wait_until(lambda: rejected("too_many_connections") - before == 100,
                         what="every refusal counted")  # fmt: skip
        lines = [r for r in caplog.records if "relay connection refused" in r.getMessage()]
        assert len(lines) == 1, [r.getMessage() for r in lines]
        assert "holds 16 connections" in lines[0].getMessage()
        assert lines[0].reason == "too_many_connections" and lines[0].pod == "default/many"
        # The 16 kept connections still work.
        _, first = kept[0]
        first.write(usage(100))
        await first.drain()
        await wait_until(
            lambda: [m for m in inbox.where(pod="many") if m.devices[0].memory_used_mib == 100],
            what="a kept connection still relays",
        )
        for _, writer in kept:
            writer.close()
        await asyncio.sleep(0)
