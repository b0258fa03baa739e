"""Sharing modes chosen per node and per GPU by Node labels (`vgpu.io/mode`,
`vgpu.io/mode.<gpu index>`): applied by the real node agent at start, published in its
inventory and honoured by the allocator's placement, under the local cluster `vgpu up` runs."""

from __future__ import annotations

import copy
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest

from services.cli.local_cluster import LocalCluster, LocalClusterSpec, parse_node_labels
from services.cli.submit import load_pod, submit

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


@asynccontextmanager
async def up(node_labels: dict[str, dict[str, str]], nodes: int = 2) -> AsyncIterator[LocalCluster]:
    local = LocalCluster(
        LocalClusterSpec(
            nodes=nodes, simulate="2xA100-40GB", allocator_port=0, metrics_port=0,
            heartbeat_s=1.0, split_count=4, node_labels=node_labels,
        )
    )  # fmt: skip
    await local.start()
    try:
        yield local
    finally:
        await local.stop()


def named(manifest: str, name: str) -> dict[str, Any]:
    pod = copy.deepcopy(load_pod(EXAMPLES / manifest))
    pod["metadata"]["name"] = name
    pod["metadata"]["uid"] = f"uid-{name}"
    return pod


def allocator_modes(cluster: LocalCluster, node: str) -> list[tuple[int, str]]:
    assert cluster.allocator is not None
    gpus = cluster.allocator.inventory.gpus(node)
    assert gpus is not None
    return sorted((gpu.index, gpu.sharing_mode) for gpu in gpus)


async def test_node_and_gpu_labels_choose_modes_the_allocator_places_by() -> None:
    labels = {"node-2": {"vgpu.io/mode": "exclusive", "vgpu.io/mode.1": "time-slicing"}}
    async with up(labels) as cluster:
        # The agent applied the labels; the allocator sees them through the inventory.
        assert [g.sharing_mode for g in cluster.agents["node-1"].gpus] == ["vgpu", "vgpu"]
        assert [g.sharing_mode for g in cluster.agents["node-2"].gpus] == [
            "exclusive",
            "time-slicing",
        ]
        assert allocator_modes(cluster, "node-2") == [(0, "exclusive"), (1, "time-slicing")]
        # Slices go to node-1 only: node-2's GPUs cannot hold one. Two GPUs x two halves.
        for index in range(4):
            outcome = await submit(named("half-gpu.yaml", f"half-{index}"), cluster.state())
            assert outcome.node == "node-1" and not outcome.reason, outcome.reason
        refused = await submit(named("half-gpu.yaml", "half-4"), cluster.state())
        assert refused.node is None
        assert "node-2' can never hold it" in refused.reason, refused.reason
        assert "1 in exclusive mode refuse it" in refused.reason, refused.reason
        assert "1 in time-slicing mode refuse it" in refused.reason, refused.reason
        # A bare GPU now goes to node-2 (node-1 is full): a replica or the whole GPU.
        bare = await submit(named("time-slicing.yaml", "bare"), cluster.state())
        assert bare.node == "node-2" and not bare.reason, bare.reason
        assert not bare.containers[0].hooked  # no slice: no hook


async def test_a_label_naming_an_unknown_mode_stops_the_agent_naming_it() -> None:
    local = LocalCluster(
        LocalClusterSpec(
            nodes=1, simulate="1xA100-40GB", allocator_port=0, metrics_port=0,
            node_labels={"node-1": {"vgpu.io/mode.0": "slices"}},
        )
    )  # fmt: skip
    with pytest.raises(RuntimeError) as caught:
        await local.start()
    message = str(caught.value)
    assert "node-1" in message and "vgpu.io/mode.0=slices" in message
    assert "unknown sharing mode 'slices'" in message


def test_up_node_label_flag_is_checked() -> None:
    assert parse_node_labels(["node-2:vgpu.io/mode=mps"], 2) == {"node-2": {"vgpu.io/mode": "mps"}}
    with pytest.raises(ValueError, match="no node 'node-3'"):
        parse_node_labels(["node-3:vgpu.io/mode=mps"], 2)
    with pytest.raises(ValueError, match="expected NODE:KEY=VALUE"):
        parse_node_labels(["node-1:vgpu.io/mode"], 2)
