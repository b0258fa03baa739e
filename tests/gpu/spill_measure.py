"""Virtual device memory on a real GPU: a kernel's throughput over a buffer on the card and
over the same buffer spilled to managed memory, because a neighbour filled the card (used by
tests/gpu/test_virtual_memory_gpu.py and bench/hook_virtual_memory.py)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

WORKLOAD = Path(__file__).with_name("spill_workload.py")
SLICE_MIB = 8192  # the container's slice
BUFFER_MIB = 4096  # one buffer, well inside it
LEFT_FREE_MIB = 1024  # what the neighbour leaves free on the card: less than the buffer
ITERATIONS = 20


def gpu() -> tuple[str, int, int] | None:
    """(uuid, total MiB, free MiB) of GPU 0, or None without one."""
    if not shutil.which("nvidia-smi"):
        return None
    out = subprocess.run(
        [
            "nvidia-smi",
            "--query-gpu=uuid,memory.total,memory.free",
            "--format=csv,noheader,nounits",
        ],
        capture_output=True,
        text=True,
    )
    if out.returncode != 0 or not out.stdout.strip():
        return None
    uuid, total, free = (f.strip() for f in out.stdout.splitlines()[0].split(","))
    return uuid, int(total), int(free)


def container(root: Path, name: str, uuid: str, virtual_memory: bool) -> Path:
    """A container directory with the limit file the agent writes (scaling > 1: virtual)."""
    d = root / name
    d.mkdir()
    text = (
        f"version=1\ndevice_count=1\ndevice.0.uuid={uuid}\n"
        f"device.0.memory_limit_mib={SLICE_MIB}\ndevice.0.cores=100\n"
    )
    if virtual_memory:
        text += "device.0.virtual_memory=1\nspill_limit_mib=16384\n"
    (d / "limits").write_text(text)
    return d


def env(hook: Path | None, container_dir: Path | None) -> dict[str, str]:
    e = {k: v for k, v in os.environ.items() if not k.startswith("VGPU_") and k != "LD_PRELOAD"}
    e["CUDA_VISIBLE_DEVICES"] = "0"
    if hook is not None and container_dir is not None:
        e |= {"LD_PRELOAD": str(hook), "VGPU_CONTAINER_DIR": str(container_dir)}
    return e


def bench(hook: Path, container_dir: Path) -> dict[str, str]:
    proc = subprocess.run(
        [sys.executable, str(WORKLOAD), "bench", str(BUFFER_MIB), str(ITERATIONS)],
        env=env(hook, container_dir),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return dict(re.findall(r"(\w+)=(\S+)", proc.stdout.strip().splitlines()[-1]))


@contextmanager
def card_filled(free_mib: int) -> Iterator[int]:
    """A process without the hook holding all but LEFT_FREE_MIB of the card; yields MiB held."""
    proc = subprocess.Popen(
        [sys.executable, str(WORKLOAD), "hold", str(max(0, free_mib - LEFT_FREE_MIB))],
        env=env(None, None),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None and proc.stderr is not None
        first = proc.stdout.readline()
        assert first.startswith("held="), first + proc.stderr.read()
        yield int(first.split("=")[1])
    finally:
        proc.communicate(timeout=60)


@dataclass(frozen=True)
class Figures:
    model_total_mib: int
    device_gbps: float
    spilled_gbps: float
    spilled_managed: bool
    plain_result: int  # the same allocation with memory scaling 1: the driver's answer


def measure(hook: Path, root: Path) -> Figures:
    found = gpu()
    assert found is not None, "no NVIDIA GPU"
    uuid, total, _ = found
    virtual = container(root, "virtual", uuid, virtual_memory=True)
    plain = container(root, "plain", uuid, virtual_memory=False)
    on_card = bench(hook, virtual)
    assert on_card["result"] == "0" and on_card["managed"] == "0", on_card
    free = gpu()
    assert free is not None
    with card_filled(free[2]):
        spilled = bench(hook, virtual)
        refused = bench(hook, plain)
    return Figures(
        model_total_mib=total,
        device_gbps=float(on_card["gbps"]),
        spilled_gbps=float(spilled["gbps"]),
        spilled_managed=spilled.get("managed") == "1" and spilled["result"] == "0",
        plain_result=int(refused["result"]),
    )
