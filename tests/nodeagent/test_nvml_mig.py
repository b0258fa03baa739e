"""MIG on real GPUs: the production NVML backend (NvmlGpuBackend over NVML's MIG API) run
against the pynvml-compatible double (tests/nodeagent/fake_nvml.py), first on its own, then
behind the node agent's real gRPC device plugin with the kubelet simulator, and, for dynamic
MIG, with the real allocator placing the pods."""

from __future__ import annotations

from contextlib import AbstractAsyncContextManager
from pathlib import Path
from typing import Any

import pynvml
import pytest

from services.allocator.backend import LocalClusterBackend
from services.allocator.service import Allocator
from services.common import mig
from services.common.embedded_nats import EmbeddedNats
from services.common.schemas import GpuDevice
from services.nodeagent.gpus import NvmlGpuBackend
from services.nodeagent.gpus.backend import MigControl, MigError
from services.nodeagent.gpus.nvml_mig import derived_name
from services.nodeagent.labels import MemoryNodeLabeler
from services.nodeagent.service import NodeAgent
from services.simulators.kubelet import KubeletSimulator
from services.simulators.scheduler import SchedulerSimulator
from tests.nodeagent.fake_nvml import FakeGpu, FakeNvml
from tests.nodeagent.harness import NODE, NodeDirs, running_node, wait_until
from tests.nodeagent.test_dynamic_mig import known_dynamic, memory_pod
from tests.nodeagent.test_mig_strategies import A100_40GB_RESOURCES, mig_pod

A = "GPU-aaaaaaaa-0000-0000-0000-000000000000"
B = "GPU-bbbbbbbb-0000-0000-0000-000000000000"
C = "GPU-cccccccc-0000-0000-0000-000000000000"
D = "GPU-dddddddd-0000-0000-0000-000000000000"


def a100(uuid: str, **fields: Any) -> FakeGpu:
    return FakeGpu(uuid, **fields)  # the double's default: NVIDIA A100-SXM4-40GB, 108 SMs


def h100(uuid: str, **fields: Any) -> FakeGpu:
    return FakeGpu(
        uuid,
        name="NVIDIA H100 80GB HBM3",
        memory_mib=81559,
        compute_capability=(9, 0),
        multiprocessors=132,
        **fields,
    )


def t4(uuid: str) -> FakeGpu:
    return FakeGpu(uuid, name="Tesla T4", memory_mib=15360, compute_capability=(7, 5))


def opened(nvml: FakeNvml, tmp_path: Path) -> NvmlGpuBackend:
    backend = NvmlGpuBackend(nvml, tmp_path)
    backend.open()
    return backend


def refusal(call: Any, *args: Any) -> MigError:
    with pytest.raises(MigError) as refused:
        call(*args)
    return refused.value


# -- the backend on its own -------------------------------------------------------------------


