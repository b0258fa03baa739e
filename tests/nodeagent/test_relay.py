"""The hooks' relay over real unix sockets: good, malformed and oversized lines, NATS out."""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import REGISTRY

from services.common import subjects
from services.common.bus import Bus
from services.common.embedded_nats import EmbeddedNats
from services.common.schemas import ClaimReply, ClaimRequest, ContainerUsage
from services.nodeagent import limits_file
from services.nodeagent.gpus import SimulatedGpuBackend
from services.nodeagent.grant import container_key
from services.nodeagent.relay_protocol import MAX_LINE_BYTES, RelayProtocolError, decode_line
from services.nodeagent.service import NodeAgent
from services.simulators.kubelet import KubeletSimulator
from tests.nodeagent.harness import NODE, NodeDirs, gpu_pod, running_node, wait_until
from tests.nodeagent.test_resolver import ClaimResponder

FAST = {"relay_publish_interval_s": 0.05, "util_interval_s": 0.05, "usage_interval_s": 0.05}


class Inbox:
    def __init__(self) -> None:
        self.messages: list[ContainerUsage] = []

    async def __call__(self, message: ContainerUsage) -> None:
        self.messages.append(message)

    def where(self, **fields: Any) -> list[ContainerUsage]:
        return [m for m in self.messages if all(getattr(m, k) == v for k, v in fields.items())]


@pytest.fixture
async def inbox(bus: Bus) -> Inbox:
    received = Inbox()
    await bus.subscribe(subjects.container_usage(NODE), ContainerUsage, received)
    await bus.serve(
        subjects.ALLOC_CLAIM, ClaimRequest, ClaimResponder(), queue=subjects.ALLOCATOR_QUEUE
    )
    await bus.client.flush()
    return received


async def admitted_dir(kubelet: KubeletSimulator, dirs: NodeDirs, pod: dict[str, Any]) -> Path:
    result = await kubelet.admit(pod)
    assert result.admitted, result.error
    directory = dirs.container_root / container_key(result.containers[0].device_ids)
    await wait_until((directory / "config" / "limits").exists, what="limit file")
    assert (directory / "state" / "relay.sock").is_socket()
    return directory


def line(**fields: Any) -> bytes:
    return json.dumps({"v": 1, **fields}).encode() + b"\n"


def hello(devices: int = 1) -> bytes:
    return line(
        type="hello",
        pid=7,
        comm="python",
        devices=[
            {"index": i, "uuid": "GPU-claimed-by-hook", "limit_mib": 1, "cores": 1}
            for i in range(devices)
        ],
    )


def usage(used: int, launches: int = 5, index: int = 0) -> bytes:
    return line(
        type="usage",
        pid=7,
        ts_ms=1000,
        devices=[{"index": index, "used_mib": used, "process_used_mib": used}],
        launches=launches,
        throttled_ms=3,
    )


async def connect(directory: Path) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    return await asyncio.open_unix_connection(str(directory / "state" / "relay.sock"))


def rejected(reason: str) -> float:
    labels = {"node": NODE, "reason": reason}
    return REGISTRY.get_sample_value("vgpu_nodeagent_relay_rejected_total", labels) or 0.0


async def closed_by_agent(reader: asyncio.StreamReader) -> bool:
    return await asyncio.wait_for(reader.read(), 5) == b""


