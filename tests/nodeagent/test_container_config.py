"""The real node agent's Allocate response, bound as a runtime binds it, holds a real process
to its slice, and nothing in the container changes that: the REAL allocator decides the slice,
the kubelet simulator admits the pod over the device plugin's gRPC, and the real compiled hook
runs under the simulated driver in a mount namespace with the response's mounts."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path

from prometheus_client import REGISTRY

from services.allocator.backend import LocalClusterBackend
from services.allocator.service import Allocator
from services.common.embedded_nats import EmbeddedNats
from services.nodeagent.grant import container_key
from services.simulators.scheduler import SchedulerSimulator
from tests.hook.container import Mount, container_argv, require_namespaces
from tests.hook.harness import CUDA_ERROR_OUT_OF_MEMORY, build_hook, hook_env, summary, tool
from tests.hook.test_container_config import HOLDER
from tests.nodeagent.harness import NODE, NodeDirs, gpu_pod, running_node, wait_until


async def in_container(
    argv: list[str], mounts: list[Mount], env: dict[str, str]
) -> subprocess.CompletedProcess[str]:
    """run_in_container without blocking the event loop the agent runs on."""
    proc = await asyncio.create_subprocess_exec(
        *container_argv(argv, mounts),
        env=env,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    return subprocess.CompletedProcess(argv, proc.returncode or 0, out.decode(), err.decode())


def hello_count() -> float:
    labels = {"node": NODE, "type": "hello"}
    return REGISTRY.get_sample_value("vgpu_nodeagent_relay_messages_total", labels) or 0.0


async def test_a_slice_holds_through_the_allocate_response_mounts(
    nats_server: EmbeddedNats, allocator: Allocator, dirs: NodeDirs, tmp_path: Path
) -> None:
    require_namespaces()
    built = build_hook()
    assert built.returncode == 0, built.stderr
    async with running_node(nats_server.url, dirs, resolve_timeout_s=15.0) as (kubelet, _):
        await wait_until(lambda: allocator.cluster.node(NODE) is not None, 10, "node known")
        pod = gpu_pod(
            "sliced",
            {"main": 1},
            extra_limits={"nvidia.com/gpumem": 1000, "nvidia.com/gpucores": 30},
        )
        backend = allocator.backend
        assert isinstance(backend, LocalClusterBackend)
        backend.add_pod(pod)
        scheduler = SchedulerSimulator(allocator.url + "/scheduler")
        try:
            scheduled = await scheduler.schedule(pod, [NODE])
        finally:
            await scheduler.close()
        assert scheduled.node == NODE, scheduled.describe()
        result = await kubelet.admit(pod)
        assert result.admitted, result.error
        (admitted,) = result.containers
        host_dir = dirs.container_root / container_key(admitted.device_ids)
        await wait_until((host_dir / "config" / "limits").exists, 15, "limit file")

        # The kubelet's records hold the response's mounts, read-only flags included.
        mounts = [Mount(m.host_path, m.container_path, m.read_only) for m in admitted.mounts]
        assert [(m.container_path, m.read_only) for m in mounts] == [
            ("/var/run/vgpu", True),
            ("/var/run/vgpu-state", False),
        ]
        escapes = {
            "VGPU_CONTAINER_DIR": "/nonexistent",
            "VGPU_LIMIT_WAIT_MS": "0",
            "VGPU_MEMORY_LIMIT_MIB": "40000",
            "VGPU_COMPUTE_POLICY": "off",
        }
        env = {**hook_env(tmp_path, tmp_path / "sim"), **admitted.envs, **escapes}
        proc = await in_container([tool("alloc_limit"), "100"], mounts, env)
        assert summary(proc)["allocated_mib"] == 1000, proc.stderr
        assert summary(proc)["result"] == CUDA_ERROR_OUT_OF_MEMORY
        assert "limits from /var/run/vgpu/limits for pod default/sliced, container main" in (
            proc.stderr
        )
        assert "ignoring VGPU_CONTAINER_DIR, VGPU_LIMIT_WAIT_MS, VGPU_MEMORY_LIMIT_MIB" in (
            proc.stderr
        )

        attack = "echo 'version=1\ndevice_count=0' > /var/run/vgpu/limits"
        refused = await in_container(["sh", "-c", attack], mounts, env)
        assert "Read-only file system" in refused.stderr

        # The hook reaches the agent's relay socket on the state mount.
        before = hello_count()
        holder = await asyncio.create_subprocess_exec(
            *container_argv([sys.executable, "-c", HOLDER, "600", "500"], mounts),
            env=env,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        assert holder.stdin and holder.stdout
        assert (await holder.stdout.readline()).decode().strip() == "held=0"
        await wait_until(lambda: hello_count() > before, 10, "the hook's hello")
        holder.stdin.write(b"\n")
        await holder.stdin.drain()
        more = (await holder.stdout.readline()).decode().strip()
        await asyncio.wait_for(holder.communicate(), 30)
        assert more == f"more={CUDA_ERROR_OUT_OF_MEMORY}"  # 600 + 500 > 1000
