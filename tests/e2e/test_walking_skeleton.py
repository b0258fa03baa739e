"""End to end: a pod manifest through the extender, the kubelet and the node agent.

Everything is real (nats-server, HTTP, gRPC over unix sockets, the services) except the GPUs
and the kubelet/kube-scheduler, which are vgpu's own simulators.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from prometheus_client import REGISTRY
from prometheus_client.parser import text_string_to_metric_families

from services.cli.local_cluster import LocalCluster, LocalClusterSpec
from services.cli.submit import load_pod, submit
from services.simulators.scheduler import SchedulerSimulator

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


@pytest.fixture
async def cluster() -> AsyncIterator[LocalCluster]:
    local = LocalCluster(LocalClusterSpec(allocator_port=0, metrics_port=0, heartbeat_s=1.0))
    await local.start()
    yield local
    await local.stop()


def gpus_of(cluster: LocalCluster, node: str) -> set[str]:
    return {gpu.uuid for gpu in cluster.agents[node].gpus}


async def test_half_gpu_reaches_the_container_and_one_trace_follows_it(
    cluster: LocalCluster, spans: InMemorySpanExporter
) -> None:
    outcome = await submit(load_pod(EXAMPLES / "half-gpu.yaml"), cluster.state())

    assert outcome.node in cluster.agents, outcome.reason
    (container,) = outcome.containers
    assert container.name == "cuda"
    assert len(container.gpus) == 1 and container.gpus[0] in gpus_of(cluster, outcome.node)
    assert container.envs["NVIDIA_VISIBLE_DEVICES"] == container.gpus[0]
    assert {m["container_path"] for m in container.mounts} >= {"/var/run/vgpu"}
    assert container.limits == {
        "version": "1", "namespace": "default", "pod": "half-gpu", "container": "cuda",
        "device_count": "1", "device.0.uuid": container.gpus[0],
        "device.0.memory_limit_mib": "20480", "device.0.cores": "50",
    }  # fmt: skip

    # The Allocate span is emitted right after the limit file is written: allow a moment.
    for _ in range(100):
        names = {span.name for span in spans.get_finished_spans()}
        if "device-plugin Allocate" in names:
            break
        await asyncio.sleep(0.02)
    finished = spans.get_finished_spans()
    (root,) = [s for s in finished if s.name == "vgpu submit default/half-gpu"]
    in_trace = {s.name for s in finished if s.context.trace_id == root.context.trace_id}
    assert {
        "schedule default/half-gpu", "extender filter", "extender prioritize", "extender bind",
        "kubelet admit default/half-gpu", "device-plugin Allocate", "write limits",
    } <= in_trace  # fmt: skip


async def test_each_container_gets_its_own_slice_by_name(cluster: LocalCluster) -> None:
    outcome = await submit(load_pod(EXAMPLES / "two-containers.yaml"), cluster.state())
    by_name = {c.name: c for c in outcome.containers}
    assert by_name["trainer"].limits["device.0.memory_limit_mib"] == "16384"
    assert by_name["trainer"].limits["device.0.cores"] == "60"
    assert by_name["evaluator"].limits["device.0.memory_limit_mib"] == "8192"
    assert by_name["evaluator"].limits["container"] == "evaluator"
    assert by_name["log-shipper"].gpus == [] and not by_name["log-shipper"].limits


async def test_two_whole_gpus_are_exclusive(cluster: LocalCluster) -> None:
    outcome = await submit(load_pod(EXAMPLES / "two-whole-gpus.yaml"), cluster.state())
    (container,) = outcome.containers
    assert len(set(container.gpus)) == 2
    assert container.limits["device.0.cores"] == container.limits["device.1.cores"] == "100"
    assert container.limits["device.0.memory_limit_mib"] == "40960"
    # Nothing else can land on those GPUs any more.
    half = await submit(load_pod(EXAMPLES / "half-gpu.yaml"), cluster.state())
    assert not set(half.containers[0].gpus) & set(container.gpus)


async def test_a_pod_that_can_never_fit_gets_a_reason_naming_its_request(
    cluster: LocalCluster,
) -> None:
    outcome = await submit(load_pod(EXAMPLES / "cannot-fit.yaml"), cluster.state())
    assert outcome.node is None
    assert "'huge'" in outcome.reason and "102400" in outcome.reason
    assert "never fit" in outcome.reason


async def test_an_unknown_node_is_named_in_failed_nodes(cluster: LocalCluster) -> None:
    pod = load_pod(EXAMPLES / "half-gpu.yaml")
    assert cluster.allocator is not None
    cluster.allocator.backend.add_pod(pod)  # as `vgpu submit` creates it in the local API
    state = cluster.state()
    scheduler = SchedulerSimulator(state.extender_url, ssl_context=state.extender_ssl())
    try:
        alone = await scheduler.schedule(pod, ["node-9"])
        mixed = await scheduler.schedule(pod, ["node-9", "node-1"])
    finally:
        await scheduler.close()
    assert alone.node is None
    assert "'node-9'" in alone.failed_nodes["node-9"]
    assert "no GPU inventory" in alone.failed_nodes["node-9"]
    assert mixed.node == "node-1"
    assert set(mixed.failed_nodes) == {"node-9"}


async def allocated_bytes(metrics_url: str, gpu: str, token: str) -> float:
    headers = {"Authorization": f"Bearer {token}"}  # /metrics is behind the read gate
    async with (
        aiohttp.ClientSession() as session,
        session.get(f"{metrics_url}/metrics", headers=headers) as resp,
    ):
        assert resp.status == 200, await resp.text()
        text = await resp.text()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "vgpu_gpu_memory_allocated_bytes" and sample.labels["uuid"] == gpu:
                return sample.value
    return -1.0


async def test_bound_slices_reach_the_metrics_service(cluster: LocalCluster) -> None:
    outcome = await submit(load_pod(EXAMPLES / "half-gpu.yaml"), cluster.state())
    gpu = outcome.containers[0].gpus[0]
    metrics_url, token = cluster.state().metrics_url, cluster.admin_token
    for _ in range(100):
        if await allocated_bytes(metrics_url, gpu, token) > 0:
            break
        await asyncio.sleep(0.05)
    assert await allocated_bytes(metrics_url, gpu, token) == 20480 * 1024 * 1024


def _pod(name: str, cpu: str, **gpu: Any) -> dict[str, Any]:
    limits: dict[str, Any] = {"cpu": cpu, "memory": "1Gi", **gpu}
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": "default", "uid": str(uuid.uuid4())},
        "spec": {
            "containers": [{"name": "main", "image": "x", "resources": {"limits": limits}}],
            "schedulerName": "vgpu-scheduler",
        },
    }


def _extender_calls(verb: str) -> float:
    return sum(
        REGISTRY.get_sample_value(
            "vgpu_allocator_extender_requests_total", {"verb": verb, "outcome": outcome}
        )
        or 0.0
        for outcome in ("fit", "no_fit", "ok", "bound", "refused")
    )


async def test_pods_without_gpus_are_scored_by_the_extender_and_counted(
    cluster: LocalCluster,
) -> None:
    """As deploy/k8s configures kube-scheduler: a CPU-only pod is not filtered or bound by the
    extender, but scored by it, so it goes where its CPU strands no GPU (node-2, whose GPUs a
    whole-node pod holds) rather than onto node-1's free GPUs' CPU (where equal scores, or
    LeastAllocated, would put it); the allocator then counts its CPU on that node."""
    assert cluster.allocator is not None
    small = await submit(
        _pod("small", "1", **{"nvidia.com/gpu": "1", "nvidia.com/gpumem": "4Ki"}), cluster.state()
    )
    whole = await submit(_pod("whole", "2", **{"nvidia.com/gpu": "4"}), cluster.state())
    assert (small.node, whole.node) == ("node-1", "node-2")
    # "4Ki" as the API server may store it: 4096 MiB reach the hook's limit file.
    assert small.containers[0].limits["device.0.memory_limit_mib"] == "4096"
    filters, binds, scores = (_extender_calls(v) for v in ("filter", "bind", "prioritize"))
    web = await submit(_pod("web", "40"), cluster.state())
    assert web.node == "node-2" and web.reason == ""
    assert [c.gpus for c in web.containers] == [[]]
    assert (_extender_calls("filter"), _extender_calls("bind")) == (filters, binds)
    assert _extender_calls("prioritize") == scores + 1
    node = cluster.allocator.cluster.node("node-2")
    assert node is not None and (node.cpu_milli, node.max_pods) == (64000, 110)
    assert (node.used_cpu_milli, node.used_pods) == (42000, 2)
