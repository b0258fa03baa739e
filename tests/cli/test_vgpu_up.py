"""`vgpu up` and `vgpu submit` as a user runs them: real processes, real signals."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
VGPU = [sys.executable, "-m", "services.cli.main"]


def children_of(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(entry.name))
    return found


def run_vgpu(*args: str, state: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*VGPU, *args, "--state-file", str(state)],
        cwd=ROOT, capture_output=True, text=True, timeout=60,
    )  # fmt: skip


@pytest.fixture
def running_up(tmp_path: Path) -> Iterator[tuple[subprocess.Popen[str], Path, float]]:
    state = tmp_path / "up.json"
    started = time.monotonic()
    process = subprocess.Popen(
        [*VGPU, "up", "--allocator-port", "0", "--metrics-port", "0", "--state-file", str(state)],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert process.stdout is not None
    lines = []
    for line in process.stdout:
        lines.append(line)
        if line.startswith("ready"):
            break
    else:
        process.kill()
        pytest.fail(f"vgpu up never said ready: {''.join(lines)} {process.stderr.read()}")
    yield process, state, time.monotonic() - started
    if process.poll() is None:
        process.kill()
        process.wait()


def test_up_is_ready_quickly_submit_places_and_ctrl_c_leaves_nothing(
    running_up: tuple[subprocess.Popen[str], Path, float],
) -> None:
    process, state, ready_after = running_up
    assert ready_after < 15, f"ready after {ready_after:.1f}s"
    helpers = children_of(process.pid)
    assert helpers, "the embedded nats-server should run as a child"
    work_dir = Path(json.loads(state.read_text())["work_dir"])

    placed = run_vgpu("submit", "examples/half-gpu.yaml", state=state)
    assert placed.returncode == 0, placed.stderr
    assert "pod default/half-gpu: placed on node node-" in placed.stdout
    assert "NVIDIA_VISIBLE_DEVICES=GPU-" in placed.stdout
    assert "device.0.memory_limit_mib=20480" in placed.stdout

    refused = run_vgpu("submit", "examples/cannot-fit.yaml", state=state)
    assert refused.returncode == 1
    assert "not placed" in refused.stdout and "can never fit" in refused.stdout

    # The README's curl examples: the state file's admin token opens the read APIs.
    written = json.loads(state.read_text())
    token = run_vgpu("token", state=state)
    assert token.returncode == 0 and token.stdout.strip() == written["admin_token"]
    allocations = f"{written['allocator_url']}/allocations"
    with pytest.raises(urllib.error.HTTPError) as anonymous:
        urllib.request.urlopen(allocations, timeout=5)
    assert anonymous.value.code == 401
    request = urllib.request.Request(allocations, headers={
        "Authorization": f"Bearer {token.stdout.strip()}"})  # fmt: skip
    with urllib.request.urlopen(request, timeout=5) as response:
        assert b'"half-gpu"' in response.read()

    process.send_signal(signal.SIGINT)
    assert process.wait(timeout=15) == 0
    time.sleep(0.2)
    for pid in helpers:
        assert not Path(f"/proc/{pid}").exists(), f"pid {pid} outlived vgpu up"
    assert not state.exists()
    assert not work_dir.exists()


def test_submit_without_a_running_system_says_so(tmp_path: Path) -> None:
    result = run_vgpu("submit", "examples/half-gpu.yaml", state=tmp_path / "absent.json")
    assert result.returncode == 1
    assert "no running `vgpu up` found" in result.stderr


def test_submit_names_what_is_wrong_with_a_manifest(tmp_path: Path) -> None:
    state = tmp_path / "up.json"
    state.write_text(
        '{"nats_url": "", "api_url": "", "allocator_url": "", "metrics_url": "", '
        f'"kubelets": {{}}, "work_dir": "", "pid": {os.getpid()}}}'
    )
    manifest = tmp_path / "deployment.yaml"
    manifest.write_text("apiVersion: apps/v1\nkind: Deployment\nmetadata:\n  name: x\n")
    result = run_vgpu("submit", str(manifest), state=state)
    assert result.returncode == 1
    assert "expected exactly one object of kind Pod, found 0" in result.stderr
    manifest.write_text("kind: Pod\nmetadata: {name: [unclosed\n")
    result = run_vgpu("submit", str(manifest), state=state)
    assert "is not valid YAML" in result.stderr


def test_submit_places_peer_syntaxes_and_fails_a_gpu_pod_left_without_gpu(
    running_up: tuple[subprocess.Popen[str], Path, float], tmp_path: Path
) -> None:
    _, state, _ = running_up
    placed = run_vgpu("submit", "examples/peers/tencent.yaml", state=state)
    assert placed.returncode == 0, placed.stdout + placed.stderr
    assert "pod default/vcuda: placed on node node-" in placed.stdout
    assert "device.0.memory_limit_mib=2560" in placed.stdout
    assert "device.0.cores=20" in placed.stdout

    # Opted out of the webhook: the tencent.com names never become a device request.
    manifest = tmp_path / "opted-out.yaml"
    pod = (ROOT / "examples/peers/tencent.yaml").read_text()
    manifest.write_text(pod.replace("name: vcuda", "name: opted-out\n  labels: "
                                    "{vgpu.io/webhook: disabled}"))  # fmt: skip
    failed = run_vgpu("submit", str(manifest), state=state)
    assert failed.returncode == 1, failed.stdout
    assert "pod default/opted-out: failed on node node-" in failed.stdout
    assert "asked for GPUs but the kubelet allocated none" in failed.stdout
    assert "placed on node" not in failed.stdout
