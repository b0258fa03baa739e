"""Verification from outside, end to end: the real node agent, a real nats-server, the real
allocator, the real compiled hook and the simulated CUDA driver, with the container's
processes in their own PID namespace. The agent sees what NVML shows per process (the
simulated driver records it whatever the hook does) and acts on what breaks the slice."""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from prometheus_client import REGISTRY

from services.allocator.backend import LocalClusterBackend
from services.allocator.service import Allocator
from services.common import subjects
from services.common.bus import Bus
from services.common.embedded_nats import EmbeddedNats
from services.common.schemas import ContainerUsage, SliceViolation
from services.metrics.service import MetricsService
from services.metrics.settings import MetricsSettings
from services.nodeagent.grant import container_key
from services.nodeagent.service import NodeAgent
from services.simulators.kubelet import KubeletSimulator
from services.simulators.scheduler import SchedulerSimulator
from tests.hook.conftest import build  # noqa: F401  (the compiled hook and simulated driver)
from tests.hook.container import allocate_mounts, bind_script
from tests.hook.harness import hook_env, summary, tool
from tests.nodeagent.harness import (
    NODE,
    RESOURCE,
    NodeDirs,
    agent_settings,
    running_node,
    wait_until,
)

SLICE_MIB = 1024
FAST = {
    "usage_interval_s": 0.1,
    "relay_publish_interval_s": 0.1,
    "violation_confirm_s": 0.3,
}


class Inbox:
    def __init__(self) -> None:
        self.violations: list[SliceViolation] = []
        self.usage: list[ContainerUsage] = []

    def of(self, kind: str) -> list[SliceViolation]:
        return [v for v in self.violations if v.kind == kind]


@pytest.fixture
async def inbox(bus: Bus) -> Inbox:
    received = Inbox()

    async def on_violation(message: SliceViolation) -> None:
        received.violations.append(message)

    async def on_usage(message: ContainerUsage) -> None:
        received.usage.append(message)

    await bus.subscribe(subjects.violations(NODE), SliceViolation, on_violation)
    await bus.subscribe(subjects.container_usage(NODE), ContainerUsage, on_usage)
    await bus.client.flush()
    return received


def pod(name: str, cores: int = 50) -> dict[str, Any]:
    limits = {
        RESOURCE: "1", "nvidia.com/gpumem": str(SLICE_MIB), "nvidia.com/gpucores": str(cores),
    }  # fmt: skip
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": "ml", "uid": f"uid-{name}"},
        "spec": {
            "containers": [{"name": "main", "image": "cuda:12", "resources": {"limits": limits}}],
            "schedulerName": "vgpu-scheduler",
        },
    }


@asynccontextmanager
async def placed(
    nats_url: str, allocator: Allocator, dirs: NodeDirs, cores: int = 50, **settings: Any
) -> AsyncIterator[tuple[KubeletSimulator, NodeAgent, Path, str]]:
    """A node whose agent sees the simulated driver, and one pod placed on it by the real
    allocator with `cores` percent of its GPU: (kubelet, agent, the container's directory,
    its GPU's uuid)."""
    sim = dirs.root / "sim"
    async with running_node(
        nats_url, dirs, simulate_driver_dir=str(sim), **{**FAST, **settings}
    ) as (kubelet, agent):
        await wait_until(lambda: allocator.cluster.node(NODE) is not None, 10, "allocator")
        spec = pod("train", cores)
        backend = allocator.backend
        assert isinstance(backend, LocalClusterBackend)
        backend.add_pod(spec)
        scheduler = SchedulerSimulator(allocator.url + "/scheduler")
        try:
            assert (await scheduler.schedule(spec, [NODE])).node == NODE
        finally:
            await scheduler.close()
        result = await kubelet.admit(spec)
        assert result.admitted, result.error
        directory = dirs.container_root / container_key(result.containers[0].device_ids)
        await wait_until((directory / "config" / "limits").exists, 15, "limit file")
        uuid = result.containers[0].envs["NVIDIA_VISIBLE_DEVICES"]
        yield kubelet, agent, directory, uuid


def _namespaces_work() -> bool:
    if shutil.which("unshare") is None:
        return False
    probe = subprocess.run([*_UNSHARE, "true"], capture_output=True, timeout=30)
    return probe.returncode == 0


_UNSHARE = ["unshare", "--pid", "--fork", "--mount-proc"]
if os.geteuid() != 0:
    _UNSHARE[1:1] = ["--user", "--map-root-user", "--mount"]
