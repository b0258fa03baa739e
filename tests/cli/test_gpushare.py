"""Aliyun gpushare compatibility under `vgpu up`: a pod asking `aliyun.com/gpu-mem` gets
gpushare's four ALIYUN_COM_GPU_MEM_* variables in its containers and gpushare's annotations on
the pod, in gpushare's units (GiB; Unix nanoseconds)."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from services.allocator import gpushare
from services.cli.local_cluster import LocalCluster, LocalClusterSpec
from services.cli.submit import load_pod, submit

PEERS = Path(__file__).resolve().parents[2] / "examples" / "peers"
A100_GIB = 40


@pytest.fixture
async def cluster() -> AsyncIterator[LocalCluster]:
    local = LocalCluster(LocalClusterSpec(allocator_port=0, metrics_port=0, nodes=1))
    await local.start()
    yield local
    await local.stop()


def index_of(cluster: LocalCluster, uuid: str) -> int:
    (gpu,) = [g for g in cluster.agents["node-1"].gpus if g.uuid == uuid]
    return gpu.index


async def test_a_gpushare_pod_gets_gpushares_env_and_annotations(cluster: LocalCluster) -> None:
    pod = load_pod(PEERS / "gpushare.yaml")
    sidecar = {"name": "helper", "image": "x", "resources": {"limits": {"aliyun.com/gpu-mem": "2"}},
               "env": [{"name": "ALIYUN_COM_GPU_MEM_CONTAINER", "value": "99"}]}  # fmt: skip
    pod["spec"]["containers"].append(sidecar)
    pod["spec"]["containers"].append({"name": "web", "image": "nginx"})
    before = time.time_ns()
    outcome = await submit(pod, cluster.state())
    assert outcome.node == "node-1" and not outcome.reason, outcome.reason
    by_name = {c.name: c for c in outcome.containers}
    first = by_name["binpack-1"]
    assert first.limits["device.0.memory_limit_mib"] == "3072"
    index = index_of(cluster, first.gpus[0])
    assert {k: v for k, v in first.envs.items() if k.startswith("ALIYUN")} == {
        "ALIYUN_COM_GPU_MEM_IDX": str(index),
        "ALIYUN_COM_GPU_MEM_POD": "5",  # GiB of the pod's app containers
        "ALIYUN_COM_GPU_MEM_CONTAINER": "3",
        "ALIYUN_COM_GPU_MEM_DEV": str(A100_GIB),
    }
    # The container's own value never stands: gpushare's device plugin sets it.
    assert by_name["helper"].envs["ALIYUN_COM_GPU_MEM_CONTAINER"] == "2"
    assert not any(k.startswith("ALIYUN") for k in by_name["web"].envs)

    assert cluster.allocator is not None
    stored = await cluster.allocator.backend.get_pod("default", "binpack-1")
    assert stored is not None
    annotations = stored["metadata"]["annotations"]
    assert annotations[gpushare.IDX] == str(index)
    assert annotations[gpushare.POD] == "5"
    assert annotations[gpushare.DEV] == str(A100_GIB)
    assume = int(annotations[gpushare.ASSUME_TIME])
    assert before <= assume <= time.time_ns()
    # The node agent claimed the containers (their limits are written): assigned, as
    # gpushare's device plugin marks a pod once it has allocated it.
    assert annotations[gpushare.ASSIGNED] == "true"


async def test_pods_in_other_syntaxes_get_nothing_of_gpushare(cluster: LocalCluster) -> None:
    outcome = await submit(load_pod(PEERS / "tencent.yaml"), cluster.state())
    assert not outcome.reason
    assert not any(k.startswith("ALIYUN") for k in outcome.containers[0].envs)
    assert cluster.allocator is not None
    stored = await cluster.allocator.backend.get_pod("default", "vcuda")
    assert stored is not None
    assert not any(k.startswith("ALIYUN") for k in stored["metadata"]["annotations"])


def test_bind_annotations_are_in_gpushares_units() -> None:
    # A 16 GiB card (16160 MiB as NVML reports a V100-16GB) is 15 GiB to gpushare (floor).
    assert gpushare.bind_annotations(3, 1, 16160, now_ns=1700000000123456789) == {
        "ALIYUN_COM_GPU_MEM_IDX": "1",
        "ALIYUN_COM_GPU_MEM_POD": "3",
        "ALIYUN_COM_GPU_MEM_DEV": "15",
        "ALIYUN_COM_GPU_MEM_ASSIGNED": "false",
        "ALIYUN_COM_GPU_MEM_ASSUME_TIME": "1700000000123456789",
    }
