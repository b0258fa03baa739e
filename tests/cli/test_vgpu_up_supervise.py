"""`vgpu up` survives its nats-server being killed and keeps the JetStream store at Ctrl-C.

Real processes throughout: `vgpu up` as a user runs it, its real nats-server child killed
with SIGKILL, `vgpu submit` before and after, and `vgpu up` started again on the same store.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from services.cli.supervisor import Backoff
from tests.cli.test_vgpu_up import ROOT, VGPU, children_of, run_vgpu


def start_up(state: Path, *extra: str) -> subprocess.Popen[str]:
    process = subprocess.Popen(
        [*VGPU, "up", "--allocator-port", "0", "--metrics-port", "0", "--state-file", str(state),
         *extra],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert process.stdout is not None
    lines = []
    for line in process.stdout:
        lines.append(line)
        if line.startswith("ready"):
            return process
    process.kill()
    pytest.fail(f"vgpu up never said ready: {''.join(lines)} {process.stderr.read()}")  # type: ignore[union-attr]


def stop_up(process: subprocess.Popen[str]) -> str:
    """Ctrl-C; returns what it logged."""
    process.send_signal(signal.SIGINT)
    _, stderr = process.communicate(timeout=30)
    assert process.returncode == 0, stderr
    return stderr


def nats_servers_of(pid: int) -> list[int]:
    found = []
    for child in children_of(pid):
        try:
            name = Path(f"/proc/{child}/comm").read_text().strip()
        except FileNotFoundError:
            continue  # exited (and was reaped) since it was listed: the killed server
        if name == "nats-server":
            found.append(child)
    return found


def booked_pods(state: Path) -> set[str]:
    written = json.loads(state.read_text())
    request = urllib.request.Request(
        f"{written['allocator_url']}/allocations",
        headers={"Authorization": f"Bearer {written['admin_token']}"},
    )
    with urllib.request.urlopen(request, timeout=5) as response:
        body = response.read().decode()
    return {name for name in ("half-gpu", "after-restart") if f'"{name}"' in body}


def manifest_named(tmp_path: Path, name: str) -> Path:
    text = (ROOT / "examples" / "half-gpu.yaml").read_text()
    path = tmp_path / f"{name}.yaml"
    path.write_text(text.replace("name: half-gpu", f"name: {name}"))
    return path


def test_backoff_doubles_to_its_bound_and_resets_after_a_long_life() -> None:
    backoff = Backoff(initial_s=0.5, max_s=10.0, reset_after_s=30.0)
    waits, delay = [], None
    for _ in range(7):
        delay = backoff.after(delay, up_for_s=1.0)
        waits.append(delay)
    assert waits == [0.5, 1.0, 2.0, 4.0, 8.0, 10.0, 10.0]
    assert backoff.after(10.0, up_for_s=30.0) == 0.5
    with pytest.raises(ValueError, match="initial_s <= max_s"):
        Backoff(initial_s=5, max_s=1)


def test_killed_nats_is_restarted_and_ctrl_c_keeps_the_store(tmp_path: Path) -> None:
    state = tmp_path / "up.json"
    process = start_up(state)
    try:
        nats_url = json.loads(state.read_text())["nats_url"]
        placed = run_vgpu("submit", "examples/half-gpu.yaml", state=state)
        assert placed.returncode == 0, placed.stderr
        [first] = nats_servers_of(process.pid)

        killed_at = time.monotonic()
        subprocess.run(["kill", "-9", str(first)], check=True)
        deadline = time.monotonic() + 20
        while not (servers := [pid for pid in nats_servers_of(process.pid) if pid != first]):
            assert time.monotonic() < deadline, "nats-server was not restarted within 20s"
            time.sleep(0.1)
        print(f"nats-server back after {time.monotonic() - killed_at:.2f}s (pid {servers})")

        # The clients reconnect to the same URL: a pod submitted now is placed and admitted.
        # Only the bus probe may refuse it (the server not listening yet): a pod once created
        # is scheduled again after kube-scheduler's backoff while the allocator reconnects,
        # never left pending (the next try would then meet AlreadyExists).
        after = manifest_named(tmp_path, "after-restart")
        deadline = time.monotonic() + 30
        while (result := run_vgpu("submit", str(after), state=state)).returncode != 0:
            assert "not placed" not in result.stdout, result.stdout
            assert time.monotonic() < deadline, (
                f"no submit after the restart: {result.stdout} {result.stderr}"
            )
            time.sleep(0.5)
        assert json.loads(state.read_text())["nats_url"] == nats_url
        assert booked_pods(state) == {"half-gpu", "after-restart"}
    finally:
        logged = stop_up(process) if process.poll() is None else ""
    assert "nats-server died (exit status -9); restarting in 0.5s" in logged
    assert "nats-server restarted" in logged
    assert (tmp_path / "up-jetstream" / "jetstream").is_dir(), "Ctrl-C removed the store"

    again = start_up(state)
    try:
        assert booked_pods(state) == {"half-gpu", "after-restart"}, "a restart forgot slices"
    finally:
        stop_up(again)

    fresh = start_up(state, "--fresh")
    try:
        assert booked_pods(state) == set(), "--fresh should forget every slice"
    finally:
        stop_up(fresh)


def test_an_explicit_store_dir_is_used(tmp_path: Path) -> None:
    state, store = tmp_path / "up.json", tmp_path / "my-store"
    process = start_up(state, "--store-dir", str(store))
    try:
        assert json.loads(state.read_text())["nats_store_dir"] == str(store)
    finally:
        stop_up(process)
    assert (store / "jetstream").is_dir()
    assert not (tmp_path / "up-jetstream").exists()


def test_a_second_up_on_the_same_state_file_is_refused(tmp_path: Path) -> None:
    state = tmp_path / "up.json"
    state.write_text(
        '{"nats_url": "", "api_url": "", "allocator_url": "", "metrics_url": "", '
        f'"kubelets": {{}}, "work_dir": "", "pid": {os.getpid()}}}'
    )
    result = run_vgpu("up", state=state)
    assert result.returncode == 1
    assert f"`vgpu up` (pid {os.getpid()}) already runs with {state}" in result.stderr
    assert not (tmp_path / "up-jetstream").exists()


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q", "-s"]))
