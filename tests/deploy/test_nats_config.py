"""The NATS configuration of deploy/k8s, run in three real nats-servers forming a cluster.

The config file is taken from the rendered ConfigMap, the passwords from the credentials
Job's own generator; only the listen addresses and the store directory are given on the
command line, as the StatefulSet gives the store directory. Each vgpu service logs in as its
own user (through services.common.bus.Bus) and must be able to do exactly its part: the
flows of services/common/subjects.py succeed, everything else is refused by the server.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import subprocess
import time
import urllib.request
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import nats
import nats.errors
import nats.js.errors
import pytest
from nats.js.api import KeyValueConfig

from services.common import subjects
from services.common.bus import Bus
from services.common.embedded_nats import find_nats_server
from tests.deploy.manifests import containers, env_of, find_generated, pod_objects, render
from tests.deploy.test_compose import run_composed_stack
from tests.deploy.test_nats_credentials import credentials_module

SERVERS = 3
STATE_BUCKET = "vgpu-allocations"


class Ping(msgspec.Struct):
    text: str


class Pong(msgspec.Struct):
    text: str = ""
    error: str = ""


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _secret_env() -> tuple[dict[str, str], dict[str, str]]:
    """Server environment (passwords) and the user -> password map, as the Job writes them."""
    entries = credentials_module().missing_entries({}, "unused:4222")
    env = {
        "NATS_ALLOCATOR_PASSWORD": entries["allocator-password"],
        "NATS_NODEAGENT_PASSWORD": entries["nodeagent-password"],
        "NATS_METRICS_PASSWORD": entries["metrics-password"],
        "NATS_SYSTEM_PASSWORD": entries["system-password"],
    }
    users = {
        "vgpu-allocator": entries["allocator-password"],
        "vgpu-node-agent": entries["nodeagent-password"],
        "vgpu-metrics": entries["metrics-password"],
    }
    return env, users


@dataclass
class Cluster:
    ports: list[int]
    monitor_ports: list[int]
    users: dict[str, str]
    logs: list[Path]
    processes: list[subprocess.Popen[bytes]] = field(default_factory=list)

    def url(self, user: str, server: int = 0, password: str | None = None) -> str:
        secret = self.users[user] if password is None else password
        return f"nats://{user}:{secret}@127.0.0.1:{self.ports[server]}"

    def log_text(self) -> str:
        return "\n".join(path.read_text(errors="replace") for path in self.logs)

    def mark(self) -> list[int]:
        return [path.stat().st_size for path in self.logs]

    def log_since(self, mark: list[int]) -> str:
        """What the servers logged after `mark` (refusals are logged as "... Violation")."""
        texts = []
        for path, offset in zip(self.logs, mark, strict=True):
            with path.open("rb") as log:
                log.seek(offset)
                texts.append(log.read().decode(errors="replace"))
        return "\n".join(texts)


def _config_file(directory: Path) -> Path:
    config_map = find_generated(render(""), "ConfigMap", "vgpu-nats-config-")
    path = directory / "nats.conf"
    path.write_text(config_map["data"]["nats.conf"])
    return path


def _healthy(port: int) -> bool:
    try:
        with urllib.request.urlopen(
            f"http://127.0.0.1:{port}/healthz?js-enabled-only=true", timeout=1
        ) as response:
            return response.status == 200
    except OSError:
        return False


def _fully_routed(port: int) -> bool:
    """Whether the server has a route to every other one: interest (a plain subscription)
    reaches a server only over its route, and JetStream's quorum needs only a majority."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/routez", timeout=1) as response:
            return int(msgspec.json.decode(response.read()).get("num_routes", 0)) >= SERVERS - 1
    except OSError:
        return False


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    directory = tmp_path_factory.mktemp("nats")
    config = _config_file(directory)
    secrets, users = _secret_env()
    cluster_ports = [_free_port() for _ in range(SERVERS)]
    routes = ",".join(f"nats://127.0.0.1:{port}" for port in cluster_ports)
    running = Cluster(
        ports=[_free_port() for _ in range(SERVERS)],
        monitor_ports=[_free_port() for _ in range(SERVERS)],
        users=users,
        logs=[directory / f"server-{i}.log" for i in range(SERVERS)],
    )
    try:
        for index in range(SERVERS):
            command = [
                find_nats_server(), "--config", str(config), "--addr", "127.0.0.1",
                "--port", str(running.ports[index]),
                "--http_port", str(running.monitor_ports[index]),
                "--cluster", f"nats://127.0.0.1:{cluster_ports[index]}", "--routes", routes,
                "--store_dir", str(directory / f"store-{index}"),
            ]  # fmt: skip
            env = {"PATH": os.environ["PATH"], "POD_NAME": f"vgpu-nats-{index}", **secrets}
            with running.logs[index].open("wb") as log:
                running.processes.append(subprocess.Popen(command, env=env, stdout=log, stderr=log))
        deadline = time.monotonic() + 30
        while not all(_healthy(p) and _fully_routed(p) for p in running.monitor_ports):
            exited = [p for p in running.processes if p.poll() is not None]
            assert not exited, f"nats-server exited:\n{running.log_text()[-2000:]}"
            assert time.monotonic() < deadline, (
                f"no JetStream quorum or full mesh of routes:\n{running.log_text()[-2000:]}"
            )
            time.sleep(0.1)
        yield running
    finally:
        for process in running.processes:
            process.terminate()
        for process in running.processes:
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def test_config_is_valid_for_nats_server(tmp_path: Path) -> None:
    secrets, _ = _secret_env()
    env = {"PATH": os.environ["PATH"], "POD_NAME": "vgpu-nats-0", **secrets}
    result = subprocess.run(
        [find_nats_server(), "-t", "-c", str(_config_file(tmp_path))],
        env=env, capture_output=True, text=True, timeout=30, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    # Without the Secret the server refuses to start, naming what is missing.
    del env["NATS_METRICS_PASSWORD"]
    missing = subprocess.run(
        [find_nats_server(), "-t", "-c", str(_config_file(tmp_path))],
        env=env, capture_output=True, text=True, timeout=30, check=False,
    )  # fmt: skip
    assert missing.returncode != 0 and "NATS_METRICS_PASSWORD" in missing.stdout + missing.stderr


@contextlib.asynccontextmanager
async def _connected(url: str, name: str) -> AsyncIterator[Bus]:
    bus = await Bus.connect(url, name, connect_timeout_s=5)
    try:
        yield bus
    finally:
        await bus.close()


class Inbox:
    """Raw messages received on one subject pattern."""

    def __init__(self) -> None:
        self.subjects: list[str] = []
        self.event = asyncio.Event()

    async def on(self, msg: Any) -> None:
        self.subjects.append(msg.subject)
        self.event.set()

    async def wait(self, timeout: float = 15.0) -> None:
        await asyncio.wait_for(self.event.wait(), timeout)


async def _listen(bus: Bus, subject: str) -> Inbox:
    inbox = Inbox()
    await bus.client.subscribe(subject, cb=inbox.on)
    await bus.client.flush()
    return inbox


async def _until(condition: Callable[[], bool], what: str, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.05)


async def _ask_until_answered(bus: Bus, subject: str, timeout: float = 15.0) -> Any:
    """A request across servers: a subscription reaches the other servers of the cluster
    some time after it is made (longer on a loaded machine); until then nobody answers."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return await bus.client.request(subject, b"{}", timeout=5)
        except nats.errors.NoRespondersError:
            assert time.monotonic() < deadline, f"nobody answered {subject} in {timeout} s"
            await asyncio.sleep(0.1)


async def test_logins_need_the_right_password(cluster: Cluster) -> None:
    refused = [
        cluster.url("vgpu-metrics").replace("vgpu-metrics:", "nobody:"),
        cluster.url("vgpu-metrics", password="p0000"),
        f"nats://127.0.0.1:{cluster.ports[0]}",  # anonymous
    ]
    for url in refused:
        with pytest.raises(nats.errors.Error, match=r"[Aa]uthorization"):
            await nats.connect(url, allow_reconnect=False, connect_timeout=2)


async def test_every_flow_of_vgpu_works_across_the_cluster(cluster: Cluster) -> None:
    mark = cluster.mark()
    async with (
        _connected(cluster.url("vgpu-allocator", 0), "allocator") as allocator,
        _connected(cluster.url("vgpu-node-agent", 1), "agent") as agent,
        _connected(cluster.url("vgpu-metrics", 2), "metrics") as metrics,
    ):
        allocator_sees = await _listen(allocator, subjects.INVENTORY_ALL)
        metrics_sees = {
            pattern: await _listen(metrics, pattern)
            for pattern in (subjects.INVENTORY_ALL, subjects.USAGE_ALL,
                            subjects.CONTAINER_USAGE_ALL, subjects.ALLOC_EVENTS_ALL,
                            subjects.ALLOC_PENDING_ALL, subjects.VIOLATIONS_ALL)
        }  # fmt: skip

        async def answer(request: Ping) -> Pong:
            return Pong(text=f"re: {request.text}")

        for subject in (subjects.ALLOC_CLAIM, subjects.ALLOC_PREFERRED):
            await allocator.serve(subject, Ping, answer, queue=subjects.ALLOCATOR_QUEUE)
        await allocator.client.flush()
        for subject in (subjects.ALLOC_CLAIM, subjects.ALLOC_PREFERRED):
            await _ask_until_answered(agent, subject)  # until it reaches the agent's server

        # Node agent: inventory, usage, container usage and violations out; claims and
        # preferences asked.
        await agent.publish(subjects.inventory("gpu-1.example"), Ping(text="inventory"))
        await agent.publish(subjects.usage("gpu-1.example"), Ping(text="usage"))
        await agent.publish(subjects.container_usage("gpu-1.example"), Ping(text="usage"))
        await agent.publish(subjects.violations("gpu-1.example"), Ping(text="over_limit"))
        for subject in (subjects.ALLOC_CLAIM, subjects.ALLOC_PREFERRED):
            reply = await agent.request(subject, Ping(text="which"), Pong, timeout=5)
            assert reply.text == "re: which"

        # Allocator replicas: one asks, another whose filter passed the pod answers.
        async def passed(msg: Any) -> None:
            await allocator.client.publish(msg.reply, b'{"age_s": 1.0}')

        await allocator.client.subscribe(subjects.ALLOC_FILTER_PASS, cb=passed)
        await allocator.client.flush()
        async with _connected(cluster.url("vgpu-allocator", 2), "peer") as peer:
            reply = await _ask_until_answered(peer, subjects.ALLOC_FILTER_PASS)
            assert reply.data == b'{"age_s": 1.0}'
        # Allocator: allocation events and pending pods out.
        await allocator.publish(subjects.alloc_events("gpu-1.example"), Ping(text="bound"))
        await allocator.publish(subjects.alloc_pending(), Ping(text="pending"))

        await allocator_sees.wait()
        assert allocator_sees.subjects == ["vgpu.v1.inventory.gpu-1_example"]
        for pattern, inbox in metrics_sees.items():
            await inbox.wait()
            assert len(inbox.subjects) == 1, pattern
    assert "Violation" not in cluster.log_since(mark)


async def test_services_cannot_speak_for_each_other(cluster: Cluster) -> None:
    mark = cluster.mark()
    async with (
        _connected(cluster.url("vgpu-allocator", 0), "allocator") as allocator,
        _connected(cluster.url("vgpu-node-agent", 1), "agent") as agent,
        _connected(cluster.url("vgpu-metrics", 2), "metrics") as metrics,
    ):
        events = await _listen(metrics, subjects.ALLOC_EVENTS_ALL)
        inventory = await _listen(allocator, subjects.INVENTORY_ALL)
        await asyncio.sleep(0.2)
        # A node agent cannot announce allocations, nor serve (or overhear) the allocator's
        # request subjects; metrics cannot publish anything at all.
        await agent.publish(subjects.alloc_events("n1"), Ping(text="forged"))
        await agent.client.subscribe(subjects.ALLOC_CLAIM, queue=subjects.ALLOCATOR_QUEUE)
        await metrics.publish(subjects.inventory("n1"), Ping(text="forged"))
        await metrics.client.subscribe(subjects.ALLOC_PREFERRED)
        # Nor can a node agent claim that a filter passed its pod (only allocators answer).
        await agent.client.subscribe(subjects.ALLOC_FILTER_PASS)
        # The allocator cannot pose as a node.
        await allocator.publish(subjects.usage("n1"), Ping(text="forged"))
        for bus in (agent, metrics, allocator):
            with contextlib.suppress(Exception):
                await bus.client.flush()
        expected = [
            '"VGPU/user:vgpu-node-agent" - Publish Violation - Subject "vgpu.v1.alloc.events.n1"',
            '"VGPU/user:vgpu-node-agent" - Subscription Violation - Subject "vgpu.v1.alloc.claim"',
            '"VGPU/user:vgpu-metrics" - Publish Violation - Subject "vgpu.v1.inventory.n1"',
            '"VGPU/user:vgpu-metrics" - Subscription Violation - Subject "vgpu.v1.alloc.preferred"',
            '"VGPU/user:vgpu-node-agent" - Subscription Violation - Subject '
            '"vgpu.v1.alloc.filter-pass"',
            '"VGPU/user:vgpu-allocator" - Publish Violation - Subject "vgpu.v1.usage.n1"',
        ]
        await _until(lambda: all(e in cluster.log_since(mark) for e in expected), "refusals")
        await asyncio.sleep(0.3)  # a forged message that got through would have arrived
        assert events.subjects == [] and inventory.subjects == []


async def _retried(
    call: Callable[[], Awaitable[Any]], errors: tuple[type[Exception], ...], within_s: float
) -> Any:
    """`call` again every 0.5 s while it raises one of `errors`, for up to `within_s`."""
    deadline = time.monotonic() + within_s
    while True:
        try:
            return await call()
        except errors:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.5)


async def _create_when_cluster_ready(js: Any, config: KeyValueConfig, within_s: float = 60) -> Any:
    """A new three-server JetStream cluster answers a replicated create only once it has
    elected its meta leader and the bucket's own group; under load that takes longer than one
    request's timeout. Creating again with the same config is idempotent."""
    return await _retried(
        lambda: js.create_key_value(config), (TimeoutError, nats.errors.Error), within_s
    )


async def _first_write_when_stream_answers(
    write: Callable[[], Awaitable[object]], within_s: float = 30.0
) -> None:
    """A new bucket's stream may not take messages yet (its group still electing a leader:
    "no responders"); a message no stream took was not stored, so writing again is safe."""
    await _retried(write, (nats.js.errors.NoStreamResponseError,), within_s)


async def test_jetstream_state_is_the_allocators_and_metrics_may_only_read(
    cluster: Cluster,
) -> None:
    async with (
        _connected(cluster.url("vgpu-allocator", 0), "allocator") as allocator,
        _connected(cluster.url("vgpu-metrics", 1), "metrics") as metrics,
        _connected(cluster.url("vgpu-node-agent", 2), "agent") as agent,
    ):
        js = allocator.client.jetstream(timeout=10)
        state = await _create_when_cluster_ready(
            js, KeyValueConfig(bucket=STATE_BUCKET, replicas=SERVERS)
        )
        await state.put("node.gpu-1", b"decision")
        lease = await _create_when_cluster_ready(
            js, KeyValueConfig(bucket="vgpu-allocator-lease", history=1, ttl=6)
        )
        await _first_write_when_stream_answers(lambda: lease.create("leader", b"allocator-0"))

        # Metrics reads the decisions (get and the watch its rebuild uses) ...
        mark = cluster.mark()
        readable = await metrics.client.jetstream(timeout=15).key_value(STATE_BUCKET)
        assert (await readable.get("node.gpu-1")).value == b"decision"
        watcher = await readable.watchall()
        update = await watcher.updates(timeout=15)
        assert update is not None and update.key == "node.gpu-1"
        await watcher.stop()
        assert "Violation" not in cluster.log_since(mark)
        # ... but writes nothing, and reads no other bucket. (A refused request is dropped by
        # the server, so nats-py sees a timeout; the server's log below says why.)
        impatient = metrics.client.jetstream(timeout=1)
        with pytest.raises(nats.errors.TimeoutError):
            await (await impatient.key_value(STATE_BUCKET)).put("node.gpu-1", b"forged")
        with pytest.raises(nats.errors.TimeoutError):
            await impatient.key_value("vgpu-allocator-lease")
        # The node agent has no business in JetStream at all.
        with pytest.raises(nats.errors.TimeoutError):
            await agent.client.jetstream(timeout=1).key_value(STATE_BUCKET)
        assert (await state.get("node.gpu-1")).value == b"decision"
        violation = '"VGPU/user:{}" - Publish Violation - Subject "{}"'
        refused = [
            violation.format("vgpu-metrics", "$KV.vgpu-allocations.node.gpu-1"),
            violation.format("vgpu-metrics", "$JS.API.STREAM.INFO.KV_vgpu-allocator-lease"),
            violation.format("vgpu-node-agent", "$JS.API.STREAM.INFO.KV_vgpu-allocations"),
        ]
        await _until(lambda: all(r in cluster.log_since(mark) for r in refused), "refusals")


def test_permissions_name_the_buckets_the_services_use() -> None:
    from services.allocator.settings import AllocatorSettings
    from services.metrics.settings import MetricsSettings

    config = find_generated(render(""), "ConfigMap", "vgpu-nats-config-")["data"]["nats.conf"]
    allocator, metrics = AllocatorSettings(), MetricsSettings()
    assert STATE_BUCKET == allocator.state_bucket == metrics.kv_bucket
    assert f'"$KV.{allocator.state_bucket}.>"' in config
    assert f'"$KV.{allocator.lease_bucket}.>"' in config
    assert f'"$JS.API.STREAM.INFO.KV_{metrics.kv_bucket}"' in config
    # No container renames them (the permissions would no longer fit).
    for obj in pod_objects(render("")):
        for container in containers(obj):
            assert not {"VGPU_STATE_BUCKET", "VGPU_LEASE_BUCKET", "VGPU_KV_BUCKET"} & set(
                env_of(container)
            )


@pytest.mark.timeout(180)
def test_the_real_services_work_within_their_permissions(cluster: Cluster, work_dir: Path) -> None:
    """The compose stack's services, each logged in as its own user: the allocator opens its
    KV buckets and lease, metrics rebuilds from KV and follows every event, the agents
    publish and claim, and the servers refuse nothing."""
    # Which user and which server each service logs in to; the nodes share the agent's user.
    logins = {"allocator": ("vgpu-allocator", 0), "metrics": ("vgpu-metrics", 1)}
    mark = cluster.mark()
    run_composed_stack(
        work_dir, lambda service: cluster.url(*logins.get(service, ("vgpu-node-agent", 2)))
    )
    assert "Violation" not in cluster.log_since(mark)