needs_namespaces = pytest.mark.skipif(
    not _namespaces_work(), reason="PID namespaces (unshare) are not available here"
)


@contextmanager
def in_container(
    directory: Path, sim: Path, uuid: str, *commands: str
) -> Iterator[tuple[subprocess.Popen[str], list[str]]]:
    """Run shell commands side by side in one new PID namespace, as a container's processes,
    with the container's environment (hook preloaded, its GPU); each prints one `holding`
    line and holds until stdin closes. Yields the process and those lines."""
    # Each program sees the whole card (the bypass takes all of it beside the honest one).
    env = hook_env(
        directory, sim, VGPU_SIM_UUIDS=uuid, VGPU_HOOK_QUIET="1", VGPU_SIM_PRIVATE_MEMORY="1"
    )
    del env["VGPU_CONTAINER_DIR"], env["VGPU_LIMIT_WAIT_MS"]  # ignored in a container anyway
    # The Allocate response's mounts, in the new mount namespace --mount-proc makes. A shell
    # gives background commands /dev/null as stdin unless told otherwise.
    script = (
        bind_script(allocate_mounts(directory))
        + "\nexec 3<&0; "
        + " ".join(f"{c} <&3 &" for c in commands)
        + " wait"
    )
    proc = subprocess.Popen(
        [*_UNSHARE, "sh", "-c", script],
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        lines = [proc.stdout.readline() for _ in commands]
        assert all(line.startswith("holding") for line in lines), [*lines, proc.stderr.read()]
        yield proc, lines
    finally:
        if proc.poll() is None:
            proc.communicate(timeout=30)


HONEST = f"{tool('mem_paths')} alloc link create 100 hold"  # stops at the hook's limit
BYPASS = f"LD_PRELOAD= {tool('mem_paths')} alloc link create 512 hold"  # no hook: whole GPU


def gauge(name: str, kind: str | None = None, **labels: str) -> float | None:
    wanted = {"node": NODE, "namespace": "ml", "pod": "train", "container": "main", **labels}
    if kind is not None:
        wanted["kind"] = kind
    return REGISTRY.get_sample_value(name, wanted)


def measured(inbox: Inbox) -> list[ContainerUsage]:
    return [u for u in inbox.usage if u.pod == "train" and u.devices[0].measured_mib >= 0]


@needs_namespaces
async def test_an_honest_program_inside_its_slice_is_no_violation(
    build: Path,  # noqa: F811
    nats_server: EmbeddedNats,
    allocator: Allocator,
    dirs: NodeDirs,
    inbox: Inbox,
) -> None:
    async with placed(nats_server.url, allocator, dirs) as (_, agent, directory, uuid):
        with in_container(directory, dirs.root / "sim", uuid, HONEST) as (_, lines):
            assert summary(lines[0]) == {"allocated_mib": 1000}
            seen = await wait_until(
                lambda: [u for u in measured(inbox) if u.devices[0].measured_mib == 1000],
                10,
                "NVML's figure for the container",
            )
            await asyncio.sleep(1.0)  # several samples past the confirmation time
            assert inbox.violations == []
            assert seen[-1].devices[0].violation == ""
            assert seen[-1].devices[0].memory_used_mib == 1000  # the hook's figure agrees
            assert gauge("vgpu_nodeagent_slice_violation", "over_limit", gpu=uuid) == 0
            assert gauge("vgpu_nodeagent_slice_violation", "tampering", gpu=uuid) == 0
            assert gauge("vgpu_nodeagent_container_measured_memory_mib", gpu=uuid) == 1000
            assert agent.verifier.flags(directory.name) == {}


@needs_namespaces
async def test_a_program_that_bypasses_the_hook_is_reported(
    build: Path,  # noqa: F811
    nats_server: EmbeddedNats,
    allocator: Allocator,
    dirs: NodeDirs,
    inbox: Inbox,
) -> None:
    async with placed(nats_server.url, allocator, dirs) as (_, _agent, directory, uuid):
        with in_container(directory, dirs.root / "sim", uuid, HONEST, BYPASS) as (proc, lines):
            assert sorted(summary(line)["allocated_mib"] for line in lines) == [1000, 40960]
            over = await wait_until(lambda: inbox.of("over_limit"), 10, "over_limit event")
            assert len(over) == 1
            found = over[0]
            assert (found.namespace, found.pod, found.container, found.gpu) == (
                "ml", "train", "main", uuid,
            )  # fmt: skip
            assert (found.limit_mib, found.measured_mib) == (SLICE_MIB, 41960)
            assert found.tolerance_mib == 52  # 5 % of 1024, rounded up
            assert found.action == "report" and found.killed_pids == []
            assert len(found.pids) == 2
            # The hooks said 1000 MiB: their figure disagrees with NVML's, also flagged.
            tampering = await wait_until(lambda: inbox.of("tampering"), 10, "tampering event")
            assert tampering[0].reported_mib == 1000
            assert gauge("vgpu_nodeagent_slice_violation", "over_limit", gpu=uuid) == 1
            assert gauge("vgpu_nodeagent_slice_excess_mib", gpu=uuid) == 41960 - SLICE_MIB
            flagged = await wait_until(
                lambda: [u for u in measured(inbox) if u.devices[0].violation], 10, "flag"
            )
            assert flagged[-1].devices[0].violation == "over_limit,tampering"
            assert flagged[-1].devices[0].measured_mib == 41960
            # report only: nothing was killed, and the finding is reported once.
            await asyncio.sleep(0.5)
            assert all(os.path.exists(f"/proc/{pid}") for pid in found.pids)
            assert len(inbox.of("over_limit")) == 1
            assert proc.poll() is None


@needs_namespaces
async def test_on_violation_kill_kills_the_newest_process_until_within(
    build: Path,  # noqa: F811
    nats_server: EmbeddedNats,
    allocator: Allocator,
    dirs: NodeDirs,
    inbox: Inbox,
) -> None:
    async with placed(nats_server.url, allocator, dirs, on_violation="kill") as (
        _,
        agent,
        directory,
        uuid,
    ):
        # The bypass starts last (a clock tick later): the newest, so the first to go.
        with in_container(directory, dirs.root / "sim", uuid, HONEST, "sleep 0.05; " + BYPASS):
            over = await wait_until(lambda: inbox.of("over_limit"), 10, "over_limit event")
            found = over[0]
            assert found.action == "kill"
            assert len(found.killed_pids) == 1  # the honest process fits: it lives on
            (killed,) = found.killed_pids
            (honest,) = agent.relay.peers()  # the hooked process said hello: the survivor
            assert killed != honest and killed in found.pids
            await wait_until(lambda: not os.path.exists(f"/proc/{killed}"), 10, "killed")
            assert os.path.exists(f"/proc/{honest}")
            # Back within the slice: the finding ends, the flag and gauge clear.
            await wait_until(
                lambda: gauge("vgpu_nodeagent_slice_violation", "over_limit", gpu=uuid) == 0,
                10,
                "over_limit cleared",
            )
            assert gauge("vgpu_nodeagent_container_measured_memory_mib", gpu=uuid) == 1000
            killed_total = REGISTRY.get_sample_value(
                "vgpu_nodeagent_violation_kills_total", {"node": NODE}
            )
            assert killed_total is not None and killed_total >= 1


CORES = 20
KERNEL_GRID = 5000  # 5 ms kernels on the simulated GPU


def busy_program(seconds: float, *, hooked: bool) -> str:
    """A container command that keeps the GPU busy for `seconds` (asynchronous launches),
    through the hook or behind its back."""
    preload = "" if hooked else "LD_PRELOAD= "
    argv = f"{tool('launch_load')} {seconds} {KERNEL_GRID} kernel link 0"
    return f"{preload}sh -c 'echo holding; exec {argv}'"


@contextmanager
def host_tenant(sim: Path, uuid: str, seconds: float) -> Iterator[subprocess.Popen[str]]:
    """Another user of the same GPU, outside any container: it wants the whole GPU."""
    env = hook_env(sim, sim, hook=False, VGPU_SIM_UUIDS=uuid, VGPU_SIM_PRIVATE_MEMORY="1")
    argv = [tool("launch_load"), str(seconds), str(KERNEL_GRID), "kernel", "link", "0"]
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, text=True)
    try:
        yield proc
    finally:
        proc.kill()
        proc.wait()


