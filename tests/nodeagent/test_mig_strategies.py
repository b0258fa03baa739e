"""Static MIG through the real device-plugin edge: registration per strategy (none, single,
mixed) with NVIDIA's resource names, MIG UUIDs in Allocate, per-MIG-device health and
ListAndWatch following geometry changes, all as the kubelet (simulator) sees them."""

from __future__ import annotations

from typing import Any

import grpc
import pytest

from services.common.embedded_nats import EmbeddedNats
from services.common.kubelet import deviceplugin_v1beta1_pb2 as pb
from services.common.kubelet import deviceplugin_v1beta1_pb2_grpc as pb_grpc
from services.nodeagent.gpus.simulated import SimulatedGpuBackend
from services.nodeagent.labels import MemoryNodeLabeler
from services.nodeagent.mig_plugin import distributed_pick, mig_socket_name
from services.nodeagent.mig_resources import MigStrategyError
from services.nodeagent.service import NodeAgent
from tests.nodeagent.harness import NodeDirs, agent_settings, running_node, wait_until

MIXED_GEOMETRY = "0:3g.20gb,2x2g.10gb;1:7x1g.5gb"
A100_40GB_RESOURCES = {
    "nvidia.com/mig-1g.5gb",
    "nvidia.com/mig-1g.5gb.me",
    "nvidia.com/mig-1g.10gb",
    "nvidia.com/mig-2g.10gb",
    "nvidia.com/mig-3g.20gb",
    "nvidia.com/mig-4g.20gb",
    "nvidia.com/mig-7g.40gb",
}


def mig_pod(name: str, resource: str, count: int) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": "default", "uid": f"uid-{name}"},
        "spec": {
            "containers": [
                {
                    "name": "main",
                    "image": "cuda:12",
                    "resources": {"limits": {resource: str(count)}},
                }
            ]
        },
    }


mig_node = running_node  # every MIG resource listed by the kubelet


def backend_of(agent: NodeAgent) -> SimulatedGpuBackend:
    backend = agent.gpu_backend
    assert isinstance(backend, SimulatedGpuBackend)
    return backend


