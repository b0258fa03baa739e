"""Sharing modes through the real agent and the kubelet simulator, the way the kubelet
behaves: registration per mode and rename, ListAndWatch replicas, GetPreferredAllocation's
least-shared pick, Allocate per deviceListStrategy / deviceIDStrategy, failRequestsGreaterThanOne,
the fork's resource_config, exclusive GPUs, and MPS control daemons."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest

from services.common.embedded_nats import EmbeddedNats
from services.nodeagent.grant import (
    DEVICE_LIST_DIR,
    HOOK_CONTAINER_PATH,
    MPS_LOG_MOUNT,
    MPS_PIPE_MOUNT,
    PRELOAD_CONTAINER_PATH,
)
from services.nodeagent.service import NodeAgent
from services.simulators.kubelet import KubeletSimulator
from services.simulators.kubelet_records import AdmitResult
from tests.nodeagent.harness import NodeDirs, agent_settings, kubelet_settings, wait_until

SIM_MPS_CONTROL = f"{sys.executable} -m services.simulators.mps_control"


@asynccontextmanager
async def node(
    nats_url: str, dirs: NodeDirs, resource: str, **overrides: Any
) -> AsyncIterator[tuple[KubeletSimulator, NodeAgent]]:
    """A kubelet simulator and a registered agent advertising `resource`."""
    dirs.hook_library.parent.mkdir(parents=True, exist_ok=True)
    dirs.hook_library.write_bytes(b"\x7fELF")  # installed: vgpu GPUs would get it mounted
    kubelet = KubeletSimulator(kubelet_settings(dirs, device_resources=(resource,)))
    await kubelet.start()
    agent = NodeAgent(agent_settings(nats_url, dirs, resolve_timeout_s=0.5, **overrides))
    try:
        await agent.start()
        await agent.wait_registered(10)
        await kubelet.wait_for_resource(resource, timeout=10)
        yield kubelet, agent
    finally:
        await agent.stop()
        await kubelet.stop()


def pod(name: str, resource: str, count: int = 1) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": "default", "uid": f"uid-{name}"},
        "spec": {
            "containers": [
                {"name": "c", "image": "cuda", "resources": {"limits": {resource: str(count)}}}
            ]
        },
    }


def gpus_of(result: AdmitResult) -> list[str]:
    assert result.admitted, result.error
    return [d.split("::")[0] for d in result.containers[0].device_ids]


async def test_time_slicing_renamed_replicas_no_hook_least_shared_first(
    nats_server: EmbeddedNats, dirs: NodeDirs
) -> None:
    shared = "nvidia.com/gpu.shared"
    async with node(
        nats_server.url, dirs, shared,
        sharing_mode="time-slicing", sharing_replicas=4, shared_resource_name=shared,
    ) as (kubelet, agent):  # fmt: skip
        a, b = (gpu.uuid for gpu in agent.gpus)
        # Registered under the rename only, 4 replicas per GPU, NVIDIA's <uuid>::<n> IDs.
        assert "nvidia.com/gpu" not in kubelet.resources()
        assert sorted(kubelet.devices(shared)) == sorted(
            f"{u}::{n}" for u in (a, b) for n in range(4)
        )
        assert {gpu.sharing_mode for gpu in agent.gpus} == {"time-slicing"}
        assert {gpu.replicas for gpu in agent.gpus} == {4}
        placed = [gpus_of(await kubelet.admit(pod(f"p{i}", shared))) for i in range(4)]
        # Least-shared GPU first: the pods alternate between the two GPUs.
        assert [p[0] for p in placed] == [a, b, a, b]
        first = (await kubelet.admit(pod("p4", shared))).containers[0]
        assert first.envs == {"NVIDIA_VISIBLE_DEVICES": first.device_ids[0].split("::")[0]}
        paths = {m.container_path for m in first.mounts}
        assert HOOK_CONTAINER_PATH not in paths and PRELOAD_CONTAINER_PATH not in paths
        assert not first.mounts  # no hook, no limit files: the GPU alone
        # A 2-replica request may take two replicas of one GPU when needed.
        assert len((await kubelet.admit(pod("p5", shared, 2))).containers[0].device_ids) == 2


async def test_fail_requests_greater_than_one(nats_server: EmbeddedNats, dirs: NodeDirs) -> None:
    async with node(
        nats_server.url, dirs, "nvidia.com/gpu",
        sharing_mode="time-slicing", sharing_replicas=3, fail_requests_greater_than_one=True,
    ) as (kubelet, agent):  # fmt: skip
        # Stated in the inventory, so the allocator refuses such a pod before the kubelet.
        assert {gpu.one_replica_per_container for gpu in agent.gpus} == {True}
        refused = await kubelet.admit(pod("two", "nvidia.com/gpu", 2))
        assert not refused.admitted
        assert "UnexpectedAdmissionError" in refused.error
        assert "maximum request size for shared resources is 1" in refused.error
        assert (await kubelet.admit(pod("one", "nvidia.com/gpu", 1))).admitted


@pytest.mark.parametrize(
    ("strategy", "id_strategy"),
    [
        ("envvar", "uuid"),
        ("envvar", "index"),
        ("volume-mounts", "uuid"),
        ("volume-mounts", "index"),
        ("cdi-cri", "uuid"),
        ("cdi-annotations", "index"),
        ("cdi-cri,envvar", "index"),
    ],
)
async def test_allocate_per_device_list_and_id_strategy(
    nats_server: EmbeddedNats, dirs: NodeDirs, strategy: str, id_strategy: str
) -> None:
    async with node(
        nats_server.url, dirs, "nvidia.com/gpu",
        sharing_mode="time-slicing", sharing_replicas=2,
        device_list_strategy=strategy, device_id_strategy=id_strategy, pass_device_specs=True,
    ) as (kubelet, agent):  # fmt: skip
        index_of = {gpu.uuid: str(gpu.index) for gpu in agent.gpus}
        got = (await kubelet.admit(pod("p", "nvidia.com/gpu", 2))).containers[0]
        uuids = list(dict.fromkeys(d.split("::")[0] for d in got.device_ids))
        names = [index_of[u] for u in uuids] if id_strategy == "index" else uuids
        strategies = strategy.split(",")
        if "envvar" in strategies:
            assert got.envs["NVIDIA_VISIBLE_DEVICES"] == ",".join(names)
        if "volume-mounts" in strategies:
            assert got.envs["NVIDIA_VISIBLE_DEVICES"] == DEVICE_LIST_DIR
            assert sorted(m.container_path for m in got.mounts) == sorted(
                f"{DEVICE_LIST_DIR}/{n}" for n in names
            )
            assert {m.host_path for m in got.mounts} == {"/dev/null"}
        cdi = [f"nvidia.com/gpu={n}" for n in names]
        if "cdi-cri" in strategies:
            assert got.cdi_devices == cdi
        if "cdi-annotations" in strategies:
            assert list(got.annotations.values()) == [",".join(cdi)]
            assert all(k.startswith("cdi.k8s.io/") for k in got.annotations)
        if all(s.startswith("cdi-") for s in strategies):
            assert "NVIDIA_VISIBLE_DEVICES" not in got.envs and not got.devices
        else:  # passDeviceSpecs: the GPUs' /dev nodes
            per_gpu = [d.container_path for d in got.devices if d.container_path[-1].isdigit()]
            assert per_gpu == [f"/dev/nvidia{index_of[u]}" for u in uuids]
            assert {d.permissions for d in got.devices} == {"rw"}


async def test_resource_config_shares_under_a_new_name_two_gpus_when_possible(
    nats_server: EmbeddedNats, dirs: NodeDirs
) -> None:
    async with node(
        nats_server.url, dirs, "nvidia.com/sharedgpu", resource_config="gpu:sharedgpu:4"
    ) as (kubelet, agent):
        a, b = (gpu.uuid for gpu in agent.gpus)
        assert "nvidia.com/gpu" not in kubelet.resources()
        assert len(kubelet.devices("nvidia.com/sharedgpu")) == 8
        one = gpus_of(await kubelet.admit(pod("one", "nvidia.com/sharedgpu")))
        assert one == [a]
        # Two replicas: two physical GPUs, the least-shared (b) first.
        two = gpus_of(await kubelet.admit(pod("two", "nvidia.com/sharedgpu", 2)))
        assert two == [b, a]


async def test_exclusive_mode_one_id_per_gpu_and_per_gpu_modes(
    nats_server: EmbeddedNats, dirs: NodeDirs
) -> None:
    async with node(
        nats_server.url, dirs, "nvidia.com/gpu", split_count=5, gpu_sharing_modes="1=exclusive"
    ) as (kubelet, agent):
        vgpu, whole = agent.gpus
        assert (vgpu.sharing_mode, whole.sharing_mode) == ("vgpu", "exclusive")
        ids = sorted(kubelet.devices("nvidia.com/gpu"))
        assert ids == sorted([*(f"{vgpu.uuid}::{n}" for n in range(5)), f"{whole.uuid}::0"])


async def test_mps_daemons_started_watched_restarted_and_clients_get_their_share(
    nats_server: EmbeddedNats, dirs: NodeDirs
) -> None:
    mps_root = dirs.root / "mps"
    async with node(
        nats_server.url, dirs, "nvidia.com/gpu",
        sharing_mode="mps", sharing_replicas=4, mps_root=str(mps_root),
        mps_control=SIM_MPS_CONTROL, mps_watch_interval_s=0.1,
    ) as (kubelet, agent):  # fmt: skip
        daemons = agent.mps
        assert daemons is not None
        a, b = agent.gpus
        for gpu in (a, b):
            assert daemons.alive(gpu.uuid)
            assert (mps_root / gpu.uuid / "pipe" / "control").exists()
            log = (mps_root / gpu.uuid / "log" / "control.log").read_text()
            assert f"devices {gpu.uuid}" in log
            assert "set_default_active_thread_percentage 25" in log
        got = (await kubelet.admit(pod("p", "nvidia.com/gpu"))).containers[0]
        uuid = got.device_ids[0].split("::")[0]
        gpu = a if uuid == a.uuid else b
        # No allocator hint: an equal share per replica, as NVIDIA's MPS gives every client.
        assert got.envs == {
            "NVIDIA_VISIBLE_DEVICES": uuid,
            "CUDA_MPS_PIPE_DIRECTORY": MPS_PIPE_MOUNT,
            "CUDA_MPS_LOG_DIRECTORY": MPS_LOG_MOUNT,
            "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "25",
            "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": f"0={gpu.memory_mib // 4}M",
        }
        assert {(m.container_path, m.host_path) for m in got.mounts} == {
            (MPS_PIPE_MOUNT, str(mps_root / uuid / "pipe")),
            (MPS_LOG_MOUNT, str(mps_root / uuid / "log")),
        }
        # A daemon that dies is started again.
        old = daemons.pid(a.uuid)
        os.kill(old, signal.SIGKILL)
        await wait_until(
            lambda: daemons.restarts(a.uuid) == 1 and daemons.alive(a.uuid),
            5, "the MPS daemon to be restarted",
        )  # fmt: skip
        assert daemons.pid(a.uuid) != old
    # Stopping the agent quits the daemons.
    for gpu in (a, b):
        assert not (mps_root / gpu.uuid / "pipe" / "nvidia-cuda-mps-control.pid").exists()


async def test_mps_daemon_that_cannot_start_stops_the_agent(
    nats_server: EmbeddedNats, dirs: NodeDirs
) -> None:
    agent = NodeAgent(
        agent_settings(
            nats_server.url, dirs, sharing_mode="mps", mps_root=str(dirs.root / "mps"),
            mps_control=str(Path("/nonexistent/nvidia-cuda-mps-control")),
        )
    )  # fmt: skip
    with pytest.raises(RuntimeError, match="cannot run /nonexistent/nvidia-cuda-mps-control"):
        await agent.start()
    await asyncio.sleep(0)


async def test_list_and_watch_marks_every_replica_of_an_unhealthy_gpu(
    nats_server: EmbeddedNats, dirs: NodeDirs
) -> None:
    async with node(
        nats_server.url, dirs, "nvidia.com/gpu", sharing_mode="time-slicing", sharing_replicas=3
    ) as (kubelet, agent):
        a, b = (gpu.uuid for gpu in agent.gpus)
        agent.gpu_backend.set_healthy(b, False)  # type: ignore[attr-defined]
        await agent.refresh_devices()
        await wait_until(
            lambda: kubelet.devices("nvidia.com/gpu").get(f"{b}::2") == "Unhealthy",
            5, "the kubelet to see GPU b's replicas unhealthy",
        )  # fmt: skip
        health = kubelet.devices("nvidia.com/gpu")
        assert {health[f"{b}::{n}"] for n in range(3)} == {"Unhealthy"}
        assert {health[f"{a}::{n}"] for n in range(3)} == {"Healthy"}
        # The kubelet hands out only healthy replicas: four pods fill GPU a's three, then fail.
        for index in range(3):
            assert gpus_of(await kubelet.admit(pod(f"p{index}", "nvidia.com/gpu"))) == [a]
        assert not (await kubelet.admit(pod("p3", "nvidia.com/gpu"))).admitted
