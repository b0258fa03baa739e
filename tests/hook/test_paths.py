"""Every path that takes device memory is held to the limit, whichever way the program found
the driver's functions: linked symbols, dlsym on libcuda's handle, cuGetProcAddress_v2 (as the
CUDA 12 runtime does, itself fetched through cuGetProcAddress), the per-thread variants, and
the CUDA 11 cuGetProcAddress."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.hook.harness import (
    CUDA_ERROR_NOT_SUPPORTED,
    CUDA_ERROR_OUT_OF_MEMORY,
    limits_text,
    run,
    summary,
    tool,
    write_limits,
)

PATHS = ["alloc", "pitch", "managed", "array", "array3d", "mipmap", "async", "pool", "vmm"]
GRAPH_PATHS = ["graph", "graph_node"]  # cuGraphAddNode exists from CUDA 12.2 only
RESOLVE = ["link", "dlsym", "procaddr", "procaddr_pt", "procaddr_v1"]


def mem_paths(container_dir: Path, *args: object, **extra: str) -> dict[str, int]:
    proc = run([tool("mem_paths"), *map(str, args)], container_dir, **extra)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return summary(proc)


@pytest.mark.parametrize("resolve", RESOLVE)
@pytest.mark.parametrize("path", PATHS + GRAPH_PATHS)
def test_every_path_stops_at_the_limit(
    build: Path, tmp_path: Path, path: str, resolve: str
) -> None:
    if path == "graph_node" and resolve == "procaddr_v1":
        pytest.skip("cuGraphAddNode is not handed out for CUDA 11.8")
    write_limits(tmp_path, limits_text(1000))
    out = mem_paths(tmp_path, path, resolve, "create", 80, VGPU_HOOK_QUIET="1")
    assert out == {
        "allocated_mib": 960,  # 12 chunks of 80 MiB; a 13th would pass 1000
        "result": CUDA_ERROR_OUT_OF_MEMORY,
        "total_mib": 1000,
        "free_mib": 40,
        "device_total_mib": 1000,
        "free_after_mib": 1000,  # the matching free path gave it all back
    }


@pytest.mark.parametrize("path", PATHS + GRAPH_PATHS)
def test_without_the_hook_every_path_takes_the_whole_device(
    build: Path, tmp_path: Path, path: str
) -> None:
    """Proves the path really allocates on the simulated device (graphs: when an executable graph
    is uploaded) and that only the hook stops it."""
    write_limits(tmp_path, limits_text(1000))
    out = mem_paths(tmp_path, path, "link", "create", 4096, hook=False)
    assert out["allocated_mib"] == 40960
    assert out["result"] == CUDA_ERROR_OUT_OF_MEMORY


def test_out_of_memory_log_names_used_asked_and_limit(build: Path, tmp_path: Path) -> None:
    write_limits(tmp_path, limits_text(1000))
    proc = run([tool("mem_paths"), "vmm", "procaddr", "create", "80"], tmp_path)
    assert "vgpu-hook: out of memory on device 0: used 960 MiB + asked 80 MiB > limit 1000 MiB" in (
        proc.stderr
    )


@pytest.mark.parametrize("resolve", ["link", "procaddr"])
@pytest.mark.parametrize("context", ["create", "primary"])
def test_each_context_is_charged_its_overhead(
    build: Path, tmp_path: Path, resolve: str, context: str
) -> None:
    write_limits(tmp_path, limits_text(1024))
    out = mem_paths(tmp_path, "alloc", resolve, context, 100, VGPU_CONTEXT_OVERHEAD_MIB="200")
    assert out["allocated_mib"] == 800  # 1024 - 200 for the context
    assert out["free_after_mib"] == 824  # the context itself is still there


def test_overhead_from_the_limit_file_wins_over_the_environment(
    build: Path, tmp_path: Path
) -> None:
    write_limits(tmp_path, limits_text(1024) + "context_overhead_mib=300\n")
    out = mem_paths(tmp_path, "alloc", "link", "create", 100, VGPU_CONTEXT_OVERHEAD_MIB="200")
    assert out["allocated_mib"] == 700


def test_destroying_a_context_gives_back_everything_made_in_it(build: Path, tmp_path: Path) -> None:
    write_limits(tmp_path, limits_text(1024))
    out = mem_paths(tmp_path, "alloc", "link", "destroy", 100, VGPU_CONTEXT_OVERHEAD_MIB="24")
    assert out["allocated_mib"] == 1000
    assert out["free_after_mib"] == 1000  # a fresh context (24 MiB) and nothing else


LEGACY = r"""
import ctypes, sys
cuda = ctypes.CDLL("libcuda.so.1")
assert cuda.cuInit(0) == 0
ctx, p, pitch = ctypes.c_void_p(), ctypes.c_uint(), ctypes.c_uint()
assert cuda.cuCtxCreate(ctypes.byref(ctx), 0, 0) == 0
print(f"alloc={cuda.cuMemAlloc(ctypes.byref(p), 1 << 20)} "
      f"pitch={cuda.cuMemAllocPitch(ctypes.byref(p), ctypes.byref(pitch), 1024, 4, 4)}")
"""


def test_legacy_32_bit_entry_points_are_refused(build: Path, tmp_path: Path) -> None:
    import sys

    write_limits(tmp_path, limits_text(1024))
    proc = run([sys.executable, "-c", LEGACY], tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert summary(proc) == {"alloc": CUDA_ERROR_NOT_SUPPORTED, "pitch": CUDA_ERROR_NOT_SUPPORTED}
    assert "cuMemAlloc (legacy 32-bit entry point) is refused under vgpu" in proc.stderr
