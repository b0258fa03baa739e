"""One budget per container across all its processes: the shared region, its robust lock,
reaping of dead processes, and IPC imports counted once."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

from tests.hook.harness import (
    CUDA_ERROR_OUT_OF_MEMORY,
    CUDA_SUCCESS,
    holding,
    hook_env,
    limits_text,
    run,
    summary,
    tool,
    write_limits,
)


def test_two_processes_share_one_limit(build: Path, tmp_path: Path) -> None:
    write_limits(tmp_path, limits_text(1024))
    with holding(tmp_path, "alloc", "link", "create", 100, "hold") as first:
        assert summary(first.first_line) == {"allocated_mib": 1000}  # type: ignore[attr-defined]
        second = run([tool("alloc_limit"), "10"], tmp_path, VGPU_HOOK_QUIET="1")
        out = summary(second)
        assert out["allocated_mib"] == 20  # what the first left: 24 MiB
        assert out["free_mib"] == 4
        assert "used 1020 MiB + asked 10 MiB > limit 1024 MiB" in second.stderr
    # The first gave back on exit: the whole budget again.
    assert summary(run([tool("alloc_limit"), "10"], tmp_path))["allocated_mib"] == 1020


def test_concurrent_processes_never_overshoot_together(build: Path, tmp_path: Path) -> None:
    write_limits(tmp_path, limits_text(1000))
    procs = [
        subprocess.Popen(
            [tool("mem_paths"), "alloc", "link", "create", "10", "hold"],
            env=hook_env(tmp_path, VGPU_HOOK_QUIET="1"),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(8)
    ]
    try:
        held = [summary(p.stdout.readline())["allocated_mib"] for p in procs]  # type: ignore[union-attr]
    finally:
        for p in procs:
            p.communicate(timeout=30)
    assert sum(held) == 1000, held


def test_memory_of_a_killed_process_is_reaped(build: Path, tmp_path: Path) -> None:
    write_limits(tmp_path, limits_text(1024))
    with holding(tmp_path, "alloc", "link", "create", 100, "hold") as victim:
        victim.send_signal(signal.SIGKILL)
        victim.wait(timeout=10)
    # Its 1000 MiB are still charged until someone needs them: the next allocation that
    # would fail reaps the dead process first.
    out = summary(run([tool("alloc_limit"), "10"], tmp_path))
    assert out["allocated_mib"] == 1020


def test_a_process_killed_holding_the_lock_does_not_block_the_next(
    build: Path, tmp_path: Path
) -> None:
    write_limits(tmp_path, limits_text(1024))
    killed = subprocess.run(
        [tool("region_test"), "hold-lock-and-die", str(tmp_path / "hook.region")],
        capture_output=True,
        timeout=30,
    )
    assert killed.returncode == -signal.SIGKILL
    started = time.monotonic()
    proc = run([tool("alloc_limit"), "100"], tmp_path, timeout=30)
    assert time.monotonic() - started < 20
    assert summary(proc)["allocated_mib"] == 1000
    assert "a process died holding the shared accounting lock; recovered it" in proc.stderr


def test_region_file_of_another_layout_falls_back_to_per_process(
    build: Path, tmp_path: Path
) -> None:
    write_limits(tmp_path, limits_text(1024))
    (tmp_path / "hook.region").write_text("left by something else")
    proc = run([tool("alloc_limit"), "100"], tmp_path)
    assert summary(proc)["allocated_mib"] == 1000
    assert "limits apply to each process alone" in proc.stderr


def test_ipc_import_inside_the_container_is_not_counted_twice(build: Path, tmp_path: Path) -> None:
    write_limits(tmp_path, limits_text(1024))
    with holding(tmp_path, "ipc-export", 300) as exporter:
        handle = exporter.first_line.split("=", 1)[1].strip()  # type: ignore[attr-defined]
        out = summary(run([tool("mem_paths"), "ipc-import", handle], tmp_path))
    assert out == {"result": CUDA_SUCCESS, "free_mib": 724, "free_after_mib": 724}


def test_ipc_import_from_another_container_is_counted(build: Path, tmp_path: Path) -> None:
    exporter_dir, importer_dir, small_dir = (tmp_path / n for n in ("a", "b", "c"))
    for d, mib in ((exporter_dir, 1024), (importer_dir, 1024), (small_dir, 200)):
        d.mkdir()
        write_limits(d, limits_text(mib))
    sim = tmp_path / "gpu"
    with holding(exporter_dir, "ipc-export", 300, VGPU_SIM_STATE_DIR=str(sim)) as exporter:
        handle = exporter.first_line.split("=", 1)[1].strip()  # type: ignore[attr-defined]
        counted = run([tool("mem_paths"), "ipc-import", handle], importer_dir)
        refused = run([tool("mem_paths"), "ipc-import", handle], small_dir)
    assert summary(counted) == {"result": CUDA_SUCCESS, "free_mib": 724, "free_after_mib": 1024}
    assert summary(refused)["result"] == CUDA_ERROR_OUT_OF_MEMORY
    assert "used 0 MiB + asked 300 MiB > limit 200 MiB" in refused.stderr


def test_forked_child_does_not_give_back_its_parents_memory(build: Path, tmp_path: Path) -> None:
    write_limits(tmp_path, limits_text(1024))
    script = f"""
import ctypes, os, subprocess
cuda = ctypes.CDLL("libcuda.so.1")
assert cuda.cuInit(0) == 0
ctx, p = ctypes.c_void_p(), ctypes.c_ulonglong()
assert cuda.cuCtxCreate_v2(ctypes.byref(ctx), 0, 0) == 0
assert cuda.cuMemAlloc_v2(ctypes.byref(p), ctypes.c_size_t(600 << 20)) == 0
if os.fork() == 0:
    os._exit(0)  # runs the hook's exit handlers in the child
os.wait()
out = subprocess.run([{tool("alloc_limit")!r}, "100"], capture_output=True, text=True)
print(out.stdout.strip())
"""
    import sys

    proc = run([sys.executable, "-c", script], tmp_path, VGPU_HOOK_QUIET="1")
    assert proc.returncode == 0, proc.stderr
    assert summary(proc)["allocated_mib"] == 400, proc.stdout
    assert os.path.exists(tmp_path / "hook.region")
