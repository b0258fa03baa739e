"""MIG on a real GPU through the production NVML backend. Skips without a MIG-capable GPU in
MIG mode.

Read-only checks (always, on a GPU in MIG mode): NVML's GPU-instance profiles agree with
vgpu's tables (services/common/mig.py: names, IDs, compute slices, max counts, placements, and
no profile smaller than the table says, so a fit in the table fits the card), and the MIG
devices the backend lists are those `nvidia-smi -L` lists.

Tests that change the GPU's partitioning (they make one instance where there is room and
remove it again, leaving what was there) run only when asked:

    VGPU_GPU_TEST_MIG_WRITE=1 .venv/bin/python -m pytest -q -s tests/gpu/test_nvml_mig_gpu.py

They need root (NVML's MIG calls do) and a MIG-mode GPU with a free memory slice and no
workload of its own on the instance made. To put a GPU in MIG mode first: `sudo nvidia-smi
-i <index> -mig 1` (and a GPU reset where the driver asks for one).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from collections.abc import Iterator
from typing import Any

import pytest

from services.allocator import Allocator, AllocatorSettings, LocalClusterBackend
from services.common import mig
from services.common.embedded_nats import EmbeddedNats
from services.common.schemas import GpuDevice
from services.nodeagent.gpus import NvmlGpuBackend, NvmlInitError
from services.nodeagent.gpus.nvml_mig import NvmlMig
from services.nodeagent.service import NodeAgent
from services.simulators.kubelet import KubeletSimulator
from services.simulators.scheduler import SchedulerSimulator
from tests.nodeagent.harness import (
    NODE,
    agent_settings,
    kubelet_settings,
    node_dirs,
    wait_until,
)

pynvml = pytest.importorskip("pynvml")
WRITE = os.environ.get("VGPU_GPU_TEST_MIG_WRITE") == "1"
needs_write = pytest.mark.skipif(
    not WRITE, reason="changes MIG partitioning: set VGPU_GPU_TEST_MIG_WRITE=1 to run"
)


@pytest.fixture(scope="module")
def backend() -> Iterator[NvmlGpuBackend]:
    opened = NvmlGpuBackend(pynvml)
    try:
        opened.open()
    except NvmlInitError as exc:
        pytest.skip(f"no usable GPU here: {exc}")
    yield opened
    opened.close()


@pytest.fixture(scope="module")
def mig_gpu(backend: NvmlGpuBackend) -> GpuDevice:
    """The first GPU in MIG mode whose model vgpu has a profile table for."""
    devices = backend.devices()
    for device in devices:
        if device.mig_mode and mig.mig_capable(device.model):
            return device
    seen = ", ".join(f"{d.index}: {d.model} (MIG {'on' if d.mig_mode else 'off'})" for d in devices)
    pytest.skip(f"no MIG-capable GPU in MIG mode vgpu has a table for ({seen or 'no GPU'})")


def handle_of(uuid: str) -> Any:
    return pynvml.nvmlDeviceGetHandleByUUID(uuid)


def test_nvml_profiles_agree_with_vgpus_table(mig_gpu: GpuDevice) -> None:
    reader = NvmlMig(pynvml)
    handle = handle_of(mig_gpu.uuid)
    found = {p.name: p for p in reader.profiles(handle, mig_gpu.uuid).values()}
    print(f"{mig_gpu.model}: NVML profiles {sorted(found)}")
    for expected in mig.profiles_for(mig_gpu.model):
        assert expected.name in found, f"NVML lists no {expected.name} on {mig_gpu.model}"
        real = found[expected.name]
        print(
            f"  {real.name}: id {real.profile_id}, {real.slices} slices, {real.memory_mib} MiB "
            f"(table {expected.memory_mib}), max {real.max_count}"
        )
        assert (real.profile_id, real.slices, real.max_count) == (
            expected.profile_id,
            expected.slices,
            expected.max_count,
        )
        # The allocator fits requests by the table: the card must hold at least as much.
        assert real.memory_mib >= expected.memory_mib
        placements = reader.placements(handle, mig_gpu.uuid, real.profile_id)
        assert sorted(placements) == [(s, expected.memory_slices) for s in expected.starts]


def nvidia_smi_mig_uuids(gpu_index: int) -> set[str]:
    out = subprocess.run(
        ["nvidia-smi", "-L"], check=True, capture_output=True, text=True, timeout=30
    ).stdout
    found: set[str] = set()
    current = -1
    for line in out.splitlines():
        gpu = re.match(r"GPU (\d+):", line)
        if gpu:
            current = int(gpu[1])
        device = re.search(r"\(UUID: (MIG-[0-9a-fA-F-]+)\)", line)
        if device and current == gpu_index:
            found.add(device[1])
    return found


@pytest.mark.skipif(shutil.which("nvidia-smi") is None, reason="nvidia-smi not installed")
def test_listed_mig_devices_are_nvidia_smis(backend: NvmlGpuBackend, mig_gpu: GpuDevice) -> None:
    listed = backend.mig_devices(mig_gpu.uuid)
    for device in listed:
        print(device)
    assert {d.uuid for d in listed} == nvidia_smi_mig_uuids(mig_gpu.index)


def free_start(backend: NvmlGpuBackend, gpu: GpuDevice) -> tuple[mig.GiProfile, int]:
    placed = [
        mig.PlacedGi(d.gi_profile, mig.Placement(d.start, d.size))
        for d in backend.mig_devices(gpu.uuid)
    ]
    found = mig.smallest_fitting(gpu.model, 1, placed)
    if found is None:
        pytest.skip(f"GPU {gpu.index} has no free memory slice for a MIG instance")
    return found


@needs_write
def test_make_and_remove_an_instance(backend: NvmlGpuBackend, mig_gpu: GpuDevice) -> None:
    before = backend.mig_devices(mig_gpu.uuid)
    profile, start = free_start(backend, mig_gpu)
    gi_id = backend.create_gpu_instance(mig_gpu.uuid, profile.name, start)
    try:
        ci_id = backend.create_compute_instance(mig_gpu.uuid, gi_id)
        made = [d for d in backend.mig_devices(mig_gpu.uuid) if d.gi_id == gi_id]
        print(made)
        assert [(d.profile, d.start, d.ci_id) for d in made] == [(profile.name, start, ci_id)]
        assert made[0].uuid.startswith("MIG-") and made[0].sm_count > 0
        if shutil.which("nvidia-smi"):
            assert made[0].uuid in nvidia_smi_mig_uuids(mig_gpu.index)
        backend.destroy_compute_instance(mig_gpu.uuid, gi_id, ci_id)
    finally:
        backend.destroy_gpu_instance(mig_gpu.uuid, gi_id)
    assert backend.mig_devices(mig_gpu.uuid) == before


def memory_pod(name: str, memory_mib: int, gpu_uuid: str) -> dict[str, Any]:
    """A pod asking `memory_mib` of GPU `gpu_uuid` alone (HAMi's use-gpuuuid annotation)."""
    limits = {"nvidia.com/gpu": "1", "nvidia.com/gpumem": str(memory_mib)}
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": name,
            "namespace": "default",
            "uid": f"uid-{name}",
            "annotations": {"nvidia.com/use-gpuuuid": gpu_uuid},
        },
        "spec": {
            "schedulerName": "vgpu-scheduler",
            "containers": [{"name": "main", "image": "cuda", "resources": {"limits": limits}}],
        },
    }