COMPUTE_FAST = {"violation_compute_confirm_s": 1.0}


@needs_namespaces
async def test_a_program_that_launches_behind_the_limiter_is_reported_over_compute(
    build: Path,  # noqa: F811
    nats_server: EmbeddedNats,
    allocator: Allocator,
    dirs: NodeDirs,
    inbox: Inbox,
) -> None:
    sim = dirs.root / "sim"
    async with placed(nats_server.url, allocator, dirs, CORES, **COMPUTE_FAST) as (
        _, agent, directory, uuid,
    ):  # fmt: skip
        with (
            host_tenant(sim, uuid, 30),
            # A hooked process beside it says hello: the agent then knows the container's PID
            # namespace (no cgroups here to attribute the bypass by; a cluster has them).
            in_container(directory, sim, uuid, HONEST, busy_program(30, hooked=False)) as (proc, _),
        ):
            found = (await wait_until(lambda: inbox.of("over_compute"), 20, "over_compute"))[0]
            assert (found.namespace, found.pod, found.container, found.gpu) == (
                "ml", "train", "main", uuid,
            )  # fmt: skip
            assert found.cores_limit == CORES and found.action == "report"
            assert found.measured_sm_percent > CORES + 10, found
            assert found.others_sm_percent > 5, found  # the host tenant wanted the GPU
            assert len(found.pids) == 2
            assert agent.verifier.flags(directory.name) == {uuid: "over_compute"}
            assert gauge("vgpu_nodeagent_slice_violation", "over_compute", gpu=uuid) == 1
            flagged = await wait_until(
                lambda: [u for u in inbox.usage if "over_compute" in u.devices[0].violation],
                10,
                "the flag in the container's usage",
            )
            assert flagged[-1].devices[0].violation == "over_compute"
            assert inbox.of("over_limit") == []  # it took no memory beyond its slice
            assert proc.poll() is None  # reported, never killed
            proc.kill()
    # The agent stopped: its gauges go with it (vgpu up restarts agents in the same process).
    assert gauge("vgpu_nodeagent_slice_violation", "over_compute", gpu=uuid) is None
    assert gauge("vgpu_nodeagent_container_measured_sm_percent", gpu=uuid) is None


