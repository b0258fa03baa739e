"""Registration, re-registration after a kubelet restart, XID health and failOnInitError,
over real gRPC with the kubelet simulator."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.common import subjects
from services.common.bus import Bus
from services.common.embedded_nats import EmbeddedNats
from services.common.schemas import NodeInventory
from services.nodeagent.gpus import NvmlGpuBackend, NvmlInitError, SimulatedGpuBackend
from services.nodeagent.labels import MemoryNodeLabeler
from services.nodeagent.service import NodeAgent
from services.simulators.kubelet import KubeletSimulator
from tests.nodeagent.fake_nvml import FakeGpu, FakeNvml
from tests.nodeagent.harness import (
    RESOURCE,
    NodeDirs,
    agent_settings,
    gpu_pod,
    kubelet_settings,
    running_node,
    wait_until,
)

FAST = {"kubelet_watch_interval_s": 0.05, "usage_interval_s": 0.1}


def health(kubelet: KubeletSimulator, gpu_uuid: str) -> set[str]:
    return {h for d, h in kubelet.devices(RESOURCE).items() if d.startswith(gpu_uuid + "::")}


async def test_registers_again_after_a_kubelet_restart(
    nats_server: EmbeddedNats, dirs: NodeDirs
) -> None:
    async with running_node(nats_server.url, dirs, **FAST) as (kubelet, agent):
        assert agent.registrations == 1
        assert len(kubelet.devices(RESOURCE)) == 20

        await kubelet.restart()  # wipes the plugin directory, re-creates kubelet.sock
        assert kubelet.devices(RESOURCE) == {}
        await kubelet.wait_for_resource(RESOURCE, timeout=10)
        assert agent.registrations == 2
        assert len(kubelet.devices(RESOURCE)) == 20
        assert agent.socket_path.is_socket()  # served anew after the wipe

        # The re-registered plugin serves admissions.
        result = await kubelet.admit(gpu_pod("after-restart", {"main": 1}))
        assert result.admitted, result.error
        assert result.containers[0].envs["NVIDIA_VISIBLE_DEVICES"].startswith("GPU-")


async def test_serves_and_registers_again_when_its_socket_is_removed(
    nats_server: EmbeddedNats, dirs: NodeDirs
) -> None:
    async with running_node(nats_server.url, dirs, **FAST) as (kubelet, agent):
        agent.socket_path.unlink()
        await wait_until(lambda: agent.registrations == 2, what="second registration")
        assert agent.socket_path.is_socket()
        await kubelet.wait_for_resource(RESOURCE, timeout=10)
        result = await kubelet.admit(gpu_pod("again", {"main": 1}))
        assert result.admitted, result.error


async def test_registration_waits_for_a_kubelet_that_starts_late(
    nats_server: EmbeddedNats, dirs: NodeDirs
) -> None:
    agent = NodeAgent(agent_settings(nats_server.url, dirs, **FAST))
    await agent.start()
    kubelet = KubeletSimulator(kubelet_settings(dirs))
    try:
        assert agent.registrations == 0
        await kubelet.start()
        await agent.wait_registered(10)
        assert sorted(await kubelet.wait_for_resource(RESOURCE, timeout=10))
    finally:
        await agent.stop()
        await kubelet.stop()


async def test_xid_marks_the_gpu_unhealthy_everywhere(
    nats_server: EmbeddedNats, bus: Bus, dirs: NodeDirs
) -> None:
    inventories: list[NodeInventory] = []

    async def on_inventory(message: NodeInventory) -> None:
        inventories.append(message)

    await bus.subscribe(subjects.inventory("node-a"), NodeInventory, on_inventory)
    await bus.client.flush()
    async with running_node(nats_server.url, dirs, **FAST) as (kubelet, agent):
        backend = agent.gpu_backend
        assert isinstance(backend, SimulatedGpuBackend)
        a, b = (gpu.uuid for gpu in agent.gpus)
        backend.inject_xid(b, 13)  # an application fault: ignored by default
        backend.inject_xid(b, 79)  # fallen off the bus: critical
        await wait_until(lambda: health(kubelet, b) == {"Unhealthy"}, what="ListAndWatch update")
        assert health(kubelet, a) == {"Healthy"}
        await wait_until(
            lambda: any(not i.gpus[1].healthy for i in inventories), what="inventory change"
        )
        assert all(i.gpus[0].healthy for i in inventories)
        # An unhealthy GPU's IDs are never handed out.
        result = await kubelet.admit(gpu_pod("after-xid", {"main": 2}))
        assert result.admitted, result.error
        assert set(result.containers[0].envs["NVIDIA_VISIBLE_DEVICES"].split(",")) == {a}


async def test_ignored_xids_are_configurable(nats_server: EmbeddedNats, dirs: NodeDirs) -> None:
    async with running_node(nats_server.url, dirs, ignored_xids="79", **FAST) as (kubelet, agent):
        backend = agent.gpu_backend
        assert isinstance(backend, SimulatedGpuBackend)
        a, b = (gpu.uuid for gpu in agent.gpus)
        backend.inject_xid(b, 79)
        backend.inject_xid(a, 13)  # no longer in the ignored list
        await wait_until(lambda: health(kubelet, a) == {"Unhealthy"}, what="GPU a unhealthy")
        assert health(kubelet, b) == {"Healthy"}


async def test_nvml_backend_xid_and_lost_gpu_reach_list_and_watch(
    nats_server: EmbeddedNats, dirs: NodeDirs, tmp_path: Path
) -> None:
    """The production NVML code path, on a simulated NVML, all the way to the kubelet."""
    gpus = [
        FakeGpu("GPU-11111111-0000-0000-0000-000000000000", bus_id="00000000:07:00.0"),
        FakeGpu("GPU-22222222-0000-0000-0000-000000000000", bus_id="00000000:0F:00.0"),
        FakeGpu("GPU-33333333-0000-0000-0000-000000000000", bus_id="00000000:8A:00.0"),
    ]
    nvml = FakeNvml(gpus)
    backend = NvmlGpuBackend(nvml, tmp_path)
    backend.open()
    kubelet = KubeletSimulator(kubelet_settings(dirs))
    await kubelet.start()
    labeler = MemoryNodeLabeler()
    agent = NodeAgent(
        agent_settings(nats_server.url, dirs, simulate="", **FAST),
        gpu_backend=backend,
        labeler=labeler,
    )
    try:
        await agent.start()
        await kubelet.wait_for_resource(RESOURCE, timeout=10)
        assert len(kubelet.devices(RESOURCE)) == 30
        assert labeler.labels["nvidia.com/gpu.product"] == "NVIDIA-A100-SXM4-40GB"
        assert labeler.labels["nvidia.com/gpu.count"] == "3"
        assert labeler.labels["nvidia.com/cuda.driver-version.full"] == "550.54.15"

        nvml.xid(gpus[0], 48)  # double-bit ECC error
        await wait_until(lambda: health(kubelet, gpus[0].uuid) == {"Unhealthy"}, what="XID")
        gpus[2].lost = True
        await wait_until(lambda: health(kubelet, gpus[2].uuid) == {"Unhealthy"}, what="lost")
        assert health(kubelet, gpus[1].uuid) == {"Healthy"}
        await agent.stop()
        assert not nvml.initialised  # NVML shut down with the agent
    finally:
        await agent.stop()
        await kubelet.stop()


async def test_fail_on_init_error(nats_server: EmbeddedNats, dirs: NodeDirs) -> None:
    """No NVML on this machine: the default is a clear error; opting out serves nothing
    (tests/nodeagent/test_paradigm_flags.py: registered with the kubelet, on the bus)."""
    failing = NodeAgent(agent_settings(nats_server.url, dirs, simulate=""))
    with pytest.raises(NvmlInitError, match=r"cannot start NVML.*fail_on_init_error=false"):
        await failing.start()
    assert not failing.socket_path.exists()

    idle = NodeAgent(agent_settings(nats_server.url, dirs, simulate="", fail_on_init_error=False))
    await idle.start()
    try:
        assert idle.idle_reason.startswith("NVML unavailable")
        assert idle.gpus == []
        assert idle.socket_path.is_socket()  # a device plugin with no devices
    finally:
        await idle.stop()
        await idle.stop()
