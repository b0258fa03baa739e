"""`vgpu up --mig` end to end: a pod asking a static MIG resource and a pod asking memory on
a dynamic-MIG GPU, each through the extender, the kubelet simulator and the node agent,
each getting its own MIG device."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from services.cli.local_cluster import LocalCluster, LocalClusterSpec
from services.cli.mig_layout import mig_layout
from services.cli.submit import load_pod, submit
from services.nodeagent.gpus.simulated import SimulatedGpuBackend

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


@pytest.fixture
async def cluster() -> AsyncIterator[LocalCluster]:
    local = LocalCluster(
        LocalClusterSpec(nodes=1, allocator_port=0, metrics_port=0, heartbeat_s=1.0, mig=True)
    )
    await local.start()
    yield local
    await local.stop()


def test_layout_splits_static_and_dynamic_gpus() -> None:
    layout = mig_layout("4xA100-40GB")
    assert layout.geometry == "0:3g.20gb,2g.10gb,1g.5gb,1g.5gb;2:3g.20gb,2g.10gb,1g.5gb,1g.5gb"
    assert (layout.dynamic, layout.strategy) == ("1,3", "mixed")
    assert mig_layout("1xT4,2xH100-80GB").geometry == "1:3g.40gb,2g.20gb,1g.10gb,1g.10gb"
    assert mig_layout("1xT4,2xH100-80GB").dynamic == "2"
    with pytest.raises(ValueError, match="--mig needs MIG-capable simulated GPUs"):
        mig_layout("2xT4")


async def test_static_and_dynamic_mig_pods_get_their_mig_devices(cluster: LocalCluster) -> None:
    (node,) = cluster.agents
    agent = cluster.agents[node]
    sim = agent.gpu_backend
    assert isinstance(sim, SimulatedGpuBackend)
    kubelet = cluster.kubelets[node]
    assert kubelet.resources()["nvidia.com/mig-1g.5gb"]["devices"] == 4  # 2 per static GPU

    static = await submit(load_pod(EXAMPLES / "mig-1g-5gb.yaml"), cluster.state())
    assert static.node == node, static.reason
    (container,) = static.containers
    (device,) = container.gpus
    owners = {m.uuid: (gpu.index, m.profile) for gpu in agent.gpus for m in gpu.mig_devices}
    assert device.startswith("MIG-") and owners[device][1] == "1g.5gb"
    assert owners[device][0] in (0, 2)  # a statically partitioned GPU

    dynamic = await submit(load_pod(EXAMPLES / "mig-dynamic.yaml"), cluster.state())
    assert dynamic.node == node, dynamic.reason
    (container,) = dynamic.containers
    (device,) = container.gpus
    made = {
        m.uuid: (gpu.index, m.profile)
        for gpu in agent.gpus
        if gpu.mig_dynamic
        for m in sim.mig_devices(gpu.uuid)
    }
    assert made == {device: (1, "1g.10gb")}  # 8000 MiB: the smallest fitting profile