@needs_namespaces
async def test_a_program_held_to_its_share_by_the_hook_is_no_compute_violation(
    build: Path,  # noqa: F811
    nats_server: EmbeddedNats,
    allocator: Allocator,
    dirs: NodeDirs,
    inbox: Inbox,
) -> None:
    sim = dirs.root / "sim"
    async with placed(nats_server.url, allocator, dirs, CORES, **COMPUTE_FAST) as (
        _, _agent, directory, uuid,
    ):  # fmt: skip
        with (
            host_tenant(sim, uuid, 30),
            in_container(directory, sim, uuid, busy_program(30, hooked=True)) as (proc, _),
        ):

            def sampled() -> list[float]:
                """The agent's NVML share of the container in each usage it published."""
                found = [u.devices[0].sm_util_percent for u in measured(inbox)]
                return [share for share in found if share > 0][5:]

            await wait_until(sampled, 20, "several SM samples of the container")
            await asyncio.sleep(3.0)  # three confirmation times past the first samples
            shares = sampled()
            assert inbox.of("over_compute") == [], shares
            assert gauge("vgpu_nodeagent_slice_violation", "over_compute", gpu=uuid) == 0
            # It did run, held near its share (the limiter's own accuracy: within 5 points).
            assert 0 < sum(shares[-5:]) / 5 <= CORES + 10, shares
            proc.kill()


@needs_namespaces
async def test_zeroing_the_shared_accounting_is_flagged_as_tampering(
    build: Path,  # noqa: F811
    nats_server: EmbeddedNats,
    allocator: Allocator,
    dirs: NodeDirs,
    inbox: Inbox,
) -> None:
    async with placed(nats_server.url, allocator, dirs) as (_, agent, directory, uuid):
        with in_container(directory, dirs.root / "sim", uuid, HONEST):
            await wait_until(
                lambda: [u for u in measured(inbox) if u.devices[0].memory_used_mib == 1000],
                10,
                "the hook's report",
            )
            assert inbox.violations == []
            # What root in the container can do to the region: zero it (every byte).
            region = directory / "state" / "hook.region"
            region.write_bytes(bytes(region.stat().st_size))
            tampering = await wait_until(lambda: inbox.of("tampering"), 10, "tampering event")
            assert tampering[0].reported_mib == 0
            assert tampering[0].measured_mib == 1000
            assert "tampered" in tampering[0].reason
            assert inbox.of("over_limit") == []  # within the slice all the same
            assert gauge("vgpu_nodeagent_slice_violation", "tampering", gpu=uuid) == 1
            assert agent.verifier.flags(directory.name) == {uuid: "tampering"}


