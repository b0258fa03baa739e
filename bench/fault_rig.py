"""The fault rig of tests/faults and bench/soak.py: real vgpu processes to kill (allocators,
kubelet simulators and node agents as subprocesses on a real nats-server), kube-scheduler's
part played over HTTP, and an audit of what was bound against what JetStream KV and the
allocators hold.

Only the GPUs (the agents' --simulate) and the API server (FakeApiServer, in this process)
are simulated; every vgpu component is the one a user runs.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import msgspec

from services.allocator.journal import KEY_PREFIX, NodeRecords
from services.common.bus import Bus
from services.common.kv_snapshot import read_current
from services.simulators.apiserver import FakeApiServer

ROOT = Path(__file__).resolve().parents[1]
A100_MIB = 40960


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Node:
    name: str
    kubelet: subprocess.Popen[bytes]
    agent: subprocess.Popen[bytes] | None = None


@dataclass
class Processes:
    """Every process a test starts, killed at the end whatever happened."""

    workdir: Path
    nats_url: str
    api_url: str
    started: list[subprocess.Popen[bytes]] = field(default_factory=list)
    nodes: dict[str, Node] = field(default_factory=dict)
    log_level: str = "warning"  # of every process started (their logs: workdir/<name>.log)

    def _spawn(self, log_name: str, *args: str, env: dict[str, str] | None = None) -> Any:
        log = open(self.workdir / f"{log_name}.log", "ab")  # noqa: SIM115 - lives with the child
        process = subprocess.Popen(
            [sys.executable, "-m", "services.cli.main", *args],
            cwd=ROOT,
            env={**os.environ, "VGPU_LOG_LEVEL": self.log_level, **(env or {})},
            stdout=log,
            stderr=log,
        )
        log.close()
        self.started.append(process)
        return process

    def allocator(self, port: int, replica: str, lease_ttl_s: float = 1.0) -> Any:
        return self._spawn(
            f"allocator-{replica}",
            "allocator", "--nats-url", self.nats_url, "--http-port", str(port),
            env={
                "VGPU_CLUSTER": "kubernetes",
                "VGPU_KUBE_API_URL": self.api_url,
                "VGPU_LEASE_TTL_S": str(lease_ttl_s),
                "VGPU_REPLICA_ID": replica,
            },
        )  # fmt: skip

    def node(self, name: str, gpus: int = 2, split_count: int = 10) -> Node:
        """A kubelet simulator and the node agent that registers with it."""
        kubelet_dir = self.workdir / name / "kubelet"
        kubelet = self._spawn(
            f"kubelet-{name}",
            "kubelet-sim", "--node-name", name,
            "--plugin-dir", str(kubelet_dir / "device-plugins"),
            "--pod-resources-socket", str(kubelet_dir / "pod-resources" / "kubelet.sock"),
        )  # fmt: skip
        node = Node(name, kubelet)
        self.nodes[name] = node
        self.start_agent(name, gpus, split_count)
        return node

    def start_agent(self, name: str, gpus: int = 2, split_count: int = 10) -> Any:
        base = self.workdir / name
        agent = self._spawn(
            f"agent-{name}",
            "node-agent", "--node-name", name, "--nats-url", self.nats_url,
            "--simulate", f"{gpus}xA100-40GB",
            "--device-split-count", str(split_count), "--max-pods", "500",
            "--plugin-dir", str(base / "kubelet" / "device-plugins"),
            "--pod-resources-socket", str(base / "kubelet" / "pod-resources" / "kubelet.sock"),
            "--state-dir", str(base / "state"), "--container-root", str(base / "containers"),
        )  # fmt: skip
        self.nodes[name].agent = agent
        return agent

    def log_tails(self, lines: int = 30) -> str:
        """The last lines of every process's log: what a failed assertion shows."""
        parts = []
        for log in sorted(self.workdir.glob("*.log")):
            tail = log.read_text(errors="replace").splitlines()[-lines:]
            parts.append(f"--- {log.name} ---\n" + "\n".join(tail))
        return "\n".join(parts)

    def close(self) -> None:
        for process in self.started:
            if process.poll() is None:
                process.kill()
            process.wait()


