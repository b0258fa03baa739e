"""Each sharing mode end to end under the local cluster `vgpu up --mode` runs: a pod
through the extender, the kubelet simulator and the node agent gets its devices and env."""

from __future__ import annotations

import asyncio
import copy
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from services.cli.inspect import fetch_picture
from services.cli.inspect import render as render_view
from services.cli.local_cluster import LocalCluster, LocalClusterSpec
from services.cli.submit import SubmitOutcome, load_pod, render, submit
from services.nodeagent.grant import HOOK_CONTAINER_PATH, MPS_LOG_MOUNT, MPS_PIPE_MOUNT

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


@asynccontextmanager
async def up(mode: str) -> AsyncIterator[LocalCluster]:
    local = LocalCluster(
        LocalClusterSpec(
            nodes=1, simulate="2xA100-40GB", allocator_port=0, metrics_port=0,
            heartbeat_s=1.0, mode=mode, split_count=4,
        )
    )  # fmt: skip
    await local.start()
    try:
        yield local
    finally:
        await local.stop()


def named(manifest: str, name: str, limits: dict[str, Any] | None = None) -> dict[str, Any]:
    pod = copy.deepcopy(load_pod(EXAMPLES / manifest))
    pod["metadata"]["name"] = name
    pod["metadata"]["uid"] = f"uid-{name}"
    if limits is not None:
        pod["spec"]["containers"][0]["resources"]["limits"] = limits
    return pod


def placed(outcome: SubmitOutcome) -> None:
    assert outcome.node is not None and not outcome.reason, outcome.reason


async def test_time_slicing_mode_end_to_end() -> None:
    async with up("time-slicing") as cluster:
        gpus = [gpu.uuid for gpu in cluster.agents["node-1"].gpus]
        seen = []
        for index in range(3):
            outcome = await submit(named("time-slicing.yaml", f"ts-{index}"), cluster.state())
            placed(outcome)
            (container,) = outcome.containers
            assert container.envs == {"NVIDIA_VISIBLE_DEVICES": container.gpus[0]}
            assert not container.mounts and not container.hooked
            seen.append(container.gpus[0])
        assert seen == [gpus[0], gpus[1], gpus[0]]  # least-shared first
        assert "limits: no hook" in render(outcome)
        # A slice asked of a time-slicing node is refused by the extender, naming why.
        refused = await submit(named("half-gpu.yaml", "half"), cluster.state())
        assert refused.node is None
        assert "time-slicing" in refused.reason and "no memory or compute limit" in refused.reason
        # The mode is in the inventory, so `vgpu inspect` shows it.
        url = cluster.state().metrics_url
        for _ in range(100):
            view = await asyncio.to_thread(fetch_picture, url, 5.0, cluster.admin_token)
            if view.nodes and view.nodes[0].gpus:
                break
            await asyncio.sleep(0.05)
        assert {(g.sharing_mode, g.replicas) for g in view.nodes[0].gpus} == {("time-slicing", 4)}
        assert "[time-slicing x4]" in render_view(view)


async def test_mps_mode_end_to_end() -> None:
    async with up("mps") as cluster:
        agent = cluster.agents["node-1"]
        assert agent.mps is not None and all(agent.mps.alive(g.uuid) for g in agent.gpus)
        outcome = await submit(named("half-gpu.yaml", "mps-half"), cluster.state())
        placed(outcome)
        (container,) = outcome.containers
        # The slice (20480 MiB, 50%) reaches the MPS client through the allocator's hint.
        assert container.envs["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "50"
        assert container.envs["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=20480M"
        assert container.envs["CUDA_MPS_PIPE_DIRECTORY"] == MPS_PIPE_MOUNT
        assert container.envs["CUDA_MPS_LOG_DIRECTORY"] == MPS_LOG_MOUNT
        pipe = next(m for m in container.mounts if m["container_path"] == MPS_PIPE_MOUNT)
        assert pipe["host_path"].endswith(f"{container.gpus[0]}/pipe")
        assert Path(pipe["host_path"], "control").exists()  # the daemon's control FIFO
        bare = await submit(named("time-slicing.yaml", "mps-bare"), cluster.state())
        placed(bare)
        # A bare count is an equal share per replica (split_count 4), as NVIDIA's MPS.
        assert bare.containers[0].envs["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "25"


async def test_exclusive_mode_end_to_end() -> None:
    async with up("exclusive") as cluster:
        for index in range(2):
            outcome = await submit(named("time-slicing.yaml", f"ex-{index}"), cluster.state())
            placed(outcome)
            paths = {m["container_path"] for m in outcome.containers[0].mounts}
            assert HOOK_CONTAINER_PATH not in paths
        third = await submit(named("time-slicing.yaml", "ex-2"), cluster.state())
        assert third.node is None and third.reason
        half = await submit(named("half-gpu.yaml", "ex-half"), cluster.state())
        assert half.node is None and "exclusive GPUs are given whole" in half.reason
