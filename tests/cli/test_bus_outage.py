"""A bus outage is visible: the gauge, readiness, `vgpu submit` and `vgpu inspect` say so.

The test owns a real nats-server, runs `vgpu up --nats-url` on it, stops the server, and
watches what every surface reports; then starts it again (same port, same store) and sees
everything recover by itself.
"""

from __future__ import annotations

import json
import re
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from services.common.embedded_nats import EmbeddedNats
from tests.cli.test_vgpu_up import run_vgpu
from tests.cli.test_vgpu_up_supervise import manifest_named, start_up, stop_up

GAUGE = re.compile(r'^vgpu_nats_connected\{client="([^"]+)"\} ([0-9.]+)$', re.MULTILINE)


def gauges(allocator_url: str, token: str) -> dict[str, float]:
    request = urllib.request.Request(f"{allocator_url}/metrics",
                                     headers={"Authorization": f"Bearer {token}"})  # fmt: skip
    with urllib.request.urlopen(request, timeout=5) as response:
        text = response.read().decode()
    return {client: float(value) for client, value in GAUGE.findall(text)}


def wait_for_gauges(
    allocator_url: str, token: str, value: float, timeout_s: float = 20
) -> dict[str, float]:
    deadline = time.monotonic() + timeout_s
    while True:
        seen = gauges(allocator_url, token)
        if seen and all(v == value for v in seen.values()):
            return seen
        assert time.monotonic() < deadline, f"vgpu_nats_connected never all {value}: {seen}"
        time.sleep(0.2)


def _authorized(url: str, token: str) -> urllib.request.Request:
    return urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"})


def bus_badge(metrics_url: str, token: str) -> dict[str, object]:
    """The `bus` frame the dashboard's live stream sends right after its snapshot."""
    request = _authorized(f"{metrics_url}/api/v1/events", token)
    with urllib.request.urlopen(request, timeout=10) as stream:
        event = ""
        for raw in stream:
            line = raw.decode().rstrip("\n")
            if line.startswith("event: "):
                event = line.removeprefix("event: ")
            elif line.startswith("data: ") and event == "bus":
                return json.loads(line.removeprefix("data: "))
    raise AssertionError("the stream ended without a bus frame")


def picture(metrics_url: str, token: str) -> dict[str, object]:
    request = _authorized(f"{metrics_url}/api/v1/picture", token)
    with urllib.request.urlopen(request, timeout=5) as response:
        return json.loads(response.read())


def readiness(allocator_url: str) -> tuple[int, dict[str, object]]:
    try:
        with urllib.request.urlopen(f"{allocator_url}/readyz", timeout=5) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def test_a_stopped_nats_is_reported_everywhere_and_everything_recovers(tmp_path: Path) -> None:
    store = str(tmp_path / "nats")
    nats = EmbeddedNats(store_dir=store).start()
    state = tmp_path / "up.json"
    process = start_up(state, "--nats-url", nats.url)
    try:
        urls = json.loads(state.read_text())
        allocator, token = urls["allocator_url"], urls["admin_token"]
        assert run_vgpu("submit", "examples/half-gpu.yaml", state=state).returncode == 0
        up = wait_for_gauges(allocator, token, 1.0)
        assert "vgpu-metrics" in up and any(c.startswith("vgpu-allocator") for c in up), up
        assert readiness(allocator)[0] == 200
        metrics = urls["metrics_url"]
        assert bus_badge(metrics, token)["connected"] is True

        nats.stop()
        down = wait_for_gauges(allocator, token, 0.0)
        assert set(down) == set(up)
        status, ready = readiness(allocator)
        assert status == 503 and ready["nats_connected"] is False
        assert isinstance(ready["nats_down_since"], float)
        badge = bus_badge(metrics, token)  # the dashboard: "bus down since <time>", not "live"
        assert badge["connected"] is False and badge["nats_url"] == nats.url
        assert badge["nats_down_since"] == pytest.approx(ready["nats_down_since"], abs=5)

        refused = run_vgpu("submit", str(manifest_named(tmp_path, "during")), state=state)
        assert refused.returncode == 1
        assert f"the bus (NATS at {nats.url}) is unreachable" in refused.stderr, refused.stderr
        assert "node agent" not in refused.stderr + refused.stdout

        inspected = run_vgpu("inspect", state=state)
        assert inspected.returncode == 0, inspected.stderr
        assert f"the bus (NATS at {nats.url}) is unreachable since" in inspected.stderr

        nats = EmbeddedNats(port=nats.port, store_dir=store).start()  # same port, same store
        wait_for_gauges(allocator, token, 1.0, timeout_s=30)
        deadline = time.monotonic() + 30  # the leader lease is taken again within its TTL
        while (ready_again := readiness(allocator))[0] != 200:
            assert time.monotonic() < deadline, f"not ready after the bus came back: {ready_again}"
            time.sleep(0.2)
        # Everyone resynchronised: the agents re-sent their inventory at once (every node is
        # fresh in the picture and available to the allocator), the slice booked before the
        # outage is still shown, and the dashboard is live again.
        back_at = time.time()
        deadline = time.monotonic() + 10
        while True:
            seen = picture(metrics, token)
            nodes = {n["name"]: n for n in seen["nodes"]}  # type: ignore[index]
            fresh = all(n["state"] == "up" and n["silent_s"] < 4.5 for n in nodes.values())
            if len(nodes) == 2 and fresh:
                break
            assert time.monotonic() < deadline, f"the agents did not re-send: {nodes}"
            time.sleep(0.2)
        assert "half-gpu" in {p["name"] for p in seen["pods"]}  # type: ignore[index]
        assert bus_badge(metrics, token)["connected"] is True
        with urllib.request.urlopen(
            _authorized(f"{allocator}/metrics", token), timeout=5
        ) as response:
            text = response.read().decode()
        assert re.search(r'vgpu_allocator_nodes\{[^}]*state="available"[^}]*\} 2\.0', text)
        print(f"picture fresh {time.time() - back_at:.1f}s after the bus came back")
        after = manifest_named(tmp_path, "after")
        deadline = time.monotonic() + 30
        while (placed := run_vgpu("submit", str(after), state=state)).returncode != 0:
            assert time.monotonic() < deadline, f"no submit after the bus came back: {placed}"
            time.sleep(0.5)
        assert "unreachable" not in run_vgpu("inspect", state=state).stderr
    finally:
        logged = stop_up(process) if process.poll() is None else ""
        nats.stop()
    assert "the bus is down: lost NATS at" in logged
    assert "the bus is back: reconnected to NATS at" in logged
