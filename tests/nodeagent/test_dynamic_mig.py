"""Dynamic MIG end to end on one node: the REAL allocator places memory requests on a
dynamic-MIG GPU by its geometry, the agent creates the MIG instance through the simulated
NVML before Allocate answers (the container gets `MIG-...`), the inventory carries the new
geometry, and the instance is destroyed once the pod is gone."""

from __future__ import annotations

from typing import Any

from services.allocator.backend import LocalClusterBackend
from services.allocator.service import Allocator
from services.common.embedded_nats import EmbeddedNats
from services.nodeagent.gpus.simulated import SimulatedGpuBackend
from services.nodeagent.service import NodeAgent
from services.simulators.kubelet import KubeletSimulator
from services.simulators.scheduler import SchedulerSimulator
from tests.nodeagent.harness import (
    NODE,
    NodeDirs,
    agent_settings,
    kubelet_settings,
    running_node,
    wait_until,
)


def known_dynamic(allocator: Allocator, gpu_uuid: str) -> bool:
    """The allocator holds the node's inventory with this GPU marked for dynamic MIG."""
    return any(g.uuid == gpu_uuid and g.mig_dynamic for g in allocator.inventory.gpus(NODE) or ())


def memory_pod(name: str, memory_mib: int) -> dict[str, Any]:
    limits = {"nvidia.com/gpu": "1", "nvidia.com/gpumem": str(memory_mib)}
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": "default", "uid": f"uid-{name}"},
        "spec": {
            "schedulerName": "vgpu-scheduler",
            "containers": [{"name": "main", "image": "cuda", "resources": {"limits": limits}}],
        },
    }


async def test_memory_requests_get_mig_instances_made_and_destroyed(
    nats_server: EmbeddedNats, allocator: Allocator, dirs: NodeDirs
) -> None:
    async with running_node(
        nats_server.url,
        dirs,
        simulate="1xA100-40GB",
        mig_dynamic="all",
        # Long enough for the kubelet to list a container after its Allocate (the grace's
        # purpose), short enough for the test.
        container_dir_grace_s=3.0,
        cleanup_interval_s=0.2,
    ) as (kubelet, agent):
        sim = agent.gpu_backend
        assert isinstance(sim, SimulatedGpuBackend)
        gpu = agent.gpus[0]
        assert gpu.mig_mode and gpu.mig_dynamic and gpu.mig_devices == []  # MIG on at start
        await wait_until(
            lambda: known_dynamic(allocator, gpu.uuid),
            what="the allocator knows the dynamic-MIG GPU",
        )
        backend = allocator.backend
        assert isinstance(backend, LocalClusterBackend)
        scheduler = SchedulerSimulator(allocator.url + "/scheduler")
        try:
            admitted = {}
            for name, memory in (("small", 4000), ("mid", 12000)):
                spec = memory_pod(name, memory)
                backend.add_pod(spec)
                result = await scheduler.schedule(spec, [NODE])
                assert result.node == NODE, result.describe()
                admitted[name] = await kubelet.admit(spec)
                assert admitted[name].error == "", admitted[name].error
            # A third pod that would need the slices the others hold is refused by placement.
            refused = memory_pod("big", 20000)
            backend.add_pod(refused)
            assert (await scheduler.schedule(refused, [NODE])).node is None
        finally:
            await scheduler.close()

        made = {d.profile: d for d in sim.mig_devices(gpu.uuid)}
        assert {(p, d.start) for p, d in made.items()} == {("1g.5gb", 6), ("3g.20gb", 0)}
        for name, profile in (("small", "1g.5gb"), ("mid", "3g.20gb")):
            (container,) = admitted[name].containers
            assert container.envs["NVIDIA_VISIBLE_DEVICES"] == made[profile].uuid
        # The geometry travels to the allocator in the inventory.
        await wait_until(
            lambda: len((allocator.inventory.gpus(NODE) or [gpu])[0].mig_devices) == 2,
            what="the inventory showing both instances",
        )
        # The allocator releases a pod (it was deleted): the agent destroys its instance.
        assert await allocator.engine.release("uid-small") is not None
        await wait_until(
            lambda: [d.profile for d in sim.mig_devices(gpu.uuid)] == ["3g.20gb"],
            timeout_s=10,
            what="the 1g.5gb instance destroyed on release",
        )
        # The kubelet forgets a pod: the janitor removes its directory and its instance.
        assert kubelet.remove("default", "mid")
        await wait_until(
            lambda: sim.mig_devices(gpu.uuid) == [],
            timeout_s=20,
            what="the 3g.20gb instance destroyed by the janitor",
        )
        await wait_until(
            lambda: (allocator.inventory.gpus(NODE) or [gpu])[0].mig_devices == [],
            what="the inventory showing no instance",
        )


async def test_allocate_without_a_waiting_placement_fails_admission(
    nats_server: EmbeddedNats, allocator: Allocator, dirs: NodeDirs
) -> None:
    async with running_node(nats_server.url, dirs, simulate="1xA100-40GB", mig_dynamic="0") as (
        kubelet,
        agent,
    ):
        # Admitted without going through the scheduler: nobody planned a MIG instance.
        result = await kubelet.admit(memory_pod("unplanned", 4000))
        assert "no pod bound to node" in result.error
        assert "waits for a MIG instance" in result.error
        sim = agent.gpu_backend
        assert isinstance(sim, SimulatedGpuBackend)
        assert sim.mig_devices(agent.gpus[0].uuid) == []


async def test_a_restarted_agent_still_destroys_what_it_made(
    nats_server: EmbeddedNats, allocator: Allocator, dirs: NodeDirs
) -> None:
    kubelet = KubeletSimulator(kubelet_settings(dirs))
    await kubelet.start()
    settings = agent_settings(nats_server.url, dirs, simulate="1xA100-40GB", mig_dynamic="all")
    sim = SimulatedGpuBackend(NODE, "1xA100-40GB")  # the GPUs outlive the agent
    agent = NodeAgent(settings, gpu_backend=sim)
    try:
        await agent.start()
        await agent.wait_registered(10)
        await kubelet.wait_for_resource("nvidia.com/gpu", timeout=10)
        gpu = agent.gpus[0]
        await wait_until(
            lambda: known_dynamic(allocator, gpu.uuid),
            what="the allocator knows the dynamic-MIG GPU",
        )
        backend = allocator.backend
        assert isinstance(backend, LocalClusterBackend)
        spec = memory_pod("kept", 9000)
        backend.add_pod(spec)
        scheduler = SchedulerSimulator(allocator.url + "/scheduler")
        try:
            assert (await scheduler.schedule(spec, [NODE])).node == NODE
        finally:
            await scheduler.close()
        assert (await kubelet.admit(spec)).error == ""
        (made,) = sim.mig_devices(gpu.uuid)
        assert made.profile == "1g.10gb"
        await agent.stop()
        assert (dirs.state_dir / "dynamic-mig.json").read_bytes().count(made.uuid.encode()) == 1

        agent = NodeAgent(settings, gpu_backend=sim)
        await agent.start()
        await agent.wait_registered(10)
        assert sim.mig_devices(gpu.uuid) == [made]  # a restart destroys nothing by itself
        assert await allocator.engine.release("uid-kept") is not None
        await wait_until(
            lambda: sim.mig_devices(gpu.uuid) == [],
            timeout_s=10,
            what="the instance made before the restart destroyed on release",
        )
    finally:
        await agent.stop()
        await kubelet.stop()
