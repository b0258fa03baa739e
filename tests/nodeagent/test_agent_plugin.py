"""The node agent's device plugin over its real unix socket, and its NATS publications."""

from __future__ import annotations

import asyncio
import stat
import struct
import time
from collections.abc import AsyncIterator

import grpc
import pytest
from prometheus_client import REGISTRY

from services.common import subjects
from services.common.bus import Bus, ReplyError
from services.common.embedded_nats import EmbeddedNats
from services.common.kubelet import deviceplugin_v1beta1_pb2 as pb
from services.common.kubelet import deviceplugin_v1beta1_pb2_grpc as pb_grpc
from services.common.schemas import NodeInventory, NodeUsage, PreferredReply, PreferredRequest
from services.nodeagent.grant import container_key
from services.nodeagent.service import NodeAgent
from services.nodeagent.settings import NodeAgentSettings
from tests.nodeagent.harness import NODE, NodeDirs, agent_settings, wait_until


@pytest.fixture
async def agent(nats_server: EmbeddedNats, dirs: NodeDirs) -> AsyncIterator[NodeAgent]:
    """An agent with no kubelet around: its plugin socket is served, registration retries."""
    started = NodeAgent(agent_settings(nats_server.url, dirs, resolve_timeout_s=0.3))
    await started.start()
    yield started
    await started.stop()


@pytest.fixture
async def plugin(agent: NodeAgent) -> AsyncIterator[pb_grpc.DevicePluginStub]:
    async with grpc.aio.insecure_channel(f"unix://{agent.socket_path}") as channel:
        yield pb_grpc.DevicePluginStub(channel)


def gpu_uuids(agent: NodeAgent) -> list[str]:
    return [gpu.uuid for gpu in agent.gpus]


async def test_options(plugin: pb_grpc.DevicePluginStub) -> None:
    options = await plugin.GetDevicePluginOptions(pb.Empty(), timeout=5)
    assert options.get_preferred_allocation_available is True
    assert options.pre_start_required is False
    assert await plugin.PreStartContainer(pb.PreStartContainerRequest(devices_ids=["x"])) == (
        pb.PreStartContainerResponse()
    )


async def test_list_and_watch_resends_on_health_change_and_ends_on_stop(
    agent: NodeAgent, plugin: pb_grpc.DevicePluginStub
) -> None:
    a, b = gpu_uuids(agent)
    stream = plugin.ListAndWatch(pb.Empty())
    first = await asyncio.wait_for(stream.read(), 5)
    assert [d.ID for d in first.devices] == [f"{u}::{n}" for u in (a, b) for n in range(10)]
    assert {d.health for d in first.devices} == {"Healthy"}
    assert [d.topology.nodes[0].ID for d in first.devices] == [0] * 10 + [1] * 10

    agent.gpu_backend.set_healthy(b, False)  # type: ignore[attr-defined]
    second = await asyncio.wait_for(stream.read(), 5)
    health = {d.ID: d.health for d in second.devices}
    assert {health[f"{b}::{n}"] for n in range(10)} == {"Unhealthy"}
    assert {health[f"{a}::{n}"] for n in range(10)} == {"Healthy"}

    await agent.stop()
    assert await asyncio.wait_for(stream.read(), 5) is grpc.aio.EOF
    assert await stream.code() == grpc.StatusCode.OK
    assert not agent.socket_path.exists()
    await agent.stop()  # idempotent


async def test_inventory_on_start_on_change_and_as_heartbeat(
    nats_server: EmbeddedNats, bus: Bus, dirs: NodeDirs
) -> None:
    inventories: list[NodeInventory] = []
    usages: list[NodeUsage] = []

    async def on_inventory(message: NodeInventory) -> None:
        inventories.append(message)

    async def on_usage(message: NodeUsage) -> None:
        usages.append(message)

    await bus.subscribe(subjects.inventory(NODE), NodeInventory, on_inventory)
    await bus.subscribe(subjects.usage(NODE), NodeUsage, on_usage)
    await bus.client.flush()
    agent = NodeAgent(agent_settings(nats_server.url, dirs, heartbeat_s=0.3))
    await agent.start()
    try:
        await wait_until(lambda: len(inventories) >= 1, what="inventory on start")
        started = time.monotonic()
        await wait_until(lambda: len(inventories) >= 3, what="two heartbeats")
        assert time.monotonic() - started >= 0.45  # paced by heartbeat_s, not a flood
        first = inventories[0]
        assert first.node == NODE and first.heartbeat_s == 0.3 and first.agent_version
        assert [g.model for g in first.gpus] == ["A100-40GB", "A100-40GB"]
        assert [g.memory_mib for g in first.gpus] == [40960, 40960]
        assert [g.numa_node for g in first.gpus] == [0, 1]
        seqs = [i.seq for i in inventories]
        assert seqs == sorted(set(seqs)) and seqs[0] == 1

        count = len(inventories)
        agent.gpu_backend.set_healthy(first.gpus[0].uuid, False)  # type: ignore[attr-defined]
        changed = await wait_until(
            lambda: [i for i in inventories[count:] if not i.gpus[0].healthy], what="change"
        )
        assert changed[0].seq > inventories[count - 1].seq

        await wait_until(lambda: len(usages) >= 2, what="usage")
        assert usages[-1].node == NODE
        assert [u.uuid for u in usages[-1].gpus] == [g.uuid for g in first.gpus]
        # Nothing runs on this node: simulated GPUs say so rather than invent load.
        assert all((u.memory_used_mib, u.sm_util_percent) == (0, 0.0) for u in usages[-1].gpus)
    finally:
        await agent.stop()