def kill9(process: subprocess.Popen[bytes]) -> float:
    """SIGKILL, reaped; the monotonic time of the kill."""
    process.send_signal(signal.SIGKILL)
    at = time.monotonic()
    assert process.wait(timeout=10) == -signal.SIGKILL
    return at


async def http_status(http: aiohttp.ClientSession, url: str) -> int:
    try:
        async with http.get(url) as response:
            return response.status
    except (aiohttp.ClientError, TimeoutError):
        return 0


async def wait_until_ready(http: aiohttp.ClientSession, url: str, timeout_s: float = 60.0) -> float:
    """Until `url`/readyz answers 200 (this replica leads and has its bus); seconds waited."""
    start = time.monotonic()
    while time.monotonic() - start < timeout_s:
        if await http_status(http, f"{url}/readyz") == 200:
            return time.monotonic() - start
        await asyncio.sleep(0.05)
    try:
        async with http.get(f"{url}/readyz") as response:
            said = await response.text()
    except (aiohttp.ClientError, TimeoutError) as exc:
        said = repr(exc)
    raise AssertionError(f"{url} not ready within {timeout_s}s: {said}")


async def wait_alive(http: aiohttp.ClientSession, url: str, timeout_s: float = 60.0) -> None:
    start = time.monotonic()
    while time.monotonic() - start < timeout_s:
        if await http_status(http, f"{url}/healthz") == 200:
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"{url} did not come up within {timeout_s}s")


def pod(name: str, mem_mib: int, namespace: str = "faults") -> dict[str, Any]:
    limits = {"nvidia.com/gpu": "1", "nvidia.com/gpumem": str(mem_mib)}
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {
            "schedulerName": "vgpu-scheduler",
            "containers": [{"name": "main", "image": "cuda", "resources": {"limits": limits}}],
        },
    }


async def _post(http: aiohttp.ClientSession, url: str, body: Any) -> Any:
    async with http.post(url, data=msgspec.json.encode(body)) as response:
        return msgspec.json.decode(await response.read())


@dataclass(frozen=True)
class Placement:
    """How kube-scheduler's attempts at one pod ended."""

    node: str | None = None  # bound there
    no_room: bool = False  # a replica answered that no node can take it: a real refusal
    error: str = ""  # else: the last error (a replica unreachable, its bus away, a bind refused)


async def place(
    http: aiohttp.ClientSession, replicas: list[str], p: dict[str, Any], nodes: list[str]
) -> Placement:
    """kube-scheduler's part: filter then bind on one replica, and on failure to reach it
    (killed, or its bus is away) the same pod again on the next, a few rounds."""
    metadata = p["metadata"]
    args = {"PodName": metadata["name"], "PodNamespace": metadata["namespace"],
            "PodUID": metadata["uid"]}  # fmt: skip
    error = ""
    for attempt in range(3 * len(replicas)):
        url = replicas[attempt % len(replicas)]
        try:
            passed = await _post(
                http, f"{url}/scheduler/filter", {"Pod": p, "Nodes": None, "NodeNames": nodes}
            )
            if passed.get("Error"):
                error = f"filter: {passed['Error']}"
                await asyncio.sleep(0.1)
                continue
            for node in passed.get("NodeNames") or []:
                answer = await _post(http, f"{url}/scheduler/bind", {**args, "Node": node})
                if answer.get("Error", "") == "":
                    return Placement(node=node)
                error = f"bind: {answer['Error']}"
            if not passed.get("NodeNames"):
                failed = passed.get("FailedNodes") or {}
                if failed and not any(_is_fault(reason) for reason in failed.values()):
                    # every node judged, none has room
                    return Placement(no_room=True, error=f"filter: {failed}")
                error = f"filter: {failed}"
                await asyncio.sleep(0.1)
        except (aiohttp.ClientError, TimeoutError, msgspec.DecodeError) as exc:
            error = f"{type(exc).__name__}: {exc}"
            await asyncio.sleep(0.1)  # the replica died under us, or is restarting
    return Placement(error=error or "no replica answered")


def _is_fault(reason: str) -> bool:
    """A node refused for what a fault causes (its agent unheard or silent), not for room."""
    return "no GPU inventory" in reason or "silent" in reason


async def schedule(
    http: aiohttp.ClientSession, replicas: list[str], p: dict[str, Any], nodes: list[str]
) -> str | None:
    """The node the pod was bound to, or None if it was not (for any reason)."""
    return (await place(http, replicas, p, nodes)).node