async def test_a_hello_that_lies_about_the_limits_is_tampering(
    nats_server: EmbeddedNats, allocator: Allocator, dirs: NodeDirs, inbox: Inbox
) -> None:
    async with placed(nats_server.url, allocator, dirs) as (_, _agent, directory, uuid):
        _reader, writer = await asyncio.open_unix_connection(
            str(directory / "state" / "relay.sock")
        )
        forged = (
            '{"v":1,"type":"hello","pid":1,"comm":"forger","devices":[{"index":0,'
            f'"uuid":"{uuid}","limit_mib":999999,"cores":100}}]}}\n'
        )
        writer.write(forged.encode())
        await writer.drain()
        tampering = await wait_until(lambda: inbox.of("tampering"), 10, "tampering event")
        assert "999999 MiB" in tampering[0].reason and f"{SLICE_MIB} MiB" in tampering[0].reason
        assert gauge("vgpu_nodeagent_slice_violation", "tampering", gpu=uuid) == 1
        # The slice stays the agent's: its limit file and its own checks are unchanged.
        assert f"memory_limit_mib={SLICE_MIB}" in (directory / "config" / "limits").read_text()
        writer.close()
        await writer.wait_closed()
        await wait_until(
            lambda: gauge("vgpu_nodeagent_slice_violation", "tampering", gpu=uuid) == 0,
            10,
            "the lie ends with its connection",
        )
        assert len(inbox.of("tampering")) == 1


async def test_a_restarted_agent_rebuilds_from_its_own_records_only(
    nats_server: EmbeddedNats, allocator: Allocator, dirs: NodeDirs, inbox: Inbox
) -> None:
    async with placed(nats_server.url, allocator, dirs) as (_, agent, directory, uuid):
        await agent.stop()
        # While the agent is away, its container directories change under it (a container
        # cannot write its limit file, which is mounted read-only, but nothing the agent reads
        # back on restart may be trusted anyway): the limit file widened, and a directory the
        # agent never wrote, with a limit file.
        limits = directory / "config" / "limits"
        widened = limits.read_text().replace(
            f"memory_limit_mib={SLICE_MIB}", "memory_limit_mib=999999"
        )
        limits.write_text(widened)
        (directory / "owner.json").write_text('{"pod_uid": "uid-someone-else"}')
        planted = dirs.container_root / "0123456789abcdef"
        (planted / "config").mkdir(parents=True)
        (planted / "config" / "limits").write_text(widened)

        again = NodeAgent(
            agent_settings(
                nats_server.url, dirs, simulate_driver_dir=str(dirs.root / "sim"), **FAST
            )
        )
        await again.start()
        try:
            restored = again.relay.container(directory.name)
            assert restored is not None
            assert restored.limits.devices[0].memory_limit_mib == SLICE_MIB
            assert restored.pod_uid == "uid-train"
            # The limit file is the agent's again, and the relay serves the directory.
            assert f"memory_limit_mib={SLICE_MIB}\n" in limits.read_text()
            assert (directory / "state" / "relay.sock").is_socket()
            # What the agent never resolved is not served.
            assert again.relay.container(planted.name) is None
            assert not (planted / "state" / "relay.sock").exists()
            # Its checks use its own figures: a hello with the widened limit is a lie.
            _, writer = await asyncio.open_unix_connection(str(directory / "state" / "relay.sock"))
            writer.write(
                (
                    '{"v":1,"type":"hello","pid":1,"comm":"main","devices":[{"index":0,'
                    f'"uuid":"{uuid}","limit_mib":999999,"cores":50}}]}}\n'
                ).encode()
            )
            await writer.drain()
            lie = await wait_until(lambda: inbox.of("tampering"), 10, "tampering event")
            assert f"wrote {uuid} with {SLICE_MIB} MiB" in lie[0].reason
            writer.close()
        finally:
            await again.stop()


