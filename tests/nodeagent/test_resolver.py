"""Allocate -> PodResources -> claim -> limit file, through the kubelet simulator.

A tiny ALLOC_CLAIM responder written here stands in for the allocator; the end-to-end test
of the whole system uses the real one.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from prometheus_client import REGISTRY

from services.common import subjects
from services.common.bus import Bus, ReplyError
from services.common.embedded_nats import EmbeddedNats
from services.common.schemas import (
    ClaimReply,
    ClaimRequest,
    ContainerAllocation,
    GpuSlice,
)
from services.common.tracing import current_traceparent, tracer
from services.nodeagent.grant import container_key
from services.nodeagent.service import NodeAgent
from services.simulators.kubelet import KubeletSimulator
from tests.nodeagent.harness import NODE, NodeDirs, gpu_pod, node_dirs, running_node, wait_until

Node = tuple[KubeletSimulator, NodeAgent, NodeDirs]


@pytest.fixture
async def node(nats_server: EmbeddedNats) -> AsyncIterator[Node]:
    async with node_dirs() as dirs, running_node(nats_server.url, dirs) as (kubelet, agent):
        yield kubelet, agent, dirs


class ClaimResponder:
    """Decides 10 GiB and 30% of each GPU the container was given, inside a known trace."""

    def __init__(self) -> None:
        self.requests: list[ClaimRequest] = []
        with tracer("test").start_as_current_span("test bind") as span:
            self.traceparent = current_traceparent()
            self.span_context = span.get_span_context()
        self.refuse = ""

    async def __call__(self, request: ClaimRequest) -> ClaimReply:
        self.requests.append(request)
        if self.refuse:
            raise ReplyError(self.refuse)
        slices = [
            GpuSlice(uuid=uuid, index=i, memory_mib=10240, cores=30)
            for i, uuid in enumerate(request.gpu_uuids)
        ]
        return ClaimReply(
            pod_uid=f"uid-{request.pod}",
            allocation=ContainerAllocation(
                container=request.container,
                slices=slices,
                device_ids=request.device_ids,
                claimed=True,
            ),
            traceparent=self.traceparent,
        )


@pytest.fixture
async def claims(bus: Bus) -> ClaimResponder:
    responder = ClaimResponder()
    await bus.serve(subjects.ALLOC_CLAIM, ClaimRequest, responder, queue=subjects.ALLOCATOR_QUEUE)
    await bus.client.flush()
    return responder


async def test_limit_file_and_allocate_span_join_the_pods_trace(
    node: Node, claims: ClaimResponder, spans: InMemorySpanExporter
) -> None:
    kubelet, _, dirs = node
    result = await kubelet.admit(gpu_pod("train", {"main": 1}, namespace="ml"))
    assert result.admitted, result.error
    (container,) = result.containers
    limits = dirs.container_root / container_key(container.device_ids) / "config" / "limits"
    await wait_until(limits.exists, what="limit file")

    gpu = container.envs["NVIDIA_VISIBLE_DEVICES"]
    assert limits.read_text() == (
        "version=1\nnamespace=ml\npod=train\ncontainer=main\ndevice_count=1\n"
        f"device.0.uuid={gpu}\ndevice.0.memory_limit_mib=10240\ndevice.0.cores=30\n"
    )
    assert claims.requests == [
        ClaimRequest(
            node=NODE,
            namespace="ml",
            pod="train",
            container="main",
            device_ids=container.device_ids,
            gpu_uuids=[gpu],
        )
    ]

    finished = await wait_until(
        lambda: [s for s in spans.get_finished_spans() if s.name == "device-plugin Allocate"],
        what="Allocate span",
    )
    (allocate,) = finished
    assert allocate.context.trace_id == claims.span_context.trace_id
    assert allocate.parent is not None and allocate.parent.span_id == claims.span_context.span_id
    assert allocate.start_time is not None and allocate.end_time is not None
    assert allocate.start_time <= allocate.end_time
    assert allocate.attributes["k8s.container.name"] == "main"
    (write,) = [s for s in spans.get_finished_spans() if s.name == "write limits"]
    assert write.parent is not None and write.parent.span_id == allocate.context.span_id
    # The kubelet's admit span is linked: a real kubelet sends none, the simulator does.
    (admit,) = [s for s in spans.get_finished_spans() if s.name == "kubelet admit ml/train"]
    assert [link.context.span_id for link in allocate.links] == [admit.context.span_id]


async def test_each_container_gets_its_own_decision_by_name(
    node: Node, claims: ClaimResponder
) -> None:
    kubelet, _, dirs = node
    result = await kubelet.admit(gpu_pod("pair", {"left": 1, "right": 2}))
    assert result.admitted, result.error
    for container in result.containers:
        limits = dirs.container_root / container_key(container.device_ids) / "config" / "limits"
        await wait_until(limits.exists, what=f"limit file of {container.name}")
        text = limits.read_text()
        assert f"container={container.name}\n" in text
        count = len(container.envs["NVIDIA_VISIBLE_DEVICES"].split(","))
        assert f"device_count={count}\n" in text
    assert sorted(r.container for r in claims.requests) == ["left", "right"]
    right = next(r for r in claims.requests if r.container == "right")
    assert len(set(right.gpu_uuids)) == 2  # spread over both GPUs by the fallback pick


async def test_refused_claim_writes_no_limit_file(node: Node, claims: ClaimResponder) -> None:
    kubelet, _, dirs = node
    claims.refuse = "no allocation for default/ghost/main on node-a"
    labels = {"node": NODE, "reason": "claim_refused"}
    before = REGISTRY.get_sample_value("vgpu_nodeagent_resolve_failures_total", labels) or 0.0
    result = await kubelet.admit(gpu_pod("ghost", {"main": 1}))
    assert result.admitted  # the kubelet already admitted it; the hook will refuse to run
    await wait_until(
        lambda: (
            (REGISTRY.get_sample_value("vgpu_nodeagent_resolve_failures_total", labels) or 0)
            > before
        ),
        what="claim failure counted",
    )
    assert len(claims.requests) == 1
    key = container_key(result.containers[0].device_ids)
    assert (dirs.container_root / key).is_dir()
    assert not (dirs.container_root / key / "config" / "limits").exists()


async def test_context_overhead_of_the_gpus_model_goes_into_the_limit_file(
    nats_server: EmbeddedNats, claims: ClaimResponder
) -> None:
    overheads = "T4=250,a100=420,*=300"  # the first matching model wins, case-insensitively
    async with (
        node_dirs() as dirs,
        running_node(nats_server.url, dirs, context_overhead=overheads) as (kubelet, _),
    ):
        result = await kubelet.admit(gpu_pod("ctx", {"main": 1}))
        assert result.admitted, result.error
        (container,) = result.containers
        limits = dirs.container_root / container_key(container.device_ids) / "config" / "limits"
        await wait_until(limits.exists, what="limit file")
        assert limits.read_text().endswith("device.0.cores=30\ncontext_overhead_mib=420\n")


async def test_init_container_is_claimed_by_pod_uid_and_needs_the_pod_named_back(
    node: Node, claims: ClaimResponder, spans: InMemorySpanExporter
) -> None:
    """This responder cannot claim by UID (its reply names no pod, as an older allocator's):
    the init container then gets no limit file, for a stated reason."""
    kubelet, _, dirs = node
    pod = gpu_pod("prep", {"app": 2}, init_containers={"setup": 1}, uid="uid-prep")
    result = await kubelet.admit(pod)
    assert result.admitted, result.error
    setup, app = result.containers
    failed = await _app_resolves_and_init_fails(dirs, app.device_ids, spans)
    assert "reply for pod uid uid-prep container setup names no pod" in str(
        failed[0].status.description
    )
    by_uid = [r for r in claims.requests if r.container == "setup"]
    assert by_uid == [
        ClaimRequest(
            node=NODE,
            namespace="",
            pod="",
            container="setup",
            device_ids=setup.device_ids,
            gpu_uuids=[setup.envs["NVIDIA_VISIBLE_DEVICES"]],
            pod_uid="uid-prep",
        )
    ]
    assert not (
        dirs.container_root / container_key(setup.device_ids) / "config" / "limits"
    ).exists()


async def test_a_broken_checkpoint_is_named_in_the_failure_and_spares_podresources(
    node: Node, claims: ClaimResponder, spans: InMemorySpanExporter
) -> None:
    kubelet, _, dirs = node
    pod = gpu_pod("broken", {"app": 2}, init_containers={"setup": 1})
    result = await kubelet.admit(pod)
    assert result.admitted, result.error
    # Before the checkpoint-only owner settles, the file turns into half a document.
    checkpoint = dirs.plugin_dir / "kubelet_internal_checkpoint"
    half = checkpoint.read_bytes()[:40]
    checkpoint.with_name("half").write_bytes(half)
    checkpoint.with_name("half").replace(checkpoint)
    setup, app = result.containers
    failed = await _app_resolves_and_init_fails(dirs, app.device_ids, spans)
    description = str(failed[0].status.description)
    assert f"no container holds devices {sorted(setup.device_ids)}" in description
    assert f"kubelet checkpoint {checkpoint} is truncated" in description
    assert [r.container for r in claims.requests] == ["app"]


async def _app_resolves_and_init_fails(
    dirs: NodeDirs, app_device_ids: list[str], spans: InMemorySpanExporter
) -> list[ReadableSpan]:
    """Wait for the app container's limits (found through PodResources), then for the init
    container's failed Allocate span; the failed spans."""
    await wait_until(
        lambda: (
            dirs.container_root / container_key(app_device_ids) / "config" / "limits"
        ).exists(),
        what="the app container's limits (PodResources)",
    )
    return await wait_until(
        lambda: [
            s
            for s in spans.get_finished_spans()
            if s.name == "device-plugin Allocate" and not s.status.is_ok
        ],
        timeout_s=15,
        what="the init container's failure",
    )
