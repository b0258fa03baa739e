"""`vgpu delete` and AlreadyExists as kubectl's, under a real `vgpu up`: deleting frees the
slice and the kubelet's devices at once, a second submit of a live pod is refused, and the
pending list is what the local API server has waiting (a deleted pending pod leaves it)."""

from __future__ import annotations

import json
import time
import urllib.request
from pathlib import Path
from typing import Any

from tests.cli.test_vgpu_up import run_vgpu
from tests.cli.test_vgpu_up_supervise import start_up, stop_up


def get_json(url: str, token: str = "") -> Any:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    with urllib.request.urlopen(
        urllib.request.Request(url, headers=headers), timeout=5
    ) as response:
        return json.loads(response.read())


def wait_for(condition: Any, what: str, timeout_s: float = 15) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def test_delete_frees_the_slice_and_a_live_pod_cannot_be_submitted_twice(tmp_path: Path) -> None:
    state = tmp_path / "up.json"
    process = start_up(state)
    try:
        urls = json.loads(state.read_text())
        token = urls["admin_token"]  # /allocations and the metrics API check tokens

        def booked() -> set[str]:
            return {a["name"] for a in get_json(f"{urls['allocator_url']}/allocations", token)}

        placed = run_vgpu("submit", "examples/half-gpu.yaml", state=state)
        assert placed.returncode == 0, placed.stderr
        node = placed.stdout.split("placed on node ")[1].split()[0]
        kubelet = urls["kubelets"][node]
        assert "half-gpu" in booked()

        twice = run_vgpu("submit", "examples/half-gpu.yaml", state=state)
        assert twice.returncode == 1
        assert (
            'Error from server (AlreadyExists): error when creating "examples/half-gpu.yaml": '
            'pods "half-gpu" already exists'
        ) in twice.stderr, twice.stderr
        assert [a["name"] for a in get_json(f"{urls['allocator_url']}/allocations", token)].count(
            "half-gpu"
        ) == 1, "booked twice"

        deleted = run_vgpu("delete", "half-gpu", "-n", "default", state=state)
        assert deleted.returncode == 0, deleted.stderr
        assert deleted.stdout.strip() == 'pod "half-gpu" deleted'
        wait_for(lambda: "half-gpu" not in booked(), "the slice freed")
        wait_for(lambda: not get_json(f"{kubelet}/pods"), "the kubelet to stop the pod")
        again = run_vgpu("submit", "examples/half-gpu.yaml", state=state)
        assert again.returncode == 0, again.stderr

        missing = run_vgpu("delete", "nope", state=state)
        assert missing.returncode == 1
        assert 'Error from server (NotFound): pods "nope" not found' in missing.stderr

        # Pending is what the API server has waiting: shown until the pod is deleted.
        refused = run_vgpu("submit", "examples/cannot-fit.yaml", state=state)
        assert refused.returncode == 1 and "vgpu delete" in refused.stdout

        def pending() -> list[str]:
            return [p["name"] for p in get_json(f"{urls['metrics_url']}/api/v1/pending", token)]

        wait_for(lambda: pending() == ["cannot-fit"], "the pending pod shown")
        assert run_vgpu("delete", "cannot-fit", state=state).returncode == 0
        wait_for(lambda: pending() == [], "the deleted pod to leave the pending list")
    finally:
        stop_up(process)