async def test_reports_become_container_usage_and_util_flows_back(
    nats_server: EmbeddedNats, inbox: Inbox, dirs: NodeDirs
) -> None:
    async with running_node(nats_server.url, dirs, **FAST) as (kubelet, agent):
        directory = await admitted_dir(kubelet, dirs, gpu_pod("train", {"main": 1}, namespace="ml"))
        gpu = next(g for g in agent.gpus if g.uuid in (directory / "config" / "limits").read_text())
        backend = agent.gpu_backend
        assert isinstance(backend, SimulatedGpuBackend)
        backend.set_usage(gpu.uuid, 80.0, 9000)
        # NVML sees this very process (the hook's peer PID) using the GPU.
        backend.add_process(os.getpid(), gpu.uuid, 2100, 42.0)

        reader, writer = await connect(directory)
        writer.write(hello() + usage(2048, launches=11))
        await writer.drain()
        reports = await wait_until(
            lambda: [
                m
                for m in inbox.where(pod="train")
                if m.devices[0].memory_used_mib == 2048 and m.devices[0].sm_util_percent == 42.0
            ],
            what="ContainerUsage from the hook",
        )
        report = reports[-1]
        assert (report.node, report.namespace, report.container) == (NODE, "ml", "main")
        (device,) = report.devices
        assert (device.uuid, device.index) == (gpu.uuid, gpu.index)  # not the hook's claim
        assert (device.memory_limit_mib, device.cores_limit) == (10240, 30)
        assert (report.processes, report.launches, report.throttled_ms) == (1, 11, 3)

        wanted = [{"index": 0, "sm_util_percent": 80.0, "container_sm_util_percent": 42.0}]
        for _ in range(200):  # util lines come every util_interval_s; the first may predate
            util = json.loads(await asyncio.wait_for(reader.readline(), 5))
            assert util["v"] == 1 and util["type"] == "util"
            if util["devices"] == wanted:
                break
        assert util["devices"] == wanted

        writer.write(line(type="exit", pid=7))
        await writer.drain()
        await wait_until(lambda: inbox.where(pod="train", processes=0), what="exit published")
        writer.close()


async def test_bad_lines_close_only_their_connection_and_are_counted(
    nats_server: EmbeddedNats, inbox: Inbox, dirs: NodeDirs
) -> None:
    async with running_node(nats_server.url, dirs, **FAST) as (kubelet, _):
        directory = await admitted_dir(kubelet, dirs, gpu_pod("bad", {"main": 1}))
        good_reader, good = await connect(directory)
        good.write(hello())
        await good.drain()

        cases = [
            ("malformed", b"this is not json\n"),
            ("malformed", usage(1)),  # usage before hello
            ("malformed", hello() + usage(1, index=3)),  # the container has one device
            ("malformed", hello() + hello()),
            ("malformed", line(type="teleport", pid=1)),
            ("malformed", json.dumps({"v": 2, "type": "exit", "pid": 1}).encode() + b"\n"),
            ("oversized", b'{"v":1,"type":"exit","pid":1,"pad":"' + b"x" * 5000 + b'"}\n'),
            ("oversized", b"y" * (MAX_LINE_BYTES + 10)),  # and never a newline
        ]
        for reason, payload in cases:
            before = rejected(reason)
            reader, writer = await connect(directory)
            writer.write(payload)
            await writer.drain()
            assert await closed_by_agent(reader), payload[:40]
            await wait_until(lambda r=reason, b=before: rejected(r) > b, what=f"{reason} counted")
            writer.close()

        # The well-behaved connection was never disturbed, and the agent still relays.
        good.write(usage(512))
        await good.drain()
        await wait_until(
            lambda: [m for m in inbox.where(pod="bad") if m.devices[0].memory_used_mib == 512],
            what="good connection still relayed",
        )
        assert not good_reader.at_eof()
        good.close()


async def test_a_restarted_agent_serves_existing_directories(
    nats_server: EmbeddedNats, inbox: Inbox, dirs: NodeDirs
) -> None:
    async with running_node(nats_server.url, dirs, **FAST) as (kubelet, _):
        directory = await admitted_dir(kubelet, dirs, gpu_pod("kept", {"main": 1}))
    assert not (
        directory / "state" / "relay.sock"
    ).exists()  # the stopped agent left nothing behind
    async with running_node(nats_server.url, dirs, **FAST) as (_, agent):
        assert (directory / "state" / "relay.sock").is_socket()
        _, writer = await connect(directory)
        writer.write(hello() + usage(300))
        await writer.drain()
        (report, *_) = await wait_until(
            lambda: [m for m in inbox.where(pod="kept") if m.devices[0].memory_used_mib == 300],
            what="usage after restart",
        )
        assert (report.namespace, report.container) == ("default", "main")
        assert agent.relay.container(directory.name) is not None
        writer.close()


