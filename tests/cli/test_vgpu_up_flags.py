"""`vgpu up` takes the 4paradigm plugin's scaling flags and Node labels for the simulated
nodes, as a user runs it (real processes): oversubscribed memory places what one card could
not hold, and a node labelled `vgpu.io/mode` serves in that mode."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
VGPU = [sys.executable, "-m", "services.cli.main"]


@contextmanager
def vgpu_up(state: Path, *flags: str) -> Iterator[str]:
    process = subprocess.Popen(
        [*VGPU, "up", "--nodes", "1", "--simulate", "1xA100-40GB", "--allocator-port", "0",
         "--metrics-port", "0", "--extender-port", "0", "--state-file", str(state), *flags],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert process.stdout is not None
        lines = []
        for line in process.stdout:
            lines.append(line)
            if line.startswith("ready"):
                break
        assert lines and lines[-1].startswith("ready"), "".join(lines) + process.stderr.read()
        yield "".join(lines)
    finally:
        process.send_signal(2)
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def pod_file(tmp_path: Path, name: str, limits: dict[str, int]) -> Path:
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name},
        "spec": {"containers": [{"name": "c", "image": "cuda", "resources": {"limits": limits}}]},
    }
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(pod))
    return path


def submit(manifest: Path, state: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*VGPU, "submit", str(manifest), "--state-file", str(state)],
        cwd=ROOT, capture_output=True, text=True, timeout=60,
    )  # fmt: skip


def test_scaling_flags_and_a_mode_label_reach_the_nodes(tmp_path: Path) -> None:
    state = tmp_path / "up.json"
    big = {"nvidia.com/gpu": 1, "nvidia.com/gpumem": 30000, "nvidia.com/gpucores": 60}
    with vgpu_up(
        state, "--device-split-count", "3", "--device-memory-scaling", "2",
        "--device-cores-scaling", "2",
    ):  # fmt: skip
        # 2 x 30000 MiB on a 40960 MiB card, 2 x 60 % compute: only with both scalings.
        for name in ("big-1", "big-2"):
            placed = submit(pod_file(tmp_path, name, big), state)
            assert placed.returncode == 0, placed.stdout + placed.stderr
        # A third fits the split count (3) and compute (180 of 200 %), not memory (3 x 30000
        # MiB is more than twice the card).
        third = submit(pod_file(tmp_path, "big-3", big), state)
        assert third.returncode == 1 and "0/1 nodes are available" in third.stderr + third.stdout
        inspected = subprocess.run(
            [*VGPU, "inspect", "--state-file", str(state)],
            cwd=ROOT, capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert inspected.returncode == 0, inspected.stderr
        assert "oversubscribed x2" in inspected.stdout, inspected.stdout
        assert "120/200%" in inspected.stdout, inspected.stdout


def test_a_node_label_sets_the_mode_under_vgpu_up(tmp_path: Path) -> None:
    state = tmp_path / "up.json"
    with vgpu_up(state, "--node-label", "node-1:vgpu.io/mode=exclusive") as banner:
        assert "mode exclusive" in banner, banner
        half = submit(ROOT / "examples" / "half-gpu.yaml", state)
        assert (
            half.returncode == 1 and "exclusive GPUs are given whole" in half.stdout + half.stderr
        )
        whole = submit(ROOT / "examples" / "time-slicing.yaml", state)
        assert whole.returncode == 0, whole.stdout + whole.stderr


def test_bad_flags_are_refused_by_name(tmp_path: Path) -> None:
    for flags, said in (
        (["--device-memory-scaling", "0"], "--device-memory-scaling"),
        (["--device-split-count", "0"], "--device-split-count"),
        (["--node-label", "node-9:vgpu.io/mode=mps"], "no node 'node-9'"),
    ):
        refused = subprocess.run(
            [*VGPU, "up", *flags, "--state-file", str(tmp_path / "up.json")],
            cwd=ROOT, capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert refused.returncode == 2 and said in refused.stderr, refused.stderr
