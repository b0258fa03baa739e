"""`vgpu up --mode ...` and `vgpu submit` as a user runs them (real processes)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
VGPU = [sys.executable, "-m", "services.cli.main"]


@pytest.mark.parametrize(
    ("mode", "manifest", "expected"),
    [
        ("mps", "examples/half-gpu.yaml",
         ["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=50", "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=20480M",
          "-> /mps/pipe (rw)", "limits: no hook"]),
        ("time-slicing", "examples/time-slicing.yaml",
         ["NVIDIA_VISIBLE_DEVICES=GPU-", "limits: no hook"]),
    ],
)  # fmt: skip
def test_up_with_a_mode_serves_a_pod(
    tmp_path: Path, mode: str, manifest: str, expected: list[str]
) -> None:
    state = tmp_path / "up.json"
    process = subprocess.Popen(
        [*VGPU, "up", "--mode", mode, "--nodes", "1", "--allocator-port", "0",
         "--metrics-port", "0", "--state-file", str(state)],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert process.stdout is not None
        lines = []
        for line in process.stdout:
            lines.append(line)
            if line.startswith("ready"):
                break
        assert f"mode       {mode}" in "".join(lines), "".join(lines)
        placed = subprocess.run(
            [*VGPU, "submit", manifest, "--state-file", str(state)],
            cwd=ROOT, capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert placed.returncode == 0, placed.stdout + placed.stderr
        for text in expected:
            assert text in placed.stdout, placed.stdout
    finally:
        process.send_signal(2)
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def test_up_refuses_an_unknown_mode(tmp_path: Path) -> None:
    refused = subprocess.run(
        [*VGPU, "up", "--mode", "slices", "--state-file", str(tmp_path / "up.json")],
        cwd=ROOT, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert refused.returncode == 2 and "'slices' is not one of" in refused.stderr
