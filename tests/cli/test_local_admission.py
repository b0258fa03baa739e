"""The local API server behind `vgpu up` runs the allocator's mutating webhook on pod CREATE,
as a cluster does: every peer's documented pod spec places and gets its slice under
`vgpu submit`, and a pod that asked for GPUs but got none is a failure, never "placed"."""

from __future__ import annotations

import copy
import socket
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from services.cli.local_cluster import WEBHOOK_CONFIGURATION, LocalCluster, LocalClusterSpec
from services.cli.local_tls import self_signed
from services.cli.submit import load_pod, render, submit
from services.simulators.admission import AdmissionRefused, MutatingAdmission, MutatingWebhook

ROOT = Path(__file__).resolve().parents[2]
PEERS = ROOT / "examples" / "peers"
A100_MIB = 40960


async def started(**spec: Any) -> LocalCluster:
    local = LocalCluster(LocalClusterSpec(allocator_port=0, metrics_port=0, **spec))
    await local.start()
    return local


@pytest.fixture
async def cluster() -> AsyncIterator[LocalCluster]:
    local = await started()
    yield local
    await local.stop()


def test_vgpu_up_registers_the_webhook_the_manifests_deploy() -> None:
    manifest = yaml.safe_load((ROOT / "deploy/k8s/base/allocator/webhook.yaml").read_text())
    (entry,) = manifest["webhooks"]
    assert entry == WEBHOOK_CONFIGURATION


