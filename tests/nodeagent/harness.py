"""Helpers for tests that run a node agent beside a simulated kubelet on real sockets."""

from __future__ import annotations

import asyncio
import shutil
import tempfile
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from services.nodeagent.gpus import GpuBackend
from services.nodeagent.service import NodeAgent
from services.nodeagent.settings import NodeAgentSettings
from services.simulators.kubelet import KubeletSimSettings, KubeletSimulator

NODE = "node-a"
RESOURCE = "nvidia.com/gpu"


@dataclass(frozen=True)
class NodeDirs:
    """Unix socket paths must stay under 108 bytes, hence a short directory under /tmp."""

    root: Path

    @property
    def plugin_dir(self) -> Path:
        return self.root / "dp"

    @property
    def pod_resources_socket(self) -> Path:
        return self.root / "pr" / "kubelet.sock"

    @property
    def container_root(self) -> Path:
        return self.root / "containers"

    @property
    def state_dir(self) -> Path:
        return self.root / "agent-state"

    @property
    def hook_library(self) -> Path:
        return self.root / "lib" / "libvgpu.so"


@asynccontextmanager
async def node_dirs() -> AsyncIterator[NodeDirs]:
    root = Path(tempfile.mkdtemp(dir="/tmp", prefix="vg"))
    try:
        yield NodeDirs(root)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def agent_settings(nats_url: str, dirs: NodeDirs, **overrides: Any) -> NodeAgentSettings:
    values: dict[str, Any] = {
        "node_name": NODE,
        "nats_url": nats_url,
        "simulate": "2xA100-40GB",
        "plugin_dir": str(dirs.plugin_dir),
        "pod_resources_socket": str(dirs.pod_resources_socket),
        "container_root": str(dirs.container_root),
        "state_dir": str(dirs.state_dir),
        "hook_library": str(dirs.hook_library),
        "heartbeat_s": 5.0,
        "usage_interval_s": 0.1,
        "resolve_timeout_s": 5.0,
    }
    values.update(overrides)
    return NodeAgentSettings(**values)


def kubelet_settings(dirs: NodeDirs, **overrides: Any) -> KubeletSimSettings:
    values: dict[str, Any] = {
        "node_name": NODE,
        "plugin_dir": str(dirs.plugin_dir),
        "pod_resources_socket": str(dirs.pod_resources_socket),
    }
    values.update(overrides)
    return KubeletSimSettings(**values)


@asynccontextmanager
async def running_node(
    nats_url: str, dirs: NodeDirs, backend: GpuBackend | None = None, **agent_overrides: Any
) -> AsyncIterator[tuple[KubeletSimulator, NodeAgent]]:
    """A started kubelet simulator with a registered node agent, every resource it registered
    listed by the kubelet; `backend` replaces the GPUs its settings would choose."""
    kubelet = KubeletSimulator(kubelet_settings(dirs))
    await kubelet.start()
    agent = NodeAgent(agent_settings(nats_url, dirs, **agent_overrides), backend)
    try:
        await agent.start()
        await agent.wait_registered(10)
        for resource in agent.resources:
            await kubelet.wait_for_resource(resource, timeout=10)
        yield kubelet, agent
    finally:
        await agent.stop()
        await kubelet.stop()


async def wait_until(
    condition: Callable[[], Any], timeout_s: float = 5.0, what: str = "condition"
) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")
        await asyncio.sleep(0.02)


def gpu_pod(
    name: str,
    containers: dict[str, int],
    *,
    namespace: str = "default",
    init_containers: dict[str, int] | None = None,
    uid: str = "",
    extra_limits: dict[str, int] | None = None,
) -> dict[str, Any]:
    """A v1.Pod asking `count` nvidia.com/gpu per container (0: no GPU resources at all)."""

    def container(cname: str, count: int) -> dict[str, Any]:
        spec: dict[str, Any] = {"name": cname, "image": "cuda:12"}
        if count:
            limits = {RESOURCE: str(count), **{k: str(v) for k, v in (extra_limits or {}).items()}}
            spec["resources"] = {"limits": limits}
        return spec

    pod: dict[str, Any] = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": namespace, "uid": uid or f"uid-{name}"},
        # As vgpu's admission webhook leaves it: the extender binds only its scheduler's pods.
        "spec": {
            "containers": [container(n, c) for n, c in containers.items()],
            "schedulerName": "vgpu-scheduler",
        },
    }
    if init_containers:
        pod["spec"]["initContainers"] = [container(n, c) for n, c in init_containers.items()]
    return pod