class UidClaims(ClaimResponder):
    """Answers with a real-looking pod UID, as the allocator does."""

    def __init__(self, pod_uid: str) -> None:
        super().__init__()
        self.pod_uid = pod_uid

    async def __call__(self, request: ClaimRequest) -> ClaimReply:
        reply = await super().__call__(request)
        reply.pod_uid = self.pod_uid
        return reply


async def test_containers_without_a_hook_are_reported_from_nvml(
    nats_server: EmbeddedNats, bus: Bus, dirs: NodeDirs, tmp_path: Path
) -> None:
    """No relay connection: NVML's process list, mapped through /proc/<pid>/cgroup to the pod
    UID the claim returned, still reports the container."""
    pod_uid = "1f2e3d4c-5b6a-4789-8abc-def012345678"
    proc = tmp_path / "proc"
    for pid, uid in ((4242, pod_uid), (5151, "99999999-5b6a-4789-8abc-def012345678")):
        (proc / str(pid)).mkdir(parents=True)
        (proc / str(pid) / "cgroup").write_text(
            "0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod"
            f"{uid.replace('-', '_')}.slice/cri-containerd-{str(pid) * 16}.scope\n"
        )
    received = Inbox()
    await bus.subscribe(subjects.container_usage(NODE), ContainerUsage, received)
    await bus.serve(
        subjects.ALLOC_CLAIM, ClaimRequest, UidClaims(pod_uid), queue=subjects.ALLOCATOR_QUEUE
    )
    await bus.client.flush()
    async with running_node(nats_server.url, dirs, proc_root=str(proc), **FAST) as (
        kubelet,
        agent,
    ):
        directory = await admitted_dir(kubelet, dirs, gpu_pod("nohook", {"main": 1}))
        gpu = next(
            g.uuid for g in agent.gpus if g.uuid in (directory / "config" / "limits").read_text()
        )
        backend = agent.gpu_backend
        assert isinstance(backend, SimulatedGpuBackend)
        backend.add_process(4242, gpu, 1500, 25.0)
        backend.add_process(5151, gpu, 700, 10.0)  # another pod's process: not ours
        reports = await wait_until(
            lambda: [m for m in received.where(pod="nohook") if m.devices[0].memory_used_mib],
            what="ContainerUsage from NVML",
        )
        (device,) = reports[-1].devices
        assert (device.memory_used_mib, device.sm_util_percent) == (1500, 25.0)
        assert reports[-1].processes == 1


@pytest.mark.parametrize(
    ("raw", "reason", "says"),
    [
        (
            b'{"v":1,"type":"hello","pid":1,"comm":"' + b"c" * 65 + b'","devices":[]}',
            "malformed",
            "comm",
        ),
        (b'{"v":1,"type":"usage","pid":1}', "malformed", "missing required field"),
        (b'{"v":1,"type":"exit","pid":-3}', "malformed", ">= 0"),
        (b'{"v":"1","type":"exit","pid":1}', "malformed", "v"),
        (b"[]", "malformed", "Expected `object`"),
        (b"x" * (MAX_LINE_BYTES + 1), "oversized", "over the 4096-byte limit"),
    ],
)
def test_decode_line_names_the_problem(raw: bytes, reason: str, says: str) -> None:
    with pytest.raises(RelayProtocolError) as caught:
        decode_line(raw)
    assert caught.value.reason == reason
    assert says in str(caught.value)


def test_decode_line_ignores_unknown_fields() -> None:
    message = decode_line(b'{"v":1,"type":"exit","pid":9,"future":{"x":1}}\n')
    assert message.pid == 9


async def test_agent_stop_leaves_no_socket(nats_server: EmbeddedNats, dirs: NodeDirs) -> None:
    agent: NodeAgent
    async with running_node(nats_server.url, dirs, **FAST) as (_, agent):
        assert agent.relay.containers == []
    with pytest.raises(RuntimeError):
        agent.relay  # noqa: B018


