"""libvgpu-hook end to end, basics: the build, what is exported, the memory limit through
cuMemAlloc, where the limits come from, and Python/ctypes through every way of finding the
driver. Real processes, the hook LD_PRELOADed in front of the simulated driver."""

from __future__ import annotations

import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tests.hook.harness import (
    CUDA_ERROR_INVALID_VALUE,
    CUDA_ERROR_OUT_OF_MEMORY,
    HOOK,
    HOOK_DIR,
    SIM_MIB,
    limits_text,
    run,
    summary,
    tool,
    write_limits,
)


def alloc(
    container_dir: Path, *args: object, hook: bool = True, **extra: str
) -> tuple[subprocess.CompletedProcess[str], dict[str, int]]:
    proc = run([tool("alloc_limit"), *map(str, args)], container_dir, hook=hook, **extra)
    return proc, summary(proc)


# --- C unit tests of the policy code (no interception) -------------------------------


@pytest.mark.parametrize("program", ["limits_parse", "track_test", "region_test", "policy_test"])
def test_c_unit_tests(build: Path, program: str) -> None:
    proc = subprocess.run([tool(program)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.strip() == f"{program}: ok"


def listed(pattern: str) -> set[str]:
    names: set[str] = set()
    for def_file in (HOOK_DIR / "src").glob("*.def"):
        names |= set(re.findall(pattern, def_file.read_text(), re.MULTILINE))
    return names


def test_only_the_interposers_and_dlsym_are_exported(build: Path) -> None:
    hooked = listed(r"^(?:CUDA|NVML)_HOOK\((\w+),")
    assert {"cuGetProcAddress", "cuGetProcAddress_v2", "cuMemAllocAsync_ptsz"} <= hooked
    assert {"nvmlDeviceGetMemoryInfo", "nvmlDeviceGetMemoryInfo_v2"} <= hooked
    nm = subprocess.run(
        ["nm", "-D", "--defined-only", str(HOOK)], capture_output=True, text=True, check=True
    )
    exported = {line.split()[-1] for line in nm.stdout.splitlines() if line.strip()}
    assert exported == hooked | {"dlsym"}


# --- enforcement -----------------------------------------------------------------------


def test_allocations_stop_at_the_limit(build: Path, tmp_path: Path) -> None:
    write_limits(tmp_path, limits_text(1024))
    proc, out = alloc(tmp_path, 100)
    assert proc.returncode == 0, proc.stderr
    assert out["allocated_mib"] == 1000
    assert out["result"] == CUDA_ERROR_OUT_OF_MEMORY
    assert out["total_mib"] == 1024  # cuMemGetInfo: total = limit
    assert out["free_mib"] == 24  # free = limit - used
    assert out["device_total_mib"] == 1024  # cuDeviceTotalMem = limit
    assert out["free_after_mib"] == 1024  # cuMemFree gave everything back
    assert (
        "vgpu-hook: out of memory on device 0: used 1000 MiB + asked 100 MiB > limit 1024 MiB"
        in proc.stderr
    )


def test_without_the_hook_the_full_device_is_available(build: Path, tmp_path: Path) -> None:
    """Same program, same limit file, no LD_PRELOAD: proves the other tests can fail."""
    write_limits(tmp_path, limits_text(1024))
    proc, out = alloc(tmp_path, 100, hook=False)
    assert proc.returncode == 0, proc.stderr
    assert out["allocated_mib"] == 40900
    assert out["total_mib"] == out["device_total_mib"] == SIM_MIB
    assert "vgpu-hook" not in proc.stderr


def test_concurrent_allocations_never_overshoot(build: Path, tmp_path: Path) -> None:
    write_limits(tmp_path, limits_text(1024))
    proc, out = alloc(tmp_path, 10, 0, 8)  # 8 threads, 10 MiB chunks
    assert proc.returncode == 0, proc.stderr
    assert out["allocated_mib"] == 1020
    assert out["free_after_mib"] == 1024


def test_limits_are_per_device_of_the_current_context(build: Path, tmp_path: Path) -> None:
    write_limits(tmp_path, limits_text(1024, 2048))
    proc, out = alloc(tmp_path, 100, 1, VGPU_SIM_GPUS="2x40960")
    assert proc.returncode == 0, proc.stderr
    assert out["allocated_mib"] == 2000
    assert out["total_mib"] == out["device_total_mib"] == 2048
    assert "on device 1: used 2000 MiB + asked 100 MiB > limit 2048 MiB" in proc.stderr


def test_zero_means_unlimited(build: Path, tmp_path: Path) -> None:
    write_limits(tmp_path, limits_text(0))
    _, out = alloc(tmp_path, 1000)
    assert out["allocated_mib"] == 40000
    assert out["total_mib"] == SIM_MIB


def test_more_devices_than_described_is_warned_about(build: Path, tmp_path: Path) -> None:
    write_limits(tmp_path, limits_text(1024))
    proc, out = alloc(tmp_path, 1000, 1, VGPU_SIM_GPUS="2x4096", VGPU_HOOK_QUIET="1")
    assert out["allocated_mib"] == 4000
    assert "the driver shows 2 devices but the limit file describes 1" in proc.stderr


# --- where the limits come from ----------------------------------------------------------


@pytest.mark.parametrize(
    ("body", "line", "problem"),
    [
        (
            "version=1\ndevice_count=1\ndevice.0.memory_limit_mib=lots\n",
            3,
            "device.0.memory_limit_mib: 'lots' is not a whole number of MiB",
        ),
        ("version=1\ndevice_count\n", 2, "expected key=value, got 'device_count'"),
        (
            "version=2\ndevice_count=1\ndevice.0.memory_limit_mib=1\n",
            1,
            "unsupported version 2 (this hook reads version=1)",
        ),
        (
            "version=1\ndevice_count=1\ndevice.0.memory_limit_mib=1\ndevice.0.cores=150\n",
            4,
            "device.0.cores: '150' is not a number from 0 to 100",
        ),
    ],
)
def test_malformed_limit_file_refuses_to_run(
    build: Path, tmp_path: Path, body: str, line: int, problem: str
) -> None:
    path = write_limits(tmp_path, body)
    proc = run([tool("alloc_limit")], tmp_path, VGPU_MEMORY_LIMIT_MIB="512")
    assert proc.returncode == 1
    assert summary(proc) == {"init_result": CUDA_ERROR_INVALID_VALUE}
    assert f"vgpu-hook: {path}:{line}: {problem}\n" in proc.stderr


def test_limit_file_missing_a_required_key_refuses_to_run(build: Path, tmp_path: Path) -> None:
    path = write_limits(tmp_path, "version=1\ndevice_count=1\ndevice.0.cores=50\n")
    proc = run([tool("alloc_limit")], tmp_path)
    assert summary(proc) == {"init_result": CUDA_ERROR_INVALID_VALUE}
    assert f"vgpu-hook: {path}: missing required key 'device.0.memory_limit_mib'" in proc.stderr


def test_unreadable_limit_file_refuses_to_run(build: Path, tmp_path: Path) -> None:
    (tmp_path / "limits").mkdir()  # exists, but cannot be read as a file
    proc = run([tool("alloc_limit")], tmp_path)
    assert summary(proc) == {"init_result": CUDA_ERROR_INVALID_VALUE}
    assert f"vgpu-hook: {tmp_path}/limits:" in proc.stderr


def test_env_fallback_after_waiting(build: Path, tmp_path: Path) -> None:
    started = time.monotonic()
    proc, out = alloc(tmp_path, 100, VGPU_LIMIT_WAIT_MS="200", VGPU_MEMORY_LIMIT_MIB="512")
    assert time.monotonic() - started >= 0.2
    assert out["allocated_mib"] == 500
    assert out["total_mib"] == out["device_total_mib"] == 512
    assert proc.stderr.count(f"vgpu-hook: waiting for limit file {tmp_path}/limits") == 1
    assert "VGPU_MEMORY_LIMIT_MIB=512 applies to every device" in proc.stderr


def test_no_limits_at_all_runs_unlimited_and_says_so(build: Path, tmp_path: Path) -> None:
    proc, out = alloc(tmp_path, 1000, VGPU_LIMIT_WAIT_MS="50")
    assert out["allocated_mib"] == 40000
    assert (
        f"vgpu-hook: no limit file at {tmp_path}/limits and VGPU_MEMORY_LIMIT_MIB unset; "
        "running unlimited" in proc.stderr
    )


@pytest.mark.parametrize(
    ("variable", "value", "problem"),
    [
        ("VGPU_MEMORY_LIMIT_MIB", "1GiB", "VGPU_MEMORY_LIMIT_MIB='1GiB' is not a whole number"),
        ("VGPU_CONTEXT_OVERHEAD_MIB", "-3", "VGPU_CONTEXT_OVERHEAD_MIB='-3' is not a whole number"),
        (
            "VGPU_COMPUTE_POLICY",
            "fair",
            "VGPU_COMPUTE_POLICY='fair' is not one of share, hard, off",
        ),
    ],
)
def test_bad_setting_refuses_to_run(
    build: Path, tmp_path: Path, variable: str, value: str, problem: str
) -> None:
    proc = run([tool("alloc_limit")], tmp_path, **{variable: value})
    assert summary(proc) == {"init_result": CUDA_ERROR_INVALID_VALUE}
    assert problem in proc.stderr


def test_limit_file_written_later_is_waited_for(build: Path, tmp_path: Path) -> None:
    writer = threading.Timer(0.3, write_limits, (tmp_path, limits_text(700)))
    started = time.monotonic()
    writer.start()
    try:
        proc, out = alloc(tmp_path, 100, VGPU_LIMIT_WAIT_MS="5000", VGPU_MEMORY_LIMIT_MIB="100000")
    finally:
        writer.join()
    assert 0.3 <= time.monotonic() - started < 5
    assert proc.stderr.count("vgpu-hook: waiting for limit file") == 1
    assert out["allocated_mib"] == 700
    assert out["total_mib"] == 700


def test_quiet_silences_info_but_not_errors(build: Path, tmp_path: Path) -> None:
    proc, out = alloc(
        tmp_path, 100, VGPU_LIMIT_WAIT_MS="50", VGPU_MEMORY_LIMIT_MIB="256", VGPU_HOOK_QUIET="1"
    )
    assert out["allocated_mib"] == 200
    assert "waiting for limit file" not in proc.stderr
    assert "applies to every device" not in proc.stderr
    assert "vgpu-hook: out of memory on device 0: used 200 MiB" in proc.stderr


def test_processes_that_never_use_cuda_are_untouched(build: Path, tmp_path: Path) -> None:
    """/etc/ld.so.preload puts the hook in every process of the container."""
    proc = run(["sh", "-c", "echo hello"], tmp_path, VGPU_LIMIT_WAIT_MS="5000")
    assert proc.returncode == 0
    assert proc.stdout == "hello\n"
    assert proc.stderr == ""
    assert not (tmp_path / "hook.region").exists()


# --- Python / ctypes ----------------------------------------------------------------------

CTYPES_SCRIPT = r"""
import ctypes, sys
mode = sys.argv[1]
libcuda = ctypes.CDLL(
    "libcuda.so.1", mode=ctypes.RTLD_LOCAL if mode == "local" else ctypes.RTLD_GLOBAL
)
# The intercepted functions are looked up
#  - global: in the process's global scope, where the preloaded hook comes first (as for a
#    binary linked with -lcuda); the hook finds the driver with dlsym(RTLD_NEXT).
#  - local: the same, but libcuda is not in the global scope, so the hook has to dlopen it.
#  - handle: with dlsym on libcuda's own handle, which only the hook's dlsym covers.
api = libcuda if mode == "handle" else ctypes.CDLL(None)
def ok(rc, what):
    if rc != 0:
        sys.exit(f"{what} failed: {rc}")
ok(api.cuInit(0), "cuInit")
dev, ctx = ctypes.c_int(), ctypes.c_void_p()
ok(libcuda.cuDeviceGet(ctypes.byref(dev), 0), "cuDeviceGet")
ok(libcuda.cuCtxCreate_v2(ctypes.byref(ctx), 0, dev), "cuCtxCreate_v2")
ptr, n = ctypes.c_ulonglong(), 0
while (rc := api.cuMemAlloc_v2(ctypes.byref(ptr), ctypes.c_size_t(64 << 20))) == 0:
    n += 1
free, total = ctypes.c_size_t(), ctypes.c_size_t()
ok(api.cuMemGetInfo_v2(ctypes.byref(free), ctypes.byref(total)), "cuMemGetInfo_v2")
print(f"allocated_mib={n * 64} result={rc} total_mib={total.value >> 20}")
"""


@pytest.mark.parametrize("mode", ["global", "local", "handle"])
def test_python_ctypes_hits_the_limit(build: Path, tmp_path: Path, mode: str) -> None:
    write_limits(tmp_path, limits_text(1024))
    proc = run([sys.executable, "-c", CTYPES_SCRIPT, mode], tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert summary(proc) == {
        "allocated_mib": 1024,
        "result": CUDA_ERROR_OUT_OF_MEMORY,
        "total_mib": 1024,
    }