async def test_allocate_response_and_container_directory(
    agent: NodeAgent, plugin: pb_grpc.DevicePluginStub, dirs: NodeDirs
) -> None:
    a, b = gpu_uuids(agent)
    ids = [f"{b}::4", f"{a}::0", f"{b}::1"]
    response = await plugin.Allocate(
        pb.AllocateRequest(container_requests=[pb.ContainerAllocateRequest(devices_ids=ids)]),
        timeout=5,
    )
    (answer,) = response.container_responses
    # No VGPU_* variable: inside a container the hook reads only its read-only mount.
    assert dict(answer.envs) == {"NVIDIA_VISIBLE_DEVICES": f"{b},{a}"}
    host_dir = dirs.container_root / container_key(ids)
    assert [(m.container_path, m.host_path, m.read_only) for m in answer.mounts] == [
        ("/var/run/vgpu", str(host_dir / "config"), True),
        ("/var/run/vgpu-state", str(host_dir / "state"), False),
    ]
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in (host_dir, *host_dir.iterdir())}
    assert modes == {host_dir.name: 0o700, "config": 0o755, "state": 0o1777}
    assert (host_dir / "config" / "hook.conf").read_text().splitlines()[1:] == [
        "version=1",
        "limit_wait_ms=300",  # as long as the agent tries to resolve (resolve_timeout_s)
        "compute_policy=share",
    ]
    region = host_dir / "state" / "hook.region"
    assert region.read_bytes() == struct.pack("<QII", 0x3147455255504756, 0, 0)
    assert stat.S_IMODE(region.stat().st_mode) == 0o666
    assert not (host_dir / "config" / "limits").exists()  # the resolver writes it
    assert container_key(ids) == container_key(list(reversed(ids)))
    assert len(container_key(ids)) == 16


async def test_allocate_mounts_the_hook_when_installed(
    agent: NodeAgent, plugin: pb_grpc.DevicePluginStub, dirs: NodeDirs
) -> None:
    dirs.hook_library.parent.mkdir(parents=True)
    dirs.hook_library.write_bytes(b"\x7fELF")
    device_id = f"{gpu_uuids(agent)[0]}::2"
    response = await plugin.Allocate(
        pb.AllocateRequest(
            container_requests=[pb.ContainerAllocateRequest(devices_ids=[device_id])]
        ),
        timeout=5,
    )
    mounts = [
        (m.container_path, m.host_path, m.read_only) for m in response.container_responses[0].mounts
    ]
    preload = dirs.container_root / "ld.so.preload"
    host_dir = dirs.container_root / container_key([device_id])
    assert mounts == [
        ("/var/run/vgpu", str(host_dir / "config"), True),
        ("/var/run/vgpu-state", str(host_dir / "state"), False),
        ("/usr/local/vgpu/libvgpu.so", str(dirs.hook_library), True),
        ("/etc/ld.so.preload", str(preload), True),
    ]
    assert preload.read_text() == "/usr/local/vgpu/libvgpu.so\n"


@pytest.mark.parametrize(
    ("ids", "message"),
    [
        (["GPU-nothere::0"], "unknown device ID 'GPU-nothere::0'"),
        (["not-an-id"], "bad device ID 'not-an-id'"),
        ([], "names no device IDs"),
    ],
)
async def test_allocate_refuses_unknown_ids(
    plugin: pb_grpc.DevicePluginStub, dirs: NodeDirs, ids: list[str], message: str
) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await plugin.Allocate(
            pb.AllocateRequest(container_requests=[pb.ContainerAllocateRequest(devices_ids=ids)]),
            timeout=5,
        )
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert message in (caught.value.details() or "")
    assert not dirs.container_root.exists() or not any(dirs.container_root.iterdir())


