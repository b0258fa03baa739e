"""The NVML backend's code, run against a simulated pynvml module (no GPU needed)."""

from __future__ import annotations

from pathlib import Path

import pynvml
import pytest

from services.nodeagent.gpus import GpuProcess, HealthEvent, NvmlGpuBackend, NvmlInitError
from services.nodeagent.gpus.nvml import cuda_version_text, sysfs_pci_address
from tests.nodeagent.fake_nvml import FakeGpu, FakeNvml

A = "GPU-aaaaaaaa-0000-0000-0000-000000000000"
B = "GPU-bbbbbbbb-0000-0000-0000-000000000000"
C = "GPU-cccccccc-0000-0000-0000-000000000000"


def three_gpus() -> list[FakeGpu]:
    return [
        FakeGpu(A, bus_id="00000000:07:00.0", nvlinks=["00000000:0F:00.0", "00000000:0F:00.0"]),
        FakeGpu(B, bus_id="00000000:0F:00.0", nvlinks=["00000000:07:00.0", "00000000:FF:00.0"]),
        FakeGpu(
            C,
            name="Tesla T4",
            memory_mib=15360,
            compute_capability=(7, 5),
            bus_id="00000001:B1:00.0",
            multiprocessors=None,  # older NVML: attributes are MIG-only
            cuda_cores=2560,
            mig_enabled=False,
        ),
    ]


def sysfs(tmp_path: Path, numa: dict[str, str]) -> Path:
    for address, node in numa.items():
        device = tmp_path / "bus" / "pci" / "devices" / address
        device.mkdir(parents=True)
        (device / "numa_node").write_text(node + "\n")
    return tmp_path


def test_discovers_every_fact(tmp_path: Path) -> None:
    root = sysfs(tmp_path, {"0000:07:00.0": "0", "0000:0f:00.0": "1", "0001:b1:00.0": "-1"})
    backend = NvmlGpuBackend(FakeNvml(three_gpus()), root)
    backend.open()
    a, b, c = backend.devices()
    assert (a.uuid, a.index, a.model, a.memory_mib, a.sm_count) == (
        A, 0, "NVIDIA A100-SXM4-40GB", 40960, 108,
    )  # fmt: skip
    assert (a.pci_bus_id, a.numa_node, a.compute_capability, a.mig_mode) == (
        "00000000:07:00.0", 0, "8.0", False,
    )  # fmt: skip
    assert a.nvlink_peers == [B]  # two links to B count once
    assert b.nvlink_peers == [A]  # the link to FF:00.0 (an NVSwitch) is not a GPU peer
    assert b.numa_node == 1
    # No multiprocessor count from NVML: 2560 cores / 64 per SM on compute capability 7.5.
    assert (c.model, c.memory_mib, c.sm_count, c.compute_capability) == (
        "Tesla T4",
        15360,
        40,
        "7.5",
    )
    assert c.numa_node == -1 and c.nvlink_peers == [] and c.healthy
    assert backend.driver_version() == "550.54.15"
    assert backend.cuda_version() == "12.4"


def test_mig_mode_and_missing_sysfs(tmp_path: Path) -> None:
    gpu = FakeGpu(A, mig_enabled=True)
    backend = NvmlGpuBackend(FakeNvml([gpu]), tmp_path)  # no sysfs entries at all
    backend.open()
    (device,) = backend.devices()
    assert device.mig_mode is True
    assert device.numa_node == -1


def test_init_failure_is_a_clear_error() -> None:
    backend = NvmlGpuBackend(FakeNvml([], init_error=pynvml.NVML_ERROR_DRIVER_NOT_LOADED))
    with pytest.raises(NvmlInitError) as caught:
        backend.open()
    message = str(caught.value)
    assert "cannot start NVML" in message and "Driver Not Loaded" in message


def test_a_lost_gpu_stays_listed_unhealthy(tmp_path: Path) -> None:
    nvml = FakeNvml(three_gpus())
    backend = NvmlGpuBackend(nvml, tmp_path)
    backend.open()
    nvml.gpus[1].lost = True
    devices = backend.devices()
    assert [d.uuid for d in devices] == [A, B, C]
    assert [d.healthy for d in devices] == [True, False, True]
    assert [u.uuid for u in backend.usage()] == [A, C]
    nvml.gpus[1].lost = False  # once lost, unhealthy until the agent restarts
    assert [d.healthy for d in backend.devices()] == [True, False, True]


def test_a_gpu_gone_from_the_bus_is_unhealthy(tmp_path: Path) -> None:
    nvml = FakeNvml(three_gpus())
    backend = NvmlGpuBackend(nvml, tmp_path)
    backend.open()
    del nvml.gpus[2]  # handle by UUID now answers NOT_FOUND
    assert [d.healthy for d in backend.devices()] == [True, True, False]


def test_usage_and_processes(tmp_path: Path) -> None:
    nvml = FakeNvml(three_gpus())
    a = nvml.gpus[0]
    a.used_mib, a.sm_util, a.memory_util = 2048, 37, 12
    a.processes = [(4242, 1024), (4343, None)]
    a.samples = [(4242, 30, 1000), (4242, 35, 2000)]
    backend = NvmlGpuBackend(nvml, tmp_path)
    backend.open()
    usage = {u.uuid: u for u in backend.usage()}
    assert (usage[A].memory_used_mib, usage[A].sm_util_percent) == (2048, 37.0)
    assert usage[A].memory_util_percent == 12.0
    assert backend.processes() == [
        GpuProcess(pid=4242, uuid=A, memory_used_mib=1024, sm_util_percent=35.0),
        GpuProcess(pid=4343, uuid=A, memory_used_mib=0, sm_util_percent=-1.0),
    ]
    # Samples already seen are not counted again; NVML answers NOT_FOUND without new ones.
    assert [p.sm_util_percent for p in backend.processes()] == [-1.0, -1.0]


def test_xid_events(tmp_path: Path) -> None:
    nvml = FakeNvml(three_gpus())
    backend = NvmlGpuBackend(nvml, tmp_path)
    backend.open()
    assert backend.wait_for_health_event(0.01) is None  # NVML timeout: nothing happened
    assert len(nvml.registered) == 3
    nvml.xid(nvml.gpus[1], 79)
    nvml.xid(None, 48)
    assert backend.wait_for_health_event(1) == HealthEvent(uuid=B, xid=79)
    assert backend.wait_for_health_event(1) == HealthEvent(uuid="", xid=48)
    backend.close()
    assert not nvml.initialised
    backend.close()  # idempotent


@pytest.mark.parametrize(
    ("nvml_id", "sysfs_id"),
    [("00000000:3B:00.0", "0000:3b:00.0"), ("0000:3B:00.0", "0000:3b:00.0")],
)
def test_pci_address(nvml_id: str, sysfs_id: str) -> None:
    assert sysfs_pci_address(nvml_id) == sysfs_id


def test_cuda_version_text() -> None:
    assert cuda_version_text(12040) == "12.4"
    assert cuda_version_text(11080) == "11.8"
    assert cuda_version_text(0) == ""