async def test_mixed_strategy_registers_nvidias_names_and_hands_out_mig_uuids(
    nats_server: EmbeddedNats, dirs: NodeDirs
) -> None:
    async with mig_node(
        nats_server.url,
        dirs,
        simulate="2xA100-40GB,1xT4",
        simulate_mig=MIXED_GEOMETRY,
        mig_strategy="mixed",
    ) as (kubelet, agent):
        assert set(kubelet.resources()) == {"nvidia.com/gpu", *A100_40GB_RESOURCES}
        assert (dirs.plugin_dir / mig_socket_name("nvidia.com/mig-1g.5gb")).is_socket()
        gpus = agent.gpus
        # Only the T4 (MIG off) keeps vgpu's sliced resource; the MIG GPUs are not exposed whole.
        assert {d.split("::")[0] for d in kubelet.devices("nvidia.com/gpu")} == {gpus[2].uuid}
        counts = {r: len(kubelet.devices(r)) for r in A100_40GB_RESOURCES}
        assert counts == {
            "nvidia.com/mig-1g.5gb": 7,
            "nvidia.com/mig-1g.5gb.me": 0,
            "nvidia.com/mig-1g.10gb": 0,
            "nvidia.com/mig-2g.10gb": 2,
            "nvidia.com/mig-3g.20gb": 1,
            "nvidia.com/mig-4g.20gb": 0,
            "nvidia.com/mig-7g.40gb": 0,
        }
        ones = {m.uuid for m in gpus[1].mig_devices}
        assert set(kubelet.devices("nvidia.com/mig-1g.5gb")) == ones
        labeler = agent.labeler
        assert isinstance(labeler, MemoryNodeLabeler)
        assert labeler.labels["nvidia.com/mig.strategy"] == "mixed"
        assert labeler.labels["nvidia.com/mig-1g.5gb.count"] == "7"
        assert labeler.labels["nvidia.com/mig-2g.10gb.memory"] == "9856"
        assert labeler.labels["nvidia.com/mig-3g.20gb.multiprocessors"] == str(108 * 3 // 7)
        assert "nvidia.com/mig-7g.40gb.count" not in labeler.labels

        admitted = await kubelet.admit(mig_pod("two-small", "nvidia.com/mig-1g.5gb", 2))
        assert admitted.error == ""
        (container,) = admitted.containers
        visible = container.envs["NVIDIA_VISIBLE_DEVICES"].split(",")
        assert set(visible) == set(container.device_ids) and set(visible) <= ones
        assert all(v.startswith("MIG-") for v in visible) and len(visible) == 2
        assert container.mounts == []  # hardware isolation: no hook, no limit file

        big = await kubelet.admit(mig_pod("big", "nvidia.com/mig-3g.20gb", 2))
        assert "Requested: 2, Available: 1" in big.error
        none_left = await kubelet.admit(mig_pod("whole", "nvidia.com/mig-7g.40gb", 1))
        assert "Available: 0" in none_left.error


async def test_mixed_list_and_watch_follows_geometry_and_per_device_health(
    nats_server: EmbeddedNats, dirs: NodeDirs
) -> None:
    async with mig_node(
        nats_server.url,
        dirs,
        simulate="2xA100-40GB",
        simulate_mig=MIXED_GEOMETRY,
        mig_strategy="mixed",
    ) as (kubelet, agent):
        backend = backend_of(agent)
        gpu0 = agent.gpus[0]
        two_g = next(m for m in gpu0.mig_devices if m.profile == "2g.10gb")
        # Repartition: one 2g.10gb becomes two 1g.5gb (slices 0-1 or 2-3).
        backend.destroy_compute_instance(gpu0.uuid, two_g.gi_id, two_g.ci_id)
        backend.destroy_gpu_instance(gpu0.uuid, two_g.gi_id)
        for start in (two_g.start, two_g.start + 1):
            gi = backend.create_gpu_instance(gpu0.uuid, "1g.5gb", start)
            backend.create_compute_instance(gpu0.uuid, gi)
        assert await agent.refresh_devices()
        await wait_until(
            lambda: len(kubelet.devices("nvidia.com/mig-1g.5gb")) == 9, what="new 1g.5gb devices"
        )
        assert len(kubelet.devices("nvidia.com/mig-2g.10gb")) == 1
        assert two_g.uuid not in kubelet.devices("nvidia.com/mig-2g.10gb")

        # An XID on one MIG device makes that device alone unhealthy.
        sick = agent.gpus[1].mig_devices[3].uuid
        backend.inject_xid(sick, 79)
        await wait_until(
            lambda: kubelet.devices("nvidia.com/mig-1g.5gb")[sick] == "Unhealthy",
            what="the MIG device unhealthy",
        )
        health = kubelet.devices("nvidia.com/mig-1g.5gb")
        assert sorted(health.values()).count("Unhealthy") == 1
        # The sick device is never handed out: 8 healthy 1g.5gb remain.
        admitted = await kubelet.admit(mig_pod("eight", "nvidia.com/mig-1g.5gb", 8))
        assert admitted.error == "" and sick not in admitted.containers[0].device_ids
        # A whole GPU lost takes its MIG devices with it.
        backend.remove_gpu(gpu0.uuid)
        await agent.refresh_devices()
        await wait_until(
            lambda: (
                kubelet.devices("nvidia.com/mig-3g.20gb")
                and set(kubelet.devices("nvidia.com/mig-3g.20gb").values()) == {"Unhealthy"}
            ),
            what="the lost GPU's MIG devices unhealthy",
        )


async def test_single_strategy_serves_mig_devices_as_nvidia_com_gpu(
    nats_server: EmbeddedNats, dirs: NodeDirs
) -> None:
    async with mig_node(
        nats_server.url,
        dirs,
        simulate="2xA100-40GB",
        simulate_mig="all:7x1g.5gb",
        mig_strategy="single",
        device_list_strategy="cdi-cri",
    ) as (kubelet, agent):
        assert set(kubelet.resources()) == {"nvidia.com/gpu"}
        devices = kubelet.devices("nvidia.com/gpu")
        assert len(devices) == 14 and all(d.startswith("MIG-") for d in devices)
        labeler = agent.labeler
        assert isinstance(labeler, MemoryNodeLabeler)
        assert labeler.labels["nvidia.com/gpu.product"] == "A100-40GB-MIG-1g.5gb"
        assert labeler.labels["nvidia.com/gpu.count"] == "14"
        admitted = await kubelet.admit(mig_pod("one", "nvidia.com/gpu", 1))
        assert admitted.error == ""
        (container,) = admitted.containers
        (device,) = container.device_ids
        assert container.cdi_devices == [f"nvidia.com/gpu={device}"]
        assert container.envs == {}


@pytest.mark.parametrize(
    ("simulate", "geometry", "message"),
    [
        ("2xA100-40GB", "0:7x1g.5gb", "same migEnabled value; GPU\\(s\\) \\[1\\] have MIG off"),
        ("1xA100-40GB", "all:", "GPU\\(s\\) \\[0\\] have no MIG devices"),
        ("1xA100-40GB", "all:1g.5gb,2g.10gb", "more than one MIG device type .*1g.5gb, 2g.10gb"),
    ],
)
async def test_single_strategy_refuses_what_nvidia_refuses(
    nats_server: EmbeddedNats, dirs: NodeDirs, simulate: str, geometry: str, message: str
) -> None:
    agent = NodeAgent(
        agent_settings(
            nats_server.url,
            dirs,
            simulate=simulate,
            simulate_mig=geometry,
            mig_strategy="single",
        )
    )
    with pytest.raises(MigStrategyError, match=message):
        await agent.start()
    await agent.stop()


async def test_none_strategy_exposes_mig_gpus_whole(
    nats_server: EmbeddedNats, dirs: NodeDirs
) -> None:
    async with mig_node(
        nats_server.url, dirs, simulate="2xA100-40GB", simulate_mig="0:7x1g.5gb"
    ) as (kubelet, agent):
        assert set(kubelet.resources()) == {"nvidia.com/gpu"}
        parents = {d.split("::")[0] for d in kubelet.devices("nvidia.com/gpu")}
        assert parents == {gpu.uuid for gpu in agent.gpus}


async def test_allocate_refuses_unknown_mig_devices(
    nats_server: EmbeddedNats, dirs: NodeDirs
) -> None:
    async with mig_node(
        nats_server.url,
        dirs,
        simulate="1xA100-40GB",
        simulate_mig="all:2x3g.20gb",
        mig_strategy="mixed",
    ) as (_kubelet, agent):
        socket = dirs.plugin_dir / mig_socket_name("nvidia.com/mig-3g.20gb")
        async with grpc.aio.insecure_channel(f"unix://{socket}") as channel:
            stub = pb_grpc.DevicePluginStub(channel)
            one_g = "MIG-11111111-2222-3333-4444-555555555555"
            request = pb.AllocateRequest(
                container_requests=[pb.ContainerAllocateRequest(devices_ids=[one_g])]
            )
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await stub.Allocate(request)
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "unknown MIG device" in (refused.value.details() or "")
            good = [m.uuid for m in agent.gpus[0].mig_devices]
            answer = await stub.Allocate(
                pb.AllocateRequest(
                    container_requests=[pb.ContainerAllocateRequest(devices_ids=good)]
                )
            )
            assert answer.container_responses[0].envs["NVIDIA_VISIBLE_DEVICES"] == ",".join(good)


def test_distributed_pick_prefers_the_least_taken_gpu() -> None:
    parent_of = {"a1": "A", "a2": "A", "a3": "A", "b1": "B", "b2": "B"}
    # a1 is taken (not offered): B is less used, so b1 comes first, then a2.
    assert distributed_pick(["a2", "a3", "b1", "b2"], [], 2, parent_of) == ["b1", "a2"]
    assert distributed_pick(["a2", "a3", "b1", "b2"], ["a3"], 2, parent_of) == ["a3", "b1"]
