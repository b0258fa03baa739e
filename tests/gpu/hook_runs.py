"""Runs a workload of hook_workloads.py under libvgpu-hook on a real GPU, as a container
would: a limits file the node agent would write, the hook preloaded. Shared by
tests/gpu/test_hook_gpu.py (the checks) and bench/hook_gpu.py (the figures)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from statistics import median

from tests.hook.harness import HOOK

WORKLOADS = Path(__file__).with_name("hook_workloads.py")


def gpu_uuid() -> str | None:
    """GPU 0's UUID, or None without an NVIDIA GPU."""
    if not shutil.which("nvidia-smi"):
        return None
    out = subprocess.run(
        ["nvidia-smi", "--query-gpu=uuid", "--format=csv,noheader"], capture_output=True, text=True
    )
    return out.stdout.split()[0] if out.returncode == 0 and out.stdout.strip() else None


def container(root: Path, name: str, uuid: str, *, mib: int, cores: int) -> Path:
    """A container directory holding the limits file for one GPU."""
    d = root / name
    d.mkdir()
    (d / "limits").write_text(
        f"version=1\ndevice_count=1\ndevice.0.uuid={uuid}\n"
        f"device.0.memory_limit_mib={mib}\ndevice.0.cores={cores}\n"
    )
    return d


def env(container_dir: Path | None) -> dict[str, str]:
    """The environment of a process in that container (None: no hook, the bare card)."""
    e = {k: v for k, v in os.environ.items() if not k.startswith("VGPU_") and k != "LD_PRELOAD"}
    e["CUDA_VISIBLE_DEVICES"] = "0"
    if container_dir is not None:
        e |= {"LD_PRELOAD": str(HOOK), "VGPU_CONTAINER_DIR": str(container_dir)}
    return e


def figures(stdout: str) -> dict[str, str]:
    """The key=value figures of a workload's last line."""
    return dict(re.findall(r"(\w+)=(\S+)", stdout.strip().splitlines()[-1]))


def workload(container_dir: Path | None, *args: object) -> dict[str, str]:
    proc = subprocess.run(
        [sys.executable, str(WORKLOADS), *map(str, args)],
        env=env(container_dir),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return figures(proc.stdout)


def start_workload(container_dir: Path | None, *args: object) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, str(WORKLOADS), *map(str, args)],
        env=env(container_dir),
        stdout=subprocess.PIPE,
        text=True,
    )


@contextmanager
def smi_samples(period_ms: int = 500) -> Iterator[list[tuple[float, float, float]]]:
    """nvidia-smi's (utilization %, SM clock MHz, power W) of GPU 0 every period_ms while
    the block runs; the list fills when the block ends."""
    proc = subprocess.Popen(
        [
            "nvidia-smi",
            "--query-gpu=utilization.gpu,clocks.sm,power.draw",
            "--format=csv,noheader,nounits",
            "-lms",
            str(period_ms),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    samples: list[tuple[float, float, float]] = []
    try:
        yield samples
    finally:
        proc.terminate()
        out, _ = proc.communicate(timeout=30)
        for line in out.splitlines():
            try:
                util, clock, power = (float(f) for f in line.split(","))
            except ValueError:
                continue  # "[N/A]" or a line cut off by the terminate
            samples.append((util, clock, power))


def busy_median(samples: list[tuple[float, float, float]]) -> tuple[float, float, float]:
    """Medians over the samples where the GPU was busy, leaving out the first two of them
    (the ramp while the workload warms up); zeros when it never was."""
    busy = [s for s in samples if s[0] > 0][2:]
    if not busy:
        return 0.0, 0.0, 0.0
    util, clock, power = zip(*busy, strict=True)
    return median(util), median(clock), median(power)