@dataclass
class Audit:
    bound: dict[str, str]  # pod uid -> node, as the API server says
    stored: dict[str, str]  # pod uid -> node, as JetStream KV says
    duplicates: list[str]  # uids stored more than once
    gpu_memory: dict[str, int]  # GPU uuid -> MiB promised in the store
    booked_at: dict[str, float] = field(default_factory=dict)  # pod uid -> decision (Unix time)

    @property
    def lost(self) -> set[str]:
        return set(self.bound) - set(self.stored)

    @property
    def phantom(self) -> set[str]:
        return set(self.stored) - set(self.bound)

    @property
    def over_booked(self) -> dict[str, int]:
        return {gpu: mib for gpu, mib in self.gpu_memory.items() if mib > A100_MIB}

    def assert_sound(self) -> None:
        assert not self.lost, f"bound pods without a booking: {sorted(self.lost)[:5]}"
        assert not self.phantom, f"bookings without a bound pod: {sorted(self.phantom)[:5]}"
        assert not self.duplicates, f"double-booked pods: {self.duplicates[:5]}"
        assert not self.over_booked, f"GPUs promised past their memory: {self.over_booked}"
        mismatched = {u for u, n in self.bound.items() if self.stored.get(u) != n}
        assert not mismatched, f"booked on another node than bound: {sorted(mismatched)[:5]}"


async def audit(api: FakeApiServer, bus: Bus, namespace: str = "faults") -> Audit:
    """What the API server bound against what JetStream KV holds."""
    bound = {
        p["metadata"]["uid"]: p["spec"]["nodeName"]
        for (ns, _), p in api.pods.items()
        if ns == namespace and p["spec"].get("nodeName")
    }
    kv = await bus.client.jetstream().key_value("vgpu-allocations")
    stored: dict[str, str] = {}
    booked_at: dict[str, float] = {}
    duplicates: list[str] = []
    memory: dict[str, int] = defaultdict(int)
    for key, value in (await read_current(kv)).items():
        if not key.startswith(KEY_PREFIX) or not value:
            continue
        for allocation in msgspec.json.decode(value, type=NodeRecords).pods:
            if allocation.uid in stored:
                duplicates.append(allocation.uid)
            stored[allocation.uid] = allocation.node
            booked_at[allocation.uid] = allocation.bound_at
            for container in allocation.containers.values():
                for piece in container.slices:
                    memory[piece.uuid] += piece.memory_mib
    return Audit(bound, stored, duplicates, dict(memory), booked_at)


async def allocations_of(http: aiohttp.ClientSession, url: str) -> dict[str, str]:
    """uid -> node as one allocator replica holds them in memory."""
    async with http.get(f"{url}/allocations") as response:
        body = msgspec.json.decode(await response.read())
    return {a["uid"]: a["node"] for a in body}


async def wait_for_nodes(
    http: aiohttp.ClientSession, url: str, probe: dict[str, Any], nodes: list[str]
) -> float:
    """Until the replica hears every agent of `nodes` (its filter passes each node, or fails
    it for room, not for a missing or silent agent); seconds waited."""
    body = {"Pod": probe, "Nodes": None, "NodeNames": nodes}
    start = time.monotonic()
    while time.monotonic() - start < 60:
        try:
            async with http.post(f"{url}/scheduler/filter", json=body) as response:
                answer = await response.json()
            failed = answer.get("FailedNodes") or {}
            unheard = [
                n for n in nodes
                if n not in (answer.get("NodeNames") or [])
                and ("no GPU inventory" in failed.get(n, "-") or "silent" in failed.get(n, "-"))
            ]  # fmt: skip
            if not unheard:
                return time.monotonic() - start
        except (aiohttp.ClientError, TimeoutError):
            pass
        await asyncio.sleep(0.05)
    raise AssertionError(f"{url} never saw the agents of {nodes}")


async def place_all(
    http: aiohttp.ClientSession, url: str, pods: list[dict[str, Any]], nodes: list[str]
) -> dict[str, str | None]:
    """Schedule pods one after another on one replica: uid -> node (None: refused)."""
    return {p["metadata"]["uid"]: await schedule(http, [url], p, nodes) for p in pods}
