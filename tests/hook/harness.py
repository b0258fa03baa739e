"""Running real processes under the real preloaded hook and the simulated driver.

The C code is built once per session by libvgpu-hook/build.sh (the `build` fixture in
conftest.py). SANITIZE=1 in the environment builds with ASan+UBSan into build/sanitize/
and preloads the sanitizer runtime ahead of the hook.
"""

from __future__ import annotations

import os
import re
import subprocess
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
HOOK_DIR = ROOT / "libvgpu-hook"
SANITIZE = os.environ.get("SANITIZE") == "1"
BUILD = HOOK_DIR / "build" / "sanitize" if SANITIZE else HOOK_DIR / "build"
HOOK = BUILD / "libvgpu.so"
SIM_DIR = BUILD / "sim"
TESTS = BUILD / "tests"

CUDA_SUCCESS = 0
CUDA_ERROR_INVALID_VALUE = 1
CUDA_ERROR_OUT_OF_MEMORY = 2
CUDA_ERROR_NOT_SUPPORTED = 801
SIM_MIB = 40960  # the simulated driver's default device: 1x40960


def build_hook(out: Path = BUILD, sanitize: bool = SANITIZE) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "OUT": str(out), "SANITIZE": "1" if sanitize else "0"}
    return subprocess.run(
        ["sh", str(HOOK_DIR / "build.sh")], capture_output=True, text=True, timeout=600, env=env
    )


def limits_text(*memory_limit_mib: int, cores: int = 50, uuids: list[str] | None = None) -> str:
    lines = ["# written by the node agent", "version=1", "namespace=default", "pod=half-gpu"]
    lines += ["container=main", f"device_count={len(memory_limit_mib)}"]
    for i, mib in enumerate(memory_limit_mib):
        uuid = uuids[i] if uuids else sim_uuid(i)
        lines += [f"device.{i}.uuid={uuid}", f"device.{i}.memory_limit_mib={mib}"]
        lines += [f"device.{i}.cores={cores}"]
    return "\n".join(lines) + "\n"


def sim_uuid(index: int) -> str:
    """The simulated driver's default UUID of a device."""
    return f"GPU-5e4c0000-0000-4000-8000-{index:012x}"


def write_limits(container_dir: Path, text: str) -> Path:
    """Atomically, as the node agent does: write a temp file, then rename."""
    path = container_dir / "limits"
    tmp = container_dir / ".limits.tmp"
    tmp.write_text(text)
    tmp.rename(path)
    return path


def _preload() -> str:
    if not SANITIZE:
        return str(HOOK)
    # The ASan runtime must come first in the process's library list.
    libasan = subprocess.run(
        ["gcc", "-print-file-name=libasan.so"], capture_output=True, text=True, check=True
    ).stdout.strip()
    return f"{libasan}:{HOOK}"


def hook_env(
    container_dir: Path, sim_state: Path | None = None, *, hook: bool = True, **extra: str
) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("VGPU_") and k != "LD_PRELOAD"}
    env["LD_LIBRARY_PATH"] = str(SIM_DIR)
    env["VGPU_CONTAINER_DIR"] = str(container_dir)
    env["VGPU_LIMIT_WAIT_MS"] = "0"  # tests that wait say so
    # One simulated GPU per test, shared only by that test's processes.
    env["VGPU_SIM_STATE_DIR"] = str(sim_state or container_dir / "sim")
    if hook:
        env["LD_PRELOAD"] = _preload()
    if SANITIZE:
        env["ASAN_OPTIONS"] = "detect_leaks=0"  # python leaks by design
    env.update(extra)
    return env


def run(
    argv: list[str], container_dir: Path, *, hook: bool = True, timeout: float = 60, **extra: str
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        argv,
        env=hook_env(container_dir, hook=hook, **extra),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def summary(proc: subprocess.CompletedProcess[str] | str) -> dict[str, int]:
    """The key=<integer> pairs of the program's last line."""
    out = proc if isinstance(proc, str) else proc.stdout
    err = "" if isinstance(proc, str) else f"; rc={proc.returncode}, stderr:\n{proc.stderr}"
    assert out.strip(), f"no output{err}"
    last = out.strip().splitlines()[-1]
    return {k: int(v) for k, v in re.findall(r"(\w+)=(-?\d+)(?:\s|$)", last)}


def tool(name: str) -> str:
    return str(TESTS / name)


@contextmanager
def holding(
    container_dir: Path, *args: object, prefix: Sequence[str] = (), **extra: str
) -> Iterator[subprocess.Popen[str]]:
    """A process that allocates (mem_paths ... hold) and keeps it until its stdin closes;
    `prefix` runs it under another command (a nested PID namespace). The process's first
    line is its `first_line` attribute."""
    proc = subprocess.Popen(
        [*prefix, tool("mem_paths"), *map(str, args)],
        env=hook_env(container_dir, **extra),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None and proc.stderr is not None
        first = proc.stdout.readline()
        assert first.startswith(("holding", "handle=")), first + proc.stderr.read()
        proc.first_line = first  # type: ignore[attr-defined]
        yield proc
    finally:
        if proc.poll() is None:
            proc.communicate(timeout=30)
