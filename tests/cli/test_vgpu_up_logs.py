"""What `vgpu up` prints at a terminal names the pod, node, GPU and reason of each event of a
pod's life (issue 15: log lines without the pod, node or reason)."""

from __future__ import annotations

import re
from pathlib import Path

from tests.cli.test_vgpu_up import run_vgpu
from tests.cli.test_vgpu_up_supervise import start_up, stop_up


def line_of(log: str, message: str) -> str:
    found = [line for line in log.splitlines() if f": {message} " in line]
    assert found, f"no {message!r} line in:\n{log}"
    return found[0]


def test_a_pods_life_is_logged_with_its_pod_node_gpu_and_reason(tmp_path: Path) -> None:
    state = tmp_path / "up.json"
    process = start_up(state, "--log-level", "info")
    try:
        placed = run_vgpu("submit", "examples/half-gpu.yaml", state=state)
        assert placed.returncode == 0, placed.stderr
        node = placed.stdout.split("placed on node ")[1].split()[0]
        deleted = run_vgpu("delete", "half-gpu", "-n", "default", state=state)
        assert deleted.returncode == 0, deleted.stderr
    finally:
        log = stop_up(process)
    gpu = r"GPU-[0-9a-f-]+"
    bound = line_of(log, "pod bound")
    assert "pod=default/half-gpu " in bound and f"node={node} " in bound
    assert re.search(rf'slices=.*"{gpu}"', bound), bound
    claimed = line_of(log, "container claimed")
    assert "pod=default/half-gpu" in claimed and f"node={node}" in claimed
    assert re.search(rf'gpus=\["{gpu}"\]', claimed), claimed
    allocated = line_of(log, "allocated")
    assert f"node={node}" in allocated and re.search(rf'gpus=\["{gpu}"\]', allocated), allocated
    # A line the agent logs where its code has no node at hand still names it.
    registered = [line for line in log.splitlines() if ": registered with the kubelet " in line]
    assert sorted(re.findall(r" node=(node-\d)", " ".join(registered))) == ["node-1", "node-2"]
    released = line_of(log, "pod released")
    assert "pod=default/half-gpu" in released and f"node={node}" in released
    assert re.search(rf'gpus=\["{gpu}"\]', released) and "reason=" in released, released