async def test_unresolved_allocation_is_counted_and_writes_no_limits(
    agent: NodeAgent, plugin: pb_grpc.DevicePluginStub, dirs: NodeDirs
) -> None:
    labels = {"node": NODE, "reason": "no_container"}
    before = REGISTRY.get_sample_value("vgpu_nodeagent_resolve_failures_total", labels) or 0.0
    device_id = f"{gpu_uuids(agent)[1]}::9"
    await plugin.Allocate(
        pb.AllocateRequest(
            container_requests=[pb.ContainerAllocateRequest(devices_ids=[device_id])]
        ),
        timeout=5,
    )
    # No kubelet answers PodResources here: after resolve_timeout_s the agent gives up.
    await wait_until(
        lambda: (
            (REGISTRY.get_sample_value("vgpu_nodeagent_resolve_failures_total", labels) or 0)
            > before
        ),
        what="resolve failure counted",
    )
    assert not (dirs.container_root / container_key([device_id]) / "config" / "limits").exists()


def preferred_request(
    available: list[str], size: int, must: list[str] | None = None
) -> pb.PreferredAllocationRequest:
    return pb.PreferredAllocationRequest(
        container_requests=[
            pb.ContainerPreferredAllocationRequest(
                available_deviceIDs=available,
                must_include_deviceIDs=must or [],
                allocation_size=size,
            )
        ]
    )


async def test_preferred_allocation_follows_the_allocator_hint(
    agent: NodeAgent, plugin: pb_grpc.DevicePluginStub, bus: Bus
) -> None:
    a, b = gpu_uuids(agent)
    asked: list[PreferredRequest] = []

    async def hint(request: PreferredRequest) -> PreferredReply:
        asked.append(request)
        return PreferredReply(gpu_uuids=[b])

    await bus.serve(
        subjects.ALLOC_PREFERRED, PreferredRequest, hint, queue=subjects.ALLOCATOR_QUEUE
    )
    await bus.client.flush()
    available = [f"{b}::3", f"{a}::0", f"{b}::2", f"{a}::1"]
    response = await plugin.GetPreferredAllocation(preferred_request(available, 1), timeout=5)
    assert list(response.container_responses[0].deviceIDs) == [f"{b}::2"]
    assert asked == [PreferredRequest(node=NODE, available_gpus=[a, b], size=1)]


async def test_preferred_allocation_falls_back_when_nobody_answers(
    plugin: pb_grpc.DevicePluginStub, agent: NodeAgent
) -> None:
    a, b = gpu_uuids(agent)
    available = [f"{a}::0", f"{a}::1", f"{b}::5"]
    started = time.monotonic()
    response = await plugin.GetPreferredAllocation(preferred_request(available, 2), timeout=5)
    assert time.monotonic() - started < 1.5
    assert list(response.container_responses[0].deviceIDs) == [f"{a}::0", f"{b}::5"]


async def test_preferred_allocation_falls_back_on_refusal_or_unusable_hint(
    agent: NodeAgent, plugin: pb_grpc.DevicePluginStub, bus: Bus
) -> None:
    a, b = gpu_uuids(agent)
    replies = iter([ReplyError("allocator is confused"), PreferredReply(gpu_uuids=[b])])

    async def hint(request: PreferredRequest) -> PreferredReply:
        reply = next(replies)
        if isinstance(reply, Exception):
            raise reply
        return reply

    await bus.serve(subjects.ALLOC_PREFERRED, PreferredRequest, hint)
    await bus.client.flush()
    available = [f"{a}::0", f"{a}::1"]
    for _ in range(2):  # refused, then a hint naming a GPU with no available ID
        response = await plugin.GetPreferredAllocation(preferred_request(available, 1), timeout=5)
        assert list(response.container_responses[0].deviceIDs) == [f"{a}::0"]


def test_settings_are_checked_before_anything_starts() -> None:
    with pytest.raises(ValueError, match="device_list_strategy must be one of"):
        NodeAgent(NodeAgentSettings(node_name="n", device_list_strategy="cdi"))
    with pytest.raises(ValueError, match="node_labeler must be none, memory or kubernetes"):
        NodeAgent(NodeAgentSettings(node_name="n", node_labeler="k8s"))
    with pytest.raises(ValueError, match="ignored_xids: 'x13' is not an XID number"):
        NodeAgent(NodeAgentSettings(node_name="n", ignored_xids="x13"))
    with pytest.raises(ValueError, match="context_overhead: 'A100=big'"):
        NodeAgent(NodeAgentSettings(node_name="n", context_overhead="A100=big"))
    with pytest.raises(ValueError, match="cannot be used in a NATS subject"):
        NodeAgent(NodeAgentSettings(node_name="bad name", simulate="1xT4"))
    with pytest.raises(ValueError, match="split_count must be at least 1"):
        NodeAgent(NodeAgentSettings(node_name="n", simulate="1xT4", split_count=0))
    with pytest.raises(ValueError, match="socket_name must be a plain file name"):
        NodeAgent(NodeAgentSettings(node_name="n", simulate="1xT4", socket_name="a/b.sock"))
    with pytest.raises(ValueError, match="unknown model"):
        NodeAgent(NodeAgentSettings(node_name="n", simulate="1xNOPE"))