async def test_a_restarted_agent_without_its_records_asks_the_kubelet_and_the_allocator(
    nats_server: EmbeddedNats, allocator: Allocator, dirs: NodeDirs
) -> None:
    """Its state lost (or written by an older agent): the container the kubelet lists is
    resolved again from PodResources and the allocator's claim, not from its directory."""
    async with placed(nats_server.url, allocator, dirs) as (_, agent, directory, _uuid):
        await agent.stop()
        shutil.rmtree(dirs.state_dir)
        limits = directory / "config" / "limits"
        widened = limits.read_text().replace(
            f"memory_limit_mib={SLICE_MIB}", "memory_limit_mib=999999"
        )
        limits.write_text(widened)
        again = NodeAgent(agent_settings(nats_server.url, dirs, **FAST))
        await again.start()
        try:
            restored = await wait_until(
                lambda: again.relay.container(directory.name), 15, "the directory served again"
            )
            assert restored.limits.devices[0].memory_limit_mib == SLICE_MIB
            assert restored.name == "ml/train/main" and restored.pod_uid == "uid-train"
            await wait_until(
                lambda: f"memory_limit_mib={SLICE_MIB}\n" in limits.read_text(),
                15,
                "the limit file written again from the allocator's decision",
            )
            assert (dirs.state_dir / "containers" / f"{directory.name}.json").is_file()
        finally:
            await again.stop()


async def dashboard_slice(metrics: MetricsService) -> dict[str, Any] | None:
    """The slice of ml/train as the dashboard's JSON API shows it."""
    async with (
        aiohttp.ClientSession() as session,
        session.get(f"{metrics.url}/api/v1/picture") as resp,
    ):
        body = await resp.json()
    pieces = [s for n in body["nodes"] for g in n["gpus"] for s in g["slices"]
              if (s["namespace"], s["pod"], s["container"]) == ("ml", "train", "main")]  # fmt: skip
    return pieces[0] if pieces else None


async def poll_slice(metrics: MetricsService, wanted: Any, what: str) -> dict[str, Any]:
    deadline = asyncio.get_running_loop().time() + 15
    while True:
        piece = await dashboard_slice(metrics)
        if piece is not None and wanted(piece):
            return piece
        assert asyncio.get_running_loop().time() < deadline, f"{what}: {piece}"
        await asyncio.sleep(0.1)


@asynccontextmanager
async def dashboard(nats_url: str) -> AsyncIterator[MetricsService]:
    metrics = MetricsService(MetricsSettings(nats_url=nats_url, http_port=0,
                                             stream_interval_s=0.05))  # fmt: skip
    await metrics.start()
    try:
        yield metrics
    finally:
        await metrics.stop()


@needs_namespaces
async def test_the_dashboard_flags_a_program_that_bypasses_the_hook(
    build: Path,  # noqa: F811
    nats_server: EmbeddedNats,
    allocator: Allocator,
    dirs: NodeDirs,
) -> None:
    """What the agent finds reaches the metrics service's JSON API (the dashboard's source)
    on the real bus: both flags on the slice, with the agent's own sentences."""
    async with (
        dashboard(nats_server.url) as metrics,
        placed(nats_server.url, allocator, dirs) as (_, _agent, directory, uuid),
    ):
        with in_container(directory, dirs.root / "sim", uuid, HONEST, BYPASS):
            piece = await poll_slice(
                metrics, lambda s: s["over_limit"] and s["tampering"]
                and len(s["violation_reasons"]) == 2, "both findings with their reasons",
            )  # fmt: skip
            assert piece["violation"] == "over_limit,tampering"
            assert piece["measured_mib"] == 41960
            over, lies = piece["violation_reasons"]
            assert over.startswith("NVML shows 41960 MiB") and "hooks report 1000 MiB" in lies


async def test_the_dashboard_shows_a_lying_hook_until_it_is_gone(
    nats_server: EmbeddedNats, allocator: Allocator, dirs: NodeDirs
) -> None:
    async with (
        dashboard(nats_server.url) as metrics,
        placed(nats_server.url, allocator, dirs) as (_, _agent, directory, uuid),
    ):
        _reader, writer = await asyncio.open_unix_connection(
            str(directory / "state" / "relay.sock")
        )
        writer.write((
            '{"v":1,"type":"hello","pid":1,"comm":"forger","devices":[{"index":0,'
            f'"uuid":"{uuid}","limit_mib":999999,"cores":100}}]}}\n'
        ).encode())  # fmt: skip
        await writer.drain()
        piece = await poll_slice(metrics, lambda s: s["violation_reasons"], "the tampering")
        assert (piece["tampering"], piece["over_limit"]) == (True, False)
        assert "999999 MiB" in piece["violation_reasons"][0]
        writer.close()
        await writer.wait_closed()
        piece = await poll_slice(metrics, lambda s: not s["tampering"], "the end of the lie")
        assert piece["violation"] == "" and piece["violation_reasons"] == []
