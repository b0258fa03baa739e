"""Sharing modes from the Node's labels, read through the Kubernetes API as in a cluster:
the real kubernetes client against the fake API server, the real agent and kubelet simulator."""

from __future__ import annotations

import kubernetes.client as k8s
import pytest

from services.common.embedded_nats import EmbeddedNats
from services.nodeagent.labels import KubernetesNodeLabeler
from services.nodeagent.mode_labels import ModeLabelError, modes_from_labels, with_label_modes
from services.nodeagent.service import NodeAgent
from services.nodeagent.settings import NodeAgentSettings
from services.simulators.apiserver import FakeApiServer
from services.simulators.kubelet import KubeletSimulator
from tests.nodeagent.harness import NODE, RESOURCE, NodeDirs, agent_settings, kubelet_settings


def labeler(url: str) -> KubernetesNodeLabeler:
    return KubernetesNodeLabeler(NODE, k8s.CoreV1Api(k8s.ApiClient(k8s.Configuration(host=url))))


def test_labels_are_read_with_their_meaning() -> None:
    base = NodeAgentSettings(node_name="n", sharing_mode="mps", gpu_sharing_modes="0=exclusive")
    assert modes_from_labels({"nvidia.com/gpu.count": "2"}) == ("", {})
    assert with_label_modes(base, {}) is base  # no label: the settings as they are
    chosen = with_label_modes(base, {"vgpu.io/mode": "vgpu", "vgpu.io/mode.01": "time-slicing"})
    assert chosen.sharing_mode == "vgpu"
    assert chosen.gpu_sharing_modes == "0=exclusive,1=time-slicing"  # index 01 is GPU 1
    relabelled = with_label_modes(base, {"vgpu.io/mode.0": "vgpu"})
    assert relabelled.sharing_mode == "mps" and relabelled.gpu_sharing_modes == "0=vgpu"


@pytest.mark.parametrize(
    ("labels", "named"),
    [
        ({"vgpu.io/mode": "shared"}, "node label vgpu.io/mode=shared: unknown sharing mode"),
        ({"vgpu.io/mode.x": "mps"}, "node label vgpu.io/mode.x: expected vgpu.io/mode.<GPU"),
        ({"vgpu.io/mode.1": "MPS"}, "node label vgpu.io/mode.1=MPS: unknown sharing mode"),
    ],
)
def test_bad_labels_are_named(labels: dict[str, str], named: str) -> None:
    with pytest.raises(ModeLabelError, match=named.replace(".", r"\.")):
        modes_from_labels(labels)


async def test_the_agent_takes_its_modes_from_its_node_object(
    nats_server: EmbeddedNats, dirs: NodeDirs, api: FakeApiServer
) -> None:
    api.add_node(NODE, labels={"vgpu.io/mode": "exclusive", "vgpu.io/mode.1": "time-slicing"})
    kubelet = KubeletSimulator(kubelet_settings(dirs))
    await kubelet.start()
    agent = NodeAgent(
        agent_settings(nats_server.url, dirs, split_count=4), labeler=labeler(api.url)
    )
    try:
        await agent.start()
        ids = sorted(await kubelet.wait_for_resource(RESOURCE, timeout=10))
        assert [(g.sharing_mode, g.replicas) for g in agent.gpus] == [
            ("exclusive", 1),
            ("time-slicing", 4),
        ]
        # The kubelet sees one device for the exclusive GPU and four replicas of the other.
        exclusive, shared = (gpu.uuid for gpu in agent.gpus)
        assert ids == sorted([f"{exclusive}::0", *(f"{shared}::{n}" for n in range(4))])
    finally:
        await agent.stop()
        await kubelet.stop()


async def test_an_unreadable_node_stops_the_agent_with_the_reason(
    nats_server: EmbeddedNats, dirs: NodeDirs, api: FakeApiServer
) -> None:
    # No Node object named NODE: the API answers 404.
    agent = NodeAgent(agent_settings(nats_server.url, dirs), labeler=labeler(api.url))
    with pytest.raises(RuntimeError) as caught:
        await agent.start()
    message = str(caught.value)
    assert f"node {NODE}: cannot read its labels for vgpu.io/mode" in message
    assert "mode_labels=false" in message
    # With mode_labels off, the settings alone choose (nothing is read).
    quiet = NodeAgent(
        agent_settings(nats_server.url, dirs, mode_labels=False), labeler=labeler(api.url)
    )
    await quiet.start()
    try:
        assert {g.sharing_mode for g in quiet.gpus} == {"vgpu"}
    finally:
        await quiet.stop()
