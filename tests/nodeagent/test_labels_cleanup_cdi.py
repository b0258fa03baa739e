"""Node labels (GFD-style), cleanup of gone containers' directories, and CDI responses."""

from __future__ import annotations

import os
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest
from aiohttp import web
from kubernetes import client as k8s

from services.common.embedded_nats import EmbeddedNats
from services.common.schemas import GpuDevice
from services.nodeagent.grant import container_key
from services.nodeagent.labels import KubernetesNodeLabeler, gpu_labels, label_value
from tests.nodeagent.harness import NodeDirs, gpu_pod, running_node


def gpu(index: int, model: str = "NVIDIA A100-SXM4-40GB", cc: str = "8.0") -> GpuDevice:
    return GpuDevice(
        uuid=f"GPU-{index}", index=index, model=model, memory_mib=40960, compute_capability=cc
    )


def test_gfd_style_labels() -> None:
    labels = gpu_labels([gpu(0), gpu(1), gpu(2, "Tesla T4", "7.5")], "550.54.15", "12.4", 10)
    assert labels == {
        "nvidia.com/gpu.product": "NVIDIA-A100-SXM4-40GB",
        "nvidia.com/gpu.count": "3",
        "nvidia.com/gpu.memory": "40960",
        "nvidia.com/gpu.replicas": "10",
        "nvidia.com/gpu.sharing-strategy": "vgpu",
        "nvidia.com/mig.capable": "false",
        "nvidia.com/gpu.compute.major": "8",
        "nvidia.com/gpu.compute.minor": "0",
        "nvidia.com/cuda.driver-version.full": "550.54.15",
        "nvidia.com/cuda.driver-version.major": "550",
        "nvidia.com/cuda.driver-version.minor": "54",
        "nvidia.com/cuda.driver-version.revision": "15",
        "nvidia.com/cuda.runtime-version.full": "12.4",
        "nvidia.com/cuda.runtime-version.major": "12",
        "nvidia.com/cuda.runtime-version.minor": "4",
        "vgpu.io/gpu.models": "NVIDIA-A100-SXM4-40GB.2_Tesla-T4.1",
    }
    assert gpu_labels([], "550", "12.4") == {}
    assert label_value("  A/B (x) ") == "A-B-x"
    assert len(label_value("x" * 100)) == 63


@pytest.fixture
async def api_server() -> AsyncIterator[tuple[str, list[tuple[str, str, Any]]]]:
    """A stand-in for the API server's node endpoint, over real HTTP."""
    seen: list[tuple[str, str, Any]] = []

    async def patch_node(request: web.Request) -> web.Response:
        seen.append((request.match_info["name"], request.content_type, await request.json()))
        return web.json_response({"kind": "Node", "metadata": {"name": "node-a"}})

    app = web.Application()
    app.router.add_patch("/api/v1/nodes/{name}", patch_node)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    yield f"http://127.0.0.1:{runner.addresses[0][1]}", seen
    await runner.cleanup()


async def test_kubernetes_labeler_patches_the_node(
    api_server: tuple[str, list[tuple[str, str, Any]]],
) -> None:
    url, seen = api_server
    configuration = k8s.Configuration(host=url)
    api = k8s.CoreV1Api(k8s.ApiClient(configuration))
    labeler = KubernetesNodeLabeler("node-a", api)
    await labeler.apply({"nvidia.com/gpu.count": "2", "nvidia.com/gpu.product": "A100"})
    await labeler.apply({"nvidia.com/gpu.count": "1"})
    assert [name for name, _, _ in seen] == ["node-a", "node-a"]
    assert all("merge-patch" in content_type for _, content_type, _ in seen)
    assert seen[0][2] == {
        "metadata": {"labels": {"nvidia.com/gpu.count": "2", "nvidia.com/gpu.product": "A100"}}
    }
    # A label set before and no longer wanted is removed (null in a merge patch).
    assert seen[1][2] == {
        "metadata": {"labels": {"nvidia.com/gpu.product": None, "nvidia.com/gpu.count": "1"}}
    }


async def test_directories_of_gone_containers_are_removed(
    nats_server: EmbeddedNats, dirs: NodeDirs
) -> None:
    async with running_node(nats_server.url, dirs, container_dir_grace_s=5.0) as (kubelet, agent):
        kept = await kubelet.admit(gpu_pod("kept", {"main": 1}))
        gone = await kubelet.admit(gpu_pod("gone", {"main": 1}))
        assert kept.admitted and gone.admitted
        kept_dir = dirs.container_root / container_key(kept.containers[0].device_ids)
        gone_dir = dirs.container_root / container_key(gone.containers[0].device_ids)
        assert kept_dir.is_dir() and gone_dir.is_dir()
        assert oct(kept_dir.stat().st_mode & 0o7777) == "0o700"  # the agent's alone
        assert oct((kept_dir / "state").stat().st_mode & 0o7777) == "0o1777"

        assert kubelet.remove("default", "gone")
        assert await agent.janitor.sweep() == []  # within its grace period: kept
        old = time.time() - 60
        for directory in (kept_dir, gone_dir):
            os.utime(directory, (old, old))
        assert await agent.janitor.sweep() == [gone_dir.name]
        assert not gone_dir.exists()
        assert kept_dir.is_dir()  # the kubelet still lists its container


async def test_nothing_is_removed_when_the_kubelet_does_not_answer(
    nats_server: EmbeddedNats, dirs: NodeDirs
) -> None:
    async with running_node(nats_server.url, dirs, container_dir_grace_s=0.0) as (kubelet, agent):
        result = await kubelet.admit(gpu_pod("p", {"main": 1}))
        directory = dirs.container_root / container_key(result.containers[0].device_ids)
        await kubelet.stop()
        assert await agent.janitor.sweep() == []
        assert directory.is_dir()


@pytest.mark.parametrize("strategy", ["cdi-cri", "cdi-annotations"])
async def test_cdi_device_list_strategies(
    nats_server: EmbeddedNats, dirs: NodeDirs, strategy: str
) -> None:
    async with running_node(nats_server.url, dirs, device_list_strategy=strategy) as (kubelet, _):
        result = await kubelet.admit(gpu_pod("cdi", {"main": 2}))
        assert result.admitted, result.error
        (container,) = result.containers
        assert "NVIDIA_VISIBLE_DEVICES" not in container.envs
        assert not any(name.startswith("VGPU_") for name in container.envs)
        uuids = list(dict.fromkeys(d.partition("::")[0] for d in container.device_ids))
        names = [f"nvidia.com/gpu={uuid}" for uuid in uuids]
        if strategy == "cdi-cri":
            assert container.cdi_devices == names
            assert container.annotations == {}
        else:
            key = container_key(container.device_ids)
            assert container.annotations == {f"cdi.k8s.io/vgpu_{key}": ",".join(names)}
            assert container.cdi_devices == []