# (manifest, {container: (GPU count, memory MiB per GPU, cores per GPU)}), the slices each
# system's documentation promises for its own pod spec.
PEER_SPECS = [
    ("hami.yaml", {"ubuntu-container": (2, 10240, 30)}),
    ("gpushare.yaml", {"binpack-1": (1, 3 * 1024, 0)}),
    ("tencent.yaml", {"c": (1, 10 * 256, 20)}),
    ("tencent-docker.yaml", {"c": (1, 32 * 256, 50)}),
    ("volcano.yaml", {"ubuntu-container": (2, 3000, 50)}),
    ("aws.yaml", {"resnet-container": (1, A100_MIB // 10, 10)}),
    ("kai.yaml", {"ubuntu": (1, A100_MIB // 2, 0)}),
    ("kai-memory.yaml", {"ubuntu": (1, 2000, 0)}),
    ("volcano-percentage.yaml", {"ubuntu-container": (1, A100_MIB // 4, 30)}),
]


@pytest.mark.parametrize(("manifest", "expected"), PEER_SPECS, ids=[m for m, _ in PEER_SPECS])
async def test_each_peers_documented_pod_places_and_gets_its_slice(
    cluster: LocalCluster, manifest: str, expected: dict[str, tuple[int, int, int]]
) -> None:
    outcome = await submit(load_pod(PEERS / manifest), cluster.state())
    assert outcome.node in cluster.agents and not outcome.reason, render(outcome)
    got = {}
    for container in outcome.containers:
        limits = container.limits
        count = int(limits["device_count"])
        memory = {limits[f"device.{i}.memory_limit_mib"] for i in range(count)}
        cores = {limits.get(f"device.{i}.cores", "0") for i in range(count)}
        assert len(memory) == len(cores) == 1, limits
        assert len(container.gpus) == count
        got[container.name] = (count, int(memory.pop()), int(cores.pop()))
    assert got == expected
    assert "placed on node" in render(outcome)


async def test_the_stored_pod_carries_vgpus_names_and_scheduler(
    cluster: LocalCluster, spans: InMemorySpanExporter
) -> None:
    pod = load_pod(PEERS / "tencent.yaml")
    await submit(pod, cluster.state())
    finished = spans.get_finished_spans()
    (root,) = [s for s in finished if s.name == "vgpu submit default/vcuda"]
    (call,) = [s for s in finished if s.name == "admission webhook pods.allocator.vgpu.io"]
    assert call.context.trace_id == root.context.trace_id
    assert cluster.allocator is not None
    stored = await cluster.allocator.backend.get_pod("default", "vcuda")
    assert stored is not None
    (container,) = stored["spec"]["containers"]
    limits = {"nvidia.com/gpu": "1", "nvidia.com/gpumem": "2560", "nvidia.com/gpucores": "20"}
    assert container["resources"] == {"limits": limits, "requests": limits}
    assert stored["spec"]["schedulerName"] == "vgpu-scheduler"
    assert stored["spec"]["nodeName"] in cluster.agents


async def test_a_request_the_webhook_denies_is_refused_at_create(cluster: LocalCluster) -> None:
    pod = load_pod(PEERS / "tencent.yaml")
    pod["spec"]["containers"][0]["resources"] = {"limits": {"tencent.com/vcuda-core": "150"}}
    outcome = await submit(pod, cluster.state())
    assert outcome.node is None
    assert 'admission webhook "pods.allocator.vgpu.io" denied the request' in outcome.reason
    assert "multiple of 100" in outcome.reason


async def test_a_gpu_pod_that_bypasses_the_webhook_fails_rather_than_placed(
    cluster: LocalCluster,
) -> None:
    # The objectSelector's opt-out: the pod reaches the scheduler as written; the extender
    # places it (it reads tencent.com names) but the kubelet has no such device resource.
    pod = load_pod(PEERS / "tencent.yaml")
    pod["metadata"]["labels"] = {"vgpu.io/webhook": "disabled"}
    outcome = await submit(pod, cluster.state())
    text = render(outcome)
    assert outcome.node in cluster.agents and outcome.reason, text
    assert "failed on node" in text and "placed on node" not in text
    assert "'c' (tencent syntax) asked for GPUs but the kubelet allocated none" in text


async def test_without_the_webhook_peer_pods_fail_and_vgpu_names_still_place() -> None:
    local = await started(admission_webhook=False, nodes=1)
    try:
        # Named for vgpu's scheduler by hand: a pod left with the default scheduler never
        # reaches the extender (its bind takes only vgpu-scheduler's pods).
        gpushare = load_pod(PEERS / "gpushare.yaml")
        gpushare["spec"]["schedulerName"] = "vgpu-scheduler"
        failed = await submit(gpushare, local.state())
        assert failed.node == "node-1"
        assert "(aliyun syntax) asked for GPUs but the kubelet allocated none" in failed.reason
        # The extender read gpushare's name and wrote gpushare's annotations all the same.
        assert local.allocator is not None
        stored = await local.allocator.backend.get_pod("default", "binpack-1")
        assert stored is not None
        assert stored["metadata"]["annotations"]["ALIYUN_COM_GPU_MEM_POD"] == "3"
        assert stored["metadata"]["annotations"]["ALIYUN_COM_GPU_MEM_ASSIGNED"] == "false"
        placed = await submit(load_pod(PEERS / "hami.yaml"), local.state())
        assert not placed.reason and len(placed.containers[0].gpus) == 2
    finally:
        await local.stop()


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@pytest.mark.parametrize("policy", ["Fail", "Ignore"])
async def test_an_unreachable_webhook_follows_its_failure_policy(
    tmp_path: Path, policy: str
) -> None:
    cert = self_signed(tmp_path, "nobody")
    entry = copy.deepcopy(WEBHOOK_CONFIGURATION) | {"failurePolicy": policy, "timeoutSeconds": 1}
    webhook = MutatingWebhook.from_configuration(
        entry, f"https://127.0.0.1:{free_port()}", cert.ca_file
    )
    admission = MutatingAdmission([webhook])
    pod = load_pod(PEERS / "tencent.yaml")
    if policy == "Ignore":
        assert await admission.admit(copy.deepcopy(pod), "default") == pod
        return
    with pytest.raises(AdmissionRefused) as refused:
        await admission.admit(pod, "default")
    assert refused.value.code == 500
    assert refused.value.message.startswith(
        'Internal error occurred: failed calling webhook "pods.allocator.vgpu.io": '
        "failed to call webhook: Post"
    )


async def test_only_the_webhooks_selected_namespaces_and_operations_are_called(
    tmp_path: Path,
) -> None:
    cert = self_signed(tmp_path, "nobody")
    entry = copy.deepcopy(WEBHOOK_CONFIGURATION) | {"failurePolicy": "Fail"}
    webhook = MutatingWebhook.from_configuration(
        entry, f"https://127.0.0.1:{free_port()}", cert.ca_file
    )
    pod = load_pod(PEERS / "tencent.yaml")
    assert webhook.applies("CREATE", "default", pod)
    assert not webhook.applies("UPDATE", "default", pod)
    assert not webhook.applies("CREATE", "kube-system", pod)
    assert not webhook.applies("CREATE", "vgpu-system", pod)
    pod["metadata"]["labels"] = {"vgpu.io/webhook": "disabled"}
    assert not webhook.applies("CREATE", "default", pod)
    # Not called, so an unreachable Fail webhook refuses nothing it does not select.
    assert await MutatingAdmission([webhook]).admit(pod, "default") == pod


async def test_aws_vgpus_follow_the_node_agents_own_count() -> None:
    # AWS's --vgpu=4 on the node agents (vgpu up --device-split-count 4) is the only place
    # the count is read: the README pod's 1 vGPU is a quarter of the GPU there.
    local = await started(nodes=1, split_count=4)
    try:
        outcome = await submit(load_pod(PEERS / "aws.yaml"), local.state())
        assert outcome.node == "node-1" and not outcome.reason, render(outcome)
        (container,) = outcome.containers
        assert container.limits["device.0.memory_limit_mib"] == str(A100_MIB // 4)
        assert container.limits["device.0.cores"] == "25"
    finally:
        await local.stop()