async def test_virtual_memory_in_the_limit_file_and_spilled_mib_in_the_usage(
    nats_server: EmbeddedNats, inbox: Inbox, dirs: NodeDirs
) -> None:
    """A node whose memory scaling is above 1 gives every container virtual device memory with
    the node's host bound; what its hooks report as spilled is published apart (never more
    than what they report as used: the hook's figures are bounded by its own)."""
    scaled = {**FAST, "memory_scaling": 1.5, "spill_limit_mib": 4096}
    async with running_node(nats_server.url, dirs, **scaled) as (kubelet, _):
        directory = await admitted_dir(kubelet, dirs, gpu_pod("big", {"main": 1}, namespace="ml"))
        limits = limits_file.parse((directory / "config" / "limits").read_text())
        assert [d.virtual_memory for d in limits.devices] == [True]
        assert limits.spill_limit_mib == 4096
        _, writer = await connect(directory)
        spilled = line(
            type="usage", pid=7, ts_ms=1000, launches=1, throttled_ms=0,
            devices=[{"index": 0, "used_mib": 9000, "process_used_mib": 9000,
                      "spilled_mib": 2500}],
        )  # fmt: skip
        forged = line(
            type="usage", pid=7, ts_ms=1001, launches=1, throttled_ms=0,
            devices=[{"index": 0, "used_mib": 100, "process_used_mib": 100,
                      "spilled_mib": 5000}],
        )  # fmt: skip
        writer.write(hello() + spilled)
        await writer.drain()
        await wait_until(
            lambda: [m for m in inbox.where(pod="big") if m.devices[0].spilled_mib == 2500],
            what="spilled MiB in ContainerUsage",
        )
        writer.write(forged)
        await writer.drain()
        await wait_until(
            lambda: [m for m in inbox.where(pod="big") if m.devices[0].memory_used_mib == 100],
            what="the next report",
        )
        assert inbox.where(pod="big")[-1].devices[0].spilled_mib == 100
        writer.close()


async def test_memory_scaling_1_writes_no_virtual_memory(
    nats_server: EmbeddedNats, inbox: Inbox, dirs: NodeDirs
) -> None:
    async with running_node(nats_server.url, dirs, **FAST, memory_scaling=1.0) as (kubelet, _):
        directory = await admitted_dir(kubelet, dirs, gpu_pod("plain", {"main": 1}))
        text = (directory / "config" / "limits").read_text()
        assert "virtual_memory" not in text and "spill_limit_mib" not in text


async def test_a_cancelled_close_is_cancelled_wherever_the_cancellation_lands(
    nats_server: EmbeddedNats, inbox: Inbox, dirs: NodeDirs
) -> None:
    """The janitor closes a container's relay; agent.stop() cancels the janitor. On Python
    3.11 `asyncio.wait_for` returned the result of an awaitable that had just finished
    instead of raising the cancellation, so the janitor ran on and stop() waited forever
    (the hang of test_dynamic_mig_creates_and_destroys_through_nvml). Cancelled after 0, 1,
    2... loop steps, the close must end cancelled every time."""
    async with running_node(nats_server.url, dirs, **FAST) as (kubelet, agent):
        directory = await admitted_dir(kubelet, dirs, gpu_pod("closing", {"main": 1}))
        container = agent.relay.container(directory.name)
        assert container is not None
        lost, points = [], 0
        for steps in range(20):
            closing = asyncio.create_task(agent.relay.close(container.key))
            for _ in range(steps):
                await asyncio.sleep(0)
            ended = closing.done()  # then every later point comes after the close ended
            if not ended:
                points += 1
                closing.cancel()
                await asyncio.wait({closing})
                if not closing.cancelled():
                    lost.append(steps)
            await agent.relay.open(container)
            if ended:
                break
        assert lost == [], f"cancellations lost after {lost} loop steps"
        assert points >= 1
        assert (directory / "state" / "relay.sock").is_socket()  # open again after all
