"""The simulated GPU lists each process's real device memory, as NVML does on hardware:
through the simulated libnvidia-ml.so.1 (read here by the agent's own NVML backend over
pynvml) and through the agent's simulated backend, hook or no hook."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from services.nodeagent.gpus import SimulatedGpuBackend
from services.nodeagent.gpus.simulated import simulated_uuid
from tests.hook.harness import (
    SANITIZE,
    SIM_DIR,
    holding,
    hook_env,
    limits_text,
    summary,
    tool,
    write_limits,
)

# Python loads the simulated NVML here; a sanitized build needs its runtime loaded first.
pytestmark = pytest.mark.skipif(SANITIZE, reason="loads the simulated libraries into Python")

SMALL_GPU = {"VGPU_SIM_GPUS": "1x4096"}

# The agent's real NVML backend over pynvml, in a process whose libnvidia-ml.so.1 is the
# simulated one (as the agent's would be on a node with the simulated driver).
NVML_PROBE = """
import json, pynvml
from services.nodeagent.gpus.nvml import NvmlGpuBackend
backend = NvmlGpuBackend(pynvml)
backend.open()
print(json.dumps({
    "processes": [[p.pid, p.uuid, p.memory_used_mib] for p in backend.processes()],
    "used": [[u.uuid, u.memory_used_mib] for u in backend.usage()],
}))
backend.close()
"""


def nvml_view(sim_state: Path, **extra: str) -> dict[str, list[list[object]]]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("VGPU_") and k != "LD_PRELOAD"}
    env |= {"LD_LIBRARY_PATH": str(SIM_DIR), "VGPU_SIM_STATE_DIR": str(sim_state), **extra}
    proc = subprocess.run(
        [sys.executable, "-c", NVML_PROBE],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        cwd=Path(__file__).resolve().parents[2],
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def test_nvml_lists_each_process_with_what_the_driver_gave_it(build: Path, tmp_path: Path) -> None:
    hooked, bare, sim = tmp_path / "hooked", tmp_path / "bare", tmp_path / "sim"
    hooked.mkdir(), bare.mkdir()
    write_limits(hooked, limits_text(1024))
    common = {"VGPU_SIM_STATE_DIR": str(sim), **SMALL_GPU}
    assert nvml_view(sim, **SMALL_GPU)["processes"] == []
    with holding(hooked, "alloc", "link", "create", 100, "hold", **common) as inside:
        # A second program without the hook (LD_PRELOAD unset) takes what the card has left
        # (the simulated card is shared: 4096 MiB less the 1000 the first one holds).
        bypass = subprocess.Popen(
            [tool("mem_paths"), "alloc", "link", "create", "100", "hold"],
            env=hook_env(bare, hook=False, **common),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            assert bypass.stdout is not None
            assert summary(bypass.stdout.readline())["allocated_mib"] == 3000
            view = nvml_view(sim, **SMALL_GPU)
            uuid = "GPU-5e4c0000-0000-4000-8000-000000000000"
            assert sorted(view["processes"]) == sorted(
                [[inside.pid, uuid, 1000], [bypass.pid, uuid, 3000]]
            )
            # A process that dies (SIGKILL: no exit path runs) is gone from the list at once.
            bypass.send_signal(signal.SIGKILL)
            bypass.wait(timeout=30)
            view = nvml_view(sim, **SMALL_GPU)
            assert view == {"processes": [[inside.pid, uuid, 1000]], "used": [[uuid, 1000]]}
        finally:
            if bypass.poll() is None:
                bypass.kill()
                bypass.wait(timeout=30)
    # Everything given back at exit: the process is gone.
    assert nvml_view(sim, **SMALL_GPU) == {"processes": [], "used": [[uuid, 0]]}


def test_agent_backend_reads_the_driver_by_uuid(build: Path, tmp_path: Path) -> None:
    """The agent's simulated GPUs list the driver's processes of the container's GPUs, which
    the container sees renumbered (its only GPU is its device 0)."""
    sim, container = tmp_path / "sim", tmp_path / "c"
    container.mkdir()
    backend = SimulatedGpuBackend("node-x", "2xA100-40GB", driver_state_dir=sim)
    second = simulated_uuid("node-x", 1)
    write_limits(container, limits_text(4096, uuids=[second]))
    env = {"VGPU_SIM_STATE_DIR": str(sim), "VGPU_SIM_UUIDS": second}
    with holding(container, "alloc", "link", "create", 512, "hold", **env) as proc:
        listed = [(p.pid, p.uuid, p.memory_used_mib) for p in backend.processes()]
        assert listed == [(proc.pid, second, 4096)]
        used = {u.uuid: u.memory_used_mib for u in backend.usage()}
        assert used == {simulated_uuid("node-x", 0): 0, second: 4096}
    assert backend.processes() == []


def test_a_process_reading_nvml_sees_itself(build: Path, tmp_path: Path) -> None:
    """A process's own lock never conflicts with itself; the simulated NVML still lists it."""
    sim = tmp_path / "sim"
    program = (
        "import ctypes, os, sys\n"
        f"cuda = ctypes.CDLL('{SIM_DIR / 'libcuda.so.1'}')\n"
        f"nvml = ctypes.CDLL('{SIM_DIR / 'libnvidia-ml.so.1'}')\n"
        "assert cuda.cuInit(0) == 0\n"
        "ctx, ptr = ctypes.c_void_p(), ctypes.c_uint64()\n"
        "assert cuda.cuCtxCreate_v2(ctypes.byref(ctx), 0, 0) == 0\n"
        "assert cuda.cuMemAlloc_v2(ctypes.byref(ptr), ctypes.c_size_t(300 << 20)) == 0\n"
        "assert nvml.nvmlInit_v2() == 0\n"
        "dev, n = ctypes.c_void_p(), ctypes.c_uint(8)\n"
        "assert nvml.nvmlDeviceGetHandleByIndex_v2(0, ctypes.byref(dev)) == 0\n"
        "class Info(ctypes.Structure):\n"
        "    _fields_ = [('pid', ctypes.c_uint), ('used', ctypes.c_ulonglong),\n"
        "                ('gi', ctypes.c_uint), ('ci', ctypes.c_uint)]\n"
        "infos = (Info * 8)()\n"
        "assert nvml.nvmlDeviceGetComputeRunningProcesses_v3(dev, ctypes.byref(n), infos) == 0\n"
        "print(os.getpid(), sorted((infos[i].pid, infos[i].used >> 20) for i in range(n.value)))\n"
    )
    env = hook_env(tmp_path, sim, hook=False)
    proc = subprocess.run(
        [sys.executable, "-c", program], env=env, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    pid, _, listed = proc.stdout.strip().partition(" ")
    assert listed == f"[({pid}, 300)]", proc.stdout
