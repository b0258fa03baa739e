"""NVML inside the container reports the slice: what nvidia-smi (dlopen + dlsym of
libnvidia-ml.so.1) sees, with the simulated libnvidia-ml.so.1."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

from tests.hook.harness import hook_env, limits_text, run, sim_uuid, tool, write_limits


def query(container_dir: Path, *, hook: bool = True, **extra: str) -> list[dict[str, str]]:
    proc = run([tool("nvml_query")], container_dir, hook=hook, VGPU_HOOK_QUIET="1", **extra)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.strip().splitlines()
    rows = [dict(re.findall(r"(\w+)=(\S+)", line)) for line in lines]
    assert int(rows[0]["count"]) == len(rows) - 1
    return rows[1:]


TWO_GPUS = {"VGPU_SIM_GPUS": "2x40960"}


def test_nvml_reports_the_slice_and_only_the_containers_gpus(build: Path, tmp_path: Path) -> None:
    # The container got the second of two GPUs.
    write_limits(tmp_path, limits_text(1024, uuids=[sim_uuid(1)]))
    devices = query(tmp_path, **TWO_GPUS)
    assert devices == [
        {
            "device": "0",
            "uuid": sim_uuid(1),
            "total_mib": "1024",
            "used_mib": "0",
            "free_mib": "1024",
            "total2_mib": "1024",
            "used2_mib": "0",
        }
    ]


def test_without_the_hook_nvml_shows_every_whole_gpu(build: Path, tmp_path: Path) -> None:
    write_limits(tmp_path, limits_text(1024, uuids=[sim_uuid(1)]))
    devices = query(tmp_path, hook=False, **TWO_GPUS)
    assert [(d["uuid"], d["total_mib"]) for d in devices] == [
        (sim_uuid(0), "40960"),
        (sim_uuid(1), "40960"),
    ]


def test_nvml_used_is_what_the_containers_processes_hold(build: Path, tmp_path: Path) -> None:
    write_limits(tmp_path, limits_text(1024))
    holder = subprocess.Popen(
        [tool("mem_paths"), "alloc", "link", "create", "300", "hold"],
        env=hook_env(tmp_path, VGPU_HOOK_QUIET="1", VGPU_CONTEXT_OVERHEAD_MIB="24"),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None
        assert holder.stdout.readline().startswith("holding allocated_mib=900")
        (device,) = query(tmp_path)
    finally:
        holder.communicate(timeout=30)
    assert device["used_mib"] == device["used2_mib"] == "924"  # 3 x 300 + the context
    assert device["free_mib"] == "100"
    assert device["total_mib"] == "1024"


def test_without_uuids_the_drivers_numbering_is_kept(build: Path, tmp_path: Path) -> None:
    write_limits(tmp_path, "version=1\ndevice_count=1\ndevice.0.memory_limit_mib=2048\n")
    devices = query(tmp_path, **TWO_GPUS)
    assert [(d["uuid"], d["total_mib"]) for d in devices] == [
        (sim_uuid(0), "2048"),
        (sim_uuid(1), "40960"),  # not described: not limited (and warned about by CUDA)
    ]
