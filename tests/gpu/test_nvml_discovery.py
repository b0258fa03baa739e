"""Discovery on a real GPU through the production NVML backend. Skips without a GPU.

Run on a GPU machine: `.venv/bin/python -m pytest -q tests/gpu/test_nvml_discovery.py -s`
(prints what was discovered). Cross-checks against `nvidia-smi` when it is installed.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from collections.abc import Iterator

import pytest

from services.nodeagent.gpus import NvmlGpuBackend, NvmlInitError
from services.nodeagent.labels import gpu_labels

pynvml = pytest.importorskip("pynvml")


@pytest.fixture(scope="module")
def backend() -> Iterator[NvmlGpuBackend]:
    opened = NvmlGpuBackend(pynvml)
    try:
        opened.open()
    except NvmlInitError as exc:
        pytest.skip(f"no usable GPU here: {exc}")
    if not opened.devices():
        opened.close()
        pytest.skip("NVML started but sees no GPU")
    yield opened
    opened.close()


def test_every_fact_is_discovered(backend: NvmlGpuBackend) -> None:
    devices = backend.devices()
    for device in devices:
        print(device)
        assert re.fullmatch(r"GPU-[0-9a-f-]{36}", device.uuid)
        assert device.model and device.memory_mib > 1024
        assert device.sm_count > 0, "neither NVML nor the cores table gave an SM count"
        assert re.fullmatch(
            r"[0-9A-Fa-f]{8}:[0-9A-Fa-f]{2}:[0-9A-Fa-f]{2}\.[0-9]", device.pci_bus_id
        )
        assert re.fullmatch(r"\d+\.\d+", device.compute_capability)
        assert device.numa_node >= -1
        assert device.healthy
        assert all(peer in {d.uuid for d in devices} for peer in device.nvlink_peers)
    assert [d.index for d in devices] == list(range(len(devices)))
    assert re.match(r"\d+\.\d+", backend.driver_version())
    assert re.fullmatch(r"\d+\.\d+", backend.cuda_version())
    print(gpu_labels(devices, backend.driver_version(), backend.cuda_version(), 10))


def test_usage_processes_and_health_events(backend: NvmlGpuBackend) -> None:
    usage = backend.usage()
    assert {u.uuid for u in usage} == {d.uuid for d in backend.devices()}
    for sample in usage:
        assert 0 <= sample.sm_util_percent <= 100 and sample.memory_used_mib >= 0
    for process in backend.processes():
        assert process.pid > 0 and process.memory_used_mib >= 0
    # No XID is expected on a healthy machine: the bounded wait must come back empty.
    assert backend.wait_for_health_event(0.2) is None


@pytest.mark.skipif(shutil.which("nvidia-smi") is None, reason="nvidia-smi not installed")
def test_matches_nvidia_smi(backend: NvmlGpuBackend) -> None:
    out = subprocess.run(
        [
            "nvidia-smi",
            "--query-gpu=index,uuid,memory.total,pci.bus_id,driver_version,compute_cap",
            "--format=csv,noheader,nounits",
        ],
        check=True,
        capture_output=True,
        text=True,
        timeout=30,
    ).stdout
    rows = [[field.strip() for field in line.split(",")] for line in out.strip().splitlines()]
    devices = backend.devices()
    assert len(rows) == len(devices)
    for row, device in zip(rows, devices, strict=True):
        index, uuid, memory, bus, driver, capability = row
        assert (int(index), uuid) == (device.index, device.uuid)
        assert int(memory) == device.memory_mib
        assert bus.lower() == device.pci_bus_id.lower()
        assert driver == backend.driver_version()
        assert capability == device.compute_capability
