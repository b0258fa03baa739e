"""Aliyun gpushare compatibility under `vgpu up`: a pod asking `aliyun.com/gpu-mem` gets
gpushare's four ALIYUN_COM_GPU_MEM_* variables in its containers and gpushare's annotations on
the pod, in gpushare's units (GiB; Unix nanoseconds)."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from services.allocator import gpushare
from services.cli import inspect_gpushare
from services.cli.inspect import fetch_picture
from services.cli.local_cluster import LocalCluster, LocalClusterSpec
from services.cli.submit import load_pod, submit
from services.common.resources import RequestConfig
from services.metrics.views import ClusterView

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


async def picture_with(cluster: LocalCluster, pods: int) -> ClusterView:
    """The metrics service's picture once it holds `pods` pods."""
    url = cluster.state().metrics_url
    for _ in range(200):
        view = await asyncio.to_thread(fetch_picture, url, 5.0, cluster.admin_token)
        if len(view.pods) >= pods:
            return view
        await asyncio.sleep(0.05)
    raise AssertionError(f"the picture never held {pods} pods: {view}")


async def test_kubectl_inspect_gpushare_prints_gpushares_tables(
    cluster: LocalCluster, tmp_path: Path
) -> None:
    first = await submit(load_pod(PEERS / "gpushare.yaml"), cluster.state())
    vcuda = await submit(load_pod(PEERS / "tencent.yaml"), cluster.state())  # 2.5 GiB: 3
    assert not first.reason and not vcuda.reason
    view = await picture_with(cluster, 2)
    used: dict[int, int] = {}
    for outcome, gib in ((first, 3), (vcuda, 3)):
        index = index_of(cluster, outcome.containers[0].gpus[0])
        used[index] = used.get(index, 0) + gib
    address = view.nodes[0].address
    assert address == "127.0.0.1"  # the agent reaches NATS on loopback under `vgpu up`
    cells = [f"{used.get(i, 0)}/{A100_GIB}" for i in range(4)]
    row = f"node-1  {address}  " + "".join(c.ljust(23) for c in cells) + "6/160"
    raw_row = f"node-1\t{address}\t" + "".join(f"{c}\t" for c in cells) + "6/160\n"
    header = "NAME    IPADDRESS  " + "".join(
        f"GPU{i}(Allocated/Total)  " for i in range(4)) + "GPU Memory(GiB)"  # fmt: skip
    assert inspect_gpushare.summary(view).splitlines() == [
        header, row, "-" * (len(raw_row) + 20), "Allocated/Total GPU Memory In Cluster:",
        "6/160 (3%)  ",
    ]  # fmt: skip

    detail = inspect_gpushare.details(view).splitlines()
    assert detail[:4] == ["", "NAME:       node-1", f"IPADDRESS:  {address}", ""]
    assert detail[4].split() == ["NAME", "NAMESPACE", *(f"GPU{i}(Allocated)" for i in range(4))]
    pods = {line.split()[0]: line.split()[1:] for line in detail[5:7]}
    for name, outcome in (("binpack-1", first), ("vcuda", vcuda)):
        index = index_of(cluster, outcome.containers[0].gpus[0])
        assert pods[name] == ["default", *("3" if i == index else "0" for i in range(4))]
    assert detail[7].split() == ["Allocated", ":", "6", "(3%)"]
    assert detail[8].split() == ["Total", ":", "160"]
    assert detail[-1] == "Allocated/Total GPU Memory In Cluster:  6/160 (3%)  "

    # As a kubectl plugin, installed with the package: `kubectl inspect gpushare`.
    venv_bin = Path(sys.executable).parent
    environ = {**os.environ, "PATH": f"{venv_bin}:{os.environ['PATH']}",
               "VGPU_METRICS_URL": cluster.state().metrics_url,
               "VGPU_TOKEN": cluster.admin_token,
               "KUBECONFIG": str(tmp_path / "none")}  # fmt: skip
    for args, first_line in (
        (["inspect", "gpushare"], header),
        (["inspect", "gpushare", "-d"], ""),
    ):
        done = await asyncio.to_thread(
            subprocess.run, [str(venv_bin / "kubectl"), *args], env=environ,
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
        assert done.stdout.splitlines()[0] == first_line
        assert "Allocated/Total GPU Memory In Cluster:" in done.stdout


def test_tabwriter_aligns_as_gos() -> None:
    # Columns are blocks of consecutive lines; a line's last cell is never padded.
    text = "a\tbb\tlast\nccc\td\tx\nno tabs\nz\t\n"
    assert inspect_gpushare.tabwrite(text).splitlines() == [
        "a    bb  last", "ccc  d   x", "no tabs", "z  "]  # fmt: skip


def test_with_gpushares_mib_unit_the_amounts_are_mib() -> None:
    pod = {"metadata": {"name": "p"}, "spec": {"containers": [
        {"name": "c", "resources": {"limits": {"aliyun.com/gpu-mem": "3000"}}}]}}  # fmt: skip
    mib = RequestConfig(aliyun_unit_mib=1)
    assert gpushare.asked_gib(pod, mib) == {"c": 3000}
    assert gpushare.pod_total(pod, mib) == 3000
    annotations = gpushare.bind_annotations(3000, 0, 40960, now_ns=1, unit_mib=1)
    assert annotations["ALIYUN_COM_GPU_MEM_DEV"] == "40960"