def test_lists_mig_devices_as_nvml_reports_them(tmp_path: Path) -> None:
    gpus = [a100(A), h100(B), t4(C), h100(D, mig_enabled=True)]
    nvml = FakeNvml(gpus)
    nvml.partition(gpus[0], ["3g.20gb", "2g.10gb", "1g.5gb", "1g.5gb"])
    nvml.partition(gpus[1], ["4g.40gb", "1g.10gb+me"])
    backend = opened(nvml, tmp_path)
    assert isinstance(backend, MigControl)
    a, b, c, d = backend.devices()
    assert d.mig_mode and d.mig_devices == []
    assert (a.mig_mode, b.mig_mode, c.mig_mode) == (True, True, False)
    assert c.mig_devices == [] and backend.mig_devices(C) == []
    # What NVML's MIG calls give is what the simulated GPUs give for the same geometry.
    assert a.mig_devices == nvml.mig.devices(A)
    assert b.mig_devices == nvml.mig.devices(B)
    layout = [(d.profile, d.start, d.size, d.memory_mib, d.sm_count) for d in a.mig_devices]
    assert sorted(layout) == [
        ("1g.5gb", 0, 1, 4864, 15),
        ("1g.5gb", 1, 1, 4864, 15),
        ("2g.10gb", 2, 2, 9856, 30),
        ("3g.20gb", 4, 4, 19968, 46),
    ]
    assert all(d.uuid.startswith("MIG-") and d.healthy for d in a.mig_devices)
    assert {d.profile for d in b.mig_devices} == {"4g.40gb", "1g.10gb+me"}
    assert backend.mig_devices(A) == a.mig_devices
    # A GI split into smaller compute instances: each is a MIG device "<C>c.<GI profile>".
    gi_id = backend.create_gpu_instance(D, "3g.40gb", 4)
    for _ in range(3):
        backend.create_compute_instance(D, gi_id, 1)
    split = backend.mig_devices(D)
    assert [(m.profile, m.gi_profile, m.gi_id, m.ci_id, m.sm_count) for m in split] == [
        ("1c.3g.40gb", "3g.40gb", gi_id, ci, 132 // 7) for ci in range(3)
    ]


@pytest.mark.parametrize(
    ("gpu", "table"),
    [
        (a100(A), "A100-40GB"),
        (FakeGpu(B, name="NVIDIA A100-SXM4-80GB", memory_mib=81920), "A100-80GB"),
        (h100(C), "H100-80GB"),
    ],
)
def test_profile_names_of_drivers_without_them_are_derived_as_nvidia_does(
    gpu: FakeGpu, table: str, tmp_path: Path
) -> None:
    old = FakeGpu(**{**gpu.__dict__, "profile_info_v2": False, "mig_enabled": True})
    new = FakeGpu(**{**gpu.__dict__, "mig_enabled": True})
    for fake in (old, new):
        backend = opened(FakeNvml([fake]), tmp_path)
        for profile in mig.profiles_for(table):
            gi_id = backend.create_gpu_instance(fake.uuid, profile.name, profile.starts[0])
            backend.create_compute_instance(fake.uuid, gi_id)
            (made,) = backend.mig_devices(fake.uuid)
            assert (made.profile, made.memory_mib) == (profile.name, profile.memory_mib)
            backend.destroy_compute_instance(fake.uuid, gi_id, made.ci_id)
            backend.destroy_gpu_instance(fake.uuid, gi_id)
    assert derived_name(1, 4864, 40960) == "1g.5gb"
    assert derived_name(1, 4864, 40960, "+me") == "1g.5gb+me"
    assert derived_name(7, 81152, 81559) == "7g.80gb"


def test_makes_and_removes_instances_with_nvmls_refusals(tmp_path: Path) -> None:
    gpus = [a100(A), t4(C)]
    nvml = FakeNvml(gpus)
    backend = opened(nvml, tmp_path)
    off = refusal(backend.create_gpu_instance, A, "1g.5gb", 6)
    assert off.code == "invalid_argument" and "is MIG mode on?" in str(off)
    assert refusal(backend.set_mig_mode, C, True).code == "not_supported"
    backend.set_mig_mode(A, True)
    assert backend.devices()[0].mig_mode

    gi = backend.create_gpu_instance(A, "3g.20gb", 4)
    ci = backend.create_compute_instance(A, gi)
    (made,) = backend.mig_devices(A)
    assert (made.profile, made.start, made.gi_id, made.ci_id) == ("3g.20gb", 4, gi, ci)
    assert [(v.profile.name, v.start) for v in nvml.gpu_instances(gpus[0])] == [("3g.20gb", 4)]

    overlap = refusal(backend.create_gpu_instance, A, "2g.10gb", 4)  # inside the 3g.20gb
    assert overlap.code == "insufficient_resources"
    assert f"creating a 2g.10gb GPU instance at memory slice 4 on {A}: NVML says" in str(overlap)
    bad_start = refusal(backend.create_gpu_instance, A, "2g.10gb", 3)
    assert bad_start.code == "invalid_argument"
    assert "cannot start at memory slice 3 (NVML allows 0, 2, 4)" in str(bad_start)
    unknown = refusal(backend.create_gpu_instance, A, "5g.25gb", 0)
    assert "no MIG profile '5g.25gb'" in str(unknown) and "1g.5gb" in str(unknown)
    # NVML's own choice of placement (no start given).
    second = backend.create_gpu_instance(A, "3g.20gb")
    assert {v.start for v in nvml.gpu_instances(gpus[0])} == {0, 4}
    too_big = refusal(backend.create_compute_instance, A, second, 4)
    assert too_big.code == "invalid_argument" and "NVML offers 1, 2, 3" in str(too_big)
    backend.create_compute_instance(A, second, 2)
    assert "2c.3g.20gb" in {d.profile for d in backend.mig_devices(A)}

    assert refusal(backend.destroy_gpu_instance, A, gi).code == "in_use"  # its CI remains
    assert refusal(backend.set_mig_mode, A, False).code == "in_use"
    nvml.busy.add(made.uuid)  # a process still runs on it
    assert refusal(backend.destroy_compute_instance, A, gi, ci).code == "in_use"
    nvml.busy.clear()
    backend.destroy_compute_instance(A, gi, ci)
    backend.destroy_gpu_instance(A, gi)
    assert refusal(backend.destroy_gpu_instance, A, gi).code == "not_found"
    assert refusal(backend.destroy_compute_instance, A, gi, ci).code == "not_found"
    assert refusal(backend.mig_devices, "GPU-nope").code == "not_found"

    gpus[0].mig_root = False  # an agent without root on the host
    denied = refusal(backend.create_gpu_instance, A, "1g.5gb", 6)
    assert denied.code == "no_permission" and "run the node agent privileged" in str(denied)


def test_a_failed_listing_keeps_the_last_one_and_mig_gpus_report_no_usage(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    gpus = [a100(A), t4(C)]
    nvml = FakeNvml(gpus)
    nvml.partition(gpus[0], ["7g.40gb"])
    backend = opened(nvml, tmp_path)
    listed = backend.devices()[0].mig_devices
    assert [d.profile for d in listed] == ["7g.40gb"]
    gpus[0].mig_listing_error = pynvml.NVML_ERROR_UNKNOWN
    assert backend.devices()[0].mig_devices == listed  # the kubelet does not see it vanish
    assert "cannot list MIG devices; keeping the last listing" in caplog.text
    with pytest.raises(MigError):
        backend.mig_devices(A)  # asked directly, the failure is said
    # NVML has no utilisation for a GPU in MIG mode: only the T4 has a sample.
    assert [u.uuid for u in backend.usage()] == [C]


def test_a_mig_mode_change_may_wait_for_a_gpu_reset(tmp_path: Path) -> None:
    gpu = a100(A, mig_reset_required=True)
    nvml = FakeNvml([gpu])
    backend = opened(nvml, tmp_path)
    backend.set_mig_mode(A, True)  # accepted, pending
    assert backend.devices()[0].mig_mode is False
    nvml.reset(gpu)
    assert backend.devices()[0].mig_mode is True


def test_an_xid_on_a_mig_device_names_that_device(tmp_path: Path) -> None:
    gpu = a100(A)
    nvml = FakeNvml([gpu])
    nvml.partition(gpu, ["3g.20gb", "3g.20gb"])
    backend = opened(nvml, tmp_path)
    first, second = backend.devices()[0].mig_devices
    nvml.xid(gpu, 79, second.gi_id, second.ci_id)
    event = backend.wait_for_health_event(1.0)
    assert event is not None and (event.uuid, event.xid) == (second.uuid, 79)
    nvml.xid(gpu, 48)  # no instance named: the whole GPU
    event = backend.wait_for_health_event(1.0)
    assert event is not None and event.uuid == A
    assert first.uuid != second.uuid


# -- behind the agent's device plugin ----------------------------------------------------------


def nvml_node(
    nats_url: str, dirs: NodeDirs, backend: NvmlGpuBackend, **overrides: Any
) -> AbstractAsyncContextManager[tuple[KubeletSimulator, NodeAgent]]:
    """A kubelet simulator and a node agent on real GPUs' code path (simulate unset)."""
    return running_node(nats_url, dirs, backend, simulate="", **overrides)


async def test_mixed_strategy_on_nvml(
    nats_server: EmbeddedNats, dirs: NodeDirs, tmp_path: Path
) -> None:
    gpus = [a100(A), a100(B), t4(C)]
    nvml = FakeNvml(gpus)
    nvml.partition(gpus[0], ["3g.20gb", "2g.10gb", "2g.10gb"])
    nvml.partition(gpus[1], ["1g.5gb"] * 7)
    backend = opened(nvml, tmp_path)
    async with nvml_node(nats_server.url, dirs, backend, mig_strategy="mixed") as (kubelet, agent):
        assert set(kubelet.resources()) == {"nvidia.com/gpu", *A100_40GB_RESOURCES}
        # Only the T4 keeps vgpu's sliced resource.
        assert {d.split("::")[0] for d in kubelet.devices("nvidia.com/gpu")} == {C}
        ones = {d.uuid for d in nvml.mig.devices(B)}
        assert set(kubelet.devices("nvidia.com/mig-1g.5gb")) == ones
        assert len(kubelet.devices("nvidia.com/mig-2g.10gb")) == 2
        labeler = agent.labeler
        assert isinstance(labeler, MemoryNodeLabeler)
        assert labeler.labels["nvidia.com/mig-1g.5gb.count"] == "7"
        assert labeler.labels["nvidia.com/mig-3g.20gb.memory"] == "19968"

        admitted = await kubelet.admit(mig_pod("two-small", "nvidia.com/mig-1g.5gb", 2))
        assert admitted.error == ""
        (container,) = admitted.containers
        visible = container.envs["NVIDIA_VISIBLE_DEVICES"].split(",")
        assert len(visible) == 2 and set(visible) <= ones

        # Repartitioned under the agent (as `nvidia-smi mig` would): a 2g.10gb becomes two
        # 1g.5gb; ListAndWatch follows.
        two_g = next(d for d in nvml.mig.devices(A) if d.profile == "2g.10gb")
        backend.destroy_compute_instance(A, two_g.gi_id, two_g.ci_id)
        backend.destroy_gpu_instance(A, two_g.gi_id)
        for start in (two_g.start, two_g.start + 1):
            backend.create_compute_instance(A, backend.create_gpu_instance(A, "1g.5gb", start))
        await wait_until(
            lambda: len(kubelet.devices("nvidia.com/mig-1g.5gb")) == 9, what="new 1g.5gb devices"
        )
        assert two_g.uuid not in kubelet.devices("nvidia.com/mig-2g.10gb")

        # An XID on one MIG device (NVML names its GI and CI) makes it alone unhealthy.
        sick = nvml.mig.devices(B)[3]
        nvml.xid(gpus[1], 79, sick.gi_id, sick.ci_id)
        await wait_until(
            lambda: kubelet.devices("nvidia.com/mig-1g.5gb").get(sick.uuid) == "Unhealthy",
            what="the MIG device unhealthy",
        )
        health = kubelet.devices("nvidia.com/mig-1g.5gb")
        assert list(health.values()).count("Unhealthy") == 1


async def test_single_and_none_strategies_on_nvml(
    nats_server: EmbeddedNats, dirs: NodeDirs, tmp_path: Path
) -> None:
    gpus = [a100(A), a100(B)]
    nvml = FakeNvml(gpus)
    for gpu in gpus:
        nvml.partition(gpu, ["1g.5gb"] * 7)
    async with nvml_node(nats_server.url, dirs, opened(nvml, tmp_path), mig_strategy="single") as (
        kubelet,
        agent,
    ):
        devices = kubelet.devices("nvidia.com/gpu")
        assert set(devices) == {d.uuid for g in gpus for d in nvml.mig.devices(g.uuid)}
        assert len(devices) == 14
        labeler = agent.labeler
        assert isinstance(labeler, MemoryNodeLabeler)
        assert labeler.labels["nvidia.com/gpu.product"] == "NVIDIA-A100-SXM4-40GB-MIG-1g.5gb"
        admitted = await kubelet.admit(mig_pod("one", "nvidia.com/gpu", 1))
        assert admitted.error == ""
        assert admitted.containers[0].envs["NVIDIA_VISIBLE_DEVICES"].startswith("MIG-")

    async with nvml_node(nats_server.url, dirs, opened(nvml, tmp_path)) as (kubelet, _):
        parents = {d.split("::")[0] for d in kubelet.devices("nvidia.com/gpu")}
        assert parents == {A, B}  # none: MIG GPUs whole


async def test_dynamic_mig_creates_and_destroys_through_nvml(
    nats_server: EmbeddedNats,
    allocator: Allocator,
    dirs: NodeDirs,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    gpu = a100(A)  # MIG off: the agent turns it on through NVML
    nvml = FakeNvml([gpu])
    async with nvml_node(
        nats_server.url,
        dirs,
        opened(nvml, tmp_path),
        mig_dynamic="all",
        container_dir_grace_s=3.0,  # the kubelet lists a container after its Allocate
        cleanup_interval_s=0.2,
    ) as (kubelet, agent):
        (device,) = agent.gpus
        assert device.mig_mode and device.mig_dynamic and device.healthy
        await wait_until(lambda: known_dynamic(allocator, A), what="the dynamic GPU known")
        backend = allocator.backend
        assert isinstance(backend, LocalClusterBackend)
        scheduler = SchedulerSimulator(allocator.url + "/scheduler")
        admitted = {}
        try:
            for name, memory in (("small", 4000), ("mid", 12000)):
                spec = memory_pod(name, memory)
                backend.add_pod(spec)
                assert (await scheduler.schedule(spec, [NODE])).node == NODE
                admitted[name] = await kubelet.admit(spec)
                assert admitted[name].error == "", admitted[name].error
        finally:
            await scheduler.close()
        # Made through NVML where the allocator placed them.
        instances = {(v.profile.name, v.start) for v in nvml.gpu_instances(gpu)}
        assert instances == {("1g.5gb", 6), ("3g.20gb", 0)}
        made = {d.profile: d.uuid for d in nvml.mig.devices(A)}
        for name, profile in (("small", "1g.5gb"), ("mid", "3g.20gb")):
            (container,) = admitted[name].containers
            assert container.envs["NVIDIA_VISIBLE_DEVICES"] == made[profile]
        await wait_until(
            lambda: len((allocator.inventory.gpus(NODE) or [device])[0].mig_devices) == 2,
            what="the inventory showing both instances",
        )
        # A process still on the instance: NVML refuses, the agent keeps it and retries.
        nvml.busy.add(made["1g.5gb"])
        assert await allocator.engine.release("uid-small") is not None
        await wait_until(
            lambda: any("not destroyed yet" in r.getMessage() for r in caplog.records),
            what="the refused destroy",
        )
        assert len(nvml.gpu_instances(gpu)) == 2
        nvml.busy.clear()
        assert kubelet.remove("default", "small")  # the janitor's backstop retries
        assert kubelet.remove("default", "mid")
        await wait_until(
            lambda: nvml.gpu_instances(gpu) == [],
            timeout_s=20,
            what="both instances destroyed through NVML",
        )


async def test_a_dynamic_gpu_waiting_for_a_reset_is_not_served(
    nats_server: EmbeddedNats, dirs: NodeDirs, tmp_path: Path
) -> None:
    gpu = a100(A, mig_reset_required=True)
    nvml = FakeNvml([gpu])
    async with nvml_node(nats_server.url, dirs, opened(nvml, tmp_path), mig_dynamic="all") as (
        kubelet,
        agent,
    ):
        pending: list[GpuDevice] = agent.gpus
        assert [(g.mig_dynamic, g.mig_mode, g.healthy) for g in pending] == [(True, False, False)]
        assert set(kubelet.devices("nvidia.com/gpu").values()) == {"Unhealthy"}
        nvml.reset(gpu)  # the operator resets the GPU
        assert await agent.refresh_devices()
        await wait_until(
            lambda: set(kubelet.devices("nvidia.com/gpu").values()) == {"Healthy"},
            what="the GPU served once MIG mode is on",
        )
        assert agent.gpus[0].mig_mode


@pytest.mark.parametrize(
    ("name", "table"),
    [
        ("NVIDIA A100-SXM4-40GB", "A100-40GB"),
        ("NVIDIA A100-PCIE-40GB", "A100-40GB"),
        ("A100-SXM4-40GB", "A100-40GB"),  # older drivers: no "NVIDIA "
        ("NVIDIA A100-SXM4-80GB", "A100-80GB"),
        ("NVIDIA A100 80GB PCIe", "A100-80GB"),
        ("NVIDIA H100 80GB HBM3", "H100-80GB"),
        ("NVIDIA H100 PCIe", "H100-80GB"),
        ("h100-80gb", "H100-80GB"),  # the simulated names
        ("NVIDIA H100 NVL", ""),  # 94 GB: other profiles, no table here
        ("NVIDIA A100X", ""),
        ("Tesla T4", ""),
    ],
)
def test_nvml_product_names_choose_the_profile_table(name: str, table: str) -> None:
    assert mig.table_model(name) == table
    assert mig.mig_capable(name) == bool(table)