@needs_write
async def test_dynamic_mig_through_the_agent(
    backend: NvmlGpuBackend, mig_gpu: GpuDevice, nats_server: EmbeddedNats
) -> None:
    """The real allocator places a memory request on the GPU, the agent makes the instance
    through NVML before Allocate answers, and removes it once the pod is released."""
    profile, _ = free_start(backend, mig_gpu)
    before = {d.uuid for d in backend.mig_devices(mig_gpu.uuid)}
    allocator = Allocator(
        AllocatorSettings(nats_url=nats_server.url, http_port=0), LocalClusterBackend()
    )
    await allocator.start()
    async with node_dirs() as dirs:
        kubelet = KubeletSimulator(kubelet_settings(dirs))
        await kubelet.start()
        agent_backend = NvmlGpuBackend(pynvml)
        agent_backend.open()
        # Only this GPU is dynamic: the agent turns MIG mode on for no other.
        settings = agent_settings(
            nats_server.url, dirs, simulate="", mig_dynamic=str(mig_gpu.index)
        )
        agent = NodeAgent(settings, agent_backend)
        try:
            await agent.start()
            await agent.wait_registered(10)
            await kubelet.wait_for_resource("nvidia.com/gpu", timeout=10)
            await wait_until(
                lambda: any(
                    g.uuid == mig_gpu.uuid and g.mig_dynamic
                    for g in allocator.inventory.gpus(NODE) or ()
                ),
                timeout_s=10,
                what="the allocator knows the dynamic GPU",
            )
            spec = memory_pod("mig-on-hardware", max(1, profile.memory_mib - 256), mig_gpu.uuid)
            cluster = allocator.backend
            assert isinstance(cluster, LocalClusterBackend)
            cluster.add_pod(spec)
            scheduler = SchedulerSimulator(allocator.url + "/scheduler")
            try:
                assert (await scheduler.schedule(spec, [NODE])).node == NODE
            finally:
                await scheduler.close()
            admitted = await kubelet.admit(spec)
            assert admitted.error == "", admitted.error
            visible = admitted.containers[0].envs["NVIDIA_VISIBLE_DEVICES"]
            made = {d.uuid: d for d in backend.mig_devices(mig_gpu.uuid)}
            print(f"made {made[visible]}")
            assert visible not in before and made[visible].profile == profile.name
            assert await allocator.engine.release("uid-mig-on-hardware") is not None
            await wait_until(
                lambda: {d.uuid for d in backend.mig_devices(mig_gpu.uuid)} == before,
                timeout_s=20,
                what="the instance removed on release",
            )
        finally:
            await agent.stop()
            await kubelet.stop()
            await allocator.stop()
