"""The GPU-sharing fork's resourceConfig MIG rules through the real device-plugin edge:
`mig-3g.20gb:small:2` shares a MIG profile under a new name, `mig-1g.5gb:gpu:1` turns MIG
devices into plain `nvidia.com/gpu`, as the kubelet (simulator) sees them."""

from __future__ import annotations

from typing import Any

import pytest

from services.common.config import ConfigError
from services.common.embedded_nats import EmbeddedNats
from services.nodeagent.mig_plugin import mig_socket_name
from services.nodeagent.mig_resources import MigStrategyError
from services.nodeagent.service import NodeAgent
from services.nodeagent.settings import load_node_agent_settings
from tests.nodeagent.harness import NodeDirs, agent_settings, running_node

RULES = "mig-3g.20gb:small:2,mig-1g.5gb:gpu:1"


def pod(name: str, resource: str, count: int) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": "default", "uid": f"uid-{name}"},
        "spec": {
            "containers": [
                {"name": "main", "image": "cuda", "resources": {"limits": {resource: count}}}
            ]
        },
    }


node = running_node


async def test_mig_rules_rename_and_share_mig_profiles(
    nats_server: EmbeddedNats, dirs: NodeDirs
) -> None:
    async with node(
        nats_server.url,
        dirs,
        simulate="2xA100-40GB",
        simulate_mig="0:2x3g.20gb;1:3g.20gb,2x1g.5gb",
        resource_config=RULES,  # no mig_strategy: the rules imply mixed, as in the fork
    ) as (kubelet, agent):
        resources = set(kubelet.resources())
        assert {"nvidia.com/small", "nvidia.com/gpu", "nvidia.com/mig-2g.10gb"} <= resources
        # Renamed profiles are no longer advertised under NVIDIA's names.
        assert not {"nvidia.com/mig-3g.20gb", "nvidia.com/mig-1g.5gb"} & resources
        gpus = agent.gpus
        threes = {m.uuid for g in gpus for m in g.mig_devices if m.profile == "3g.20gb"}
        ones = {m.uuid for g in gpus for m in g.mig_devices if m.profile == "1g.5gb"}
        assert len(threes) == 3 and len(ones) == 2
        # Two replicas per 3g.20gb device, as time-slicing names them.
        small = set(kubelet.devices("nvidia.com/small"))
        assert small == {f"{uuid}::{n}" for uuid in threes for n in range(2)}
        # 1g.5gb devices are plain nvidia.com/gpu, on the agent's own socket (no vgpu slices:
        # every GPU is in MIG mode).
        assert set(kubelet.devices("nvidia.com/gpu")) == ones
        assert (dirs.plugin_dir / "vgpu.sock").is_socket()
        assert (dirs.plugin_dir / mig_socket_name("nvidia.com/small")).is_socket()

        # Two replicas go to two MIG devices while two have free replicas.
        two = await kubelet.admit(pod("two", "nvidia.com/small", 2))
        assert two.error == ""
        visible = two.containers[0].envs["NVIDIA_VISIBLE_DEVICES"].split(",")
        assert len(visible) == 2 and set(visible) <= threes
        # The next goes to the least-shared one: the third 3g.20gb device.
        one = await kubelet.admit(pod("one", "nvidia.com/small", 1))
        assert one.error == ""
        (third,) = threes - set(visible)
        assert one.containers[0].envs["NVIDIA_VISIBLE_DEVICES"] == third
        # Then the replicas left share devices; six replicas in all.
        rest = await kubelet.admit(pod("rest", "nvidia.com/small", 3))
        assert rest.error == ""
        assert "Available: 0" in (await kubelet.admit(pod("more", "nvidia.com/small", 1))).error
        # nvidia.com/gpu hands out a 1g.5gb MIG device, no hook.
        plain = await kubelet.admit(pod("plain", "nvidia.com/gpu", 1))
        assert plain.error == ""
        assert plain.containers[0].envs["NVIDIA_VISIBLE_DEVICES"] in ones
        assert plain.containers[0].mounts == []


async def test_a_mig_rule_onto_a_resource_the_node_serves_is_refused(
    nats_server: EmbeddedNats, dirs: NodeDirs
) -> None:
    agent = NodeAgent(
        agent_settings(
            nats_server.url,
            dirs,
            simulate="2xA100-40GB",
            simulate_mig="0:2x3g.20gb",  # GPU 1 keeps MIG off: served as nvidia.com/gpu
            resource_config="mig-3g.20gb:gpu:1",
        )
    )
    with pytest.raises(MigStrategyError, match=r"nvidia.com/gpu, which this node already "
                       r"advertises for GPU\(s\) \[1\]"):  # fmt: skip
        await agent.start()


def test_mig_rules_cannot_be_used_with_the_single_strategy_or_mps() -> None:
    with pytest.raises(ConfigError, match="mig_strategy single advertises every MIG device"):
        load_node_agent_settings(
            flags={"node_name": "n", "resource_config": RULES, "mig_strategy": "single"},
            environ={},
        )
    with pytest.raises(ConfigError, match="mps cannot be used with resource_config's MIG"):
        load_node_agent_settings(
            flags={"node_name": "n", "resource_config": RULES, "sharing_mode": "mps"},
            environ={},
        )


async def test_whole_gpus_renamed_and_mig_devices_as_nvidia_com_gpu(
    nats_server: EmbeddedNats, dirs: NodeDirs
) -> None:
    # The fork's two kinds of rule together: GPU 1 (MIG off) shared as nvidia.com/sharedgpu,
    # GPU 0's 3g.20gb devices freed nvidia.com/gpu to become plain GPUs.
    async with node(
        nats_server.url,
        dirs,
        simulate="2xA100-40GB",
        simulate_mig="0:2x3g.20gb",
        resource_config="gpu:sharedgpu:4,mig-3g.20gb:gpu:1",
    ) as (kubelet, agent):
        gpu0, gpu1 = agent.gpus
        assert set(kubelet.devices("nvidia.com/sharedgpu")) == {
            f"{gpu1.uuid}::{n}" for n in range(4)
        }
        assert set(kubelet.devices("nvidia.com/gpu")) == {m.uuid for m in gpu0.mig_devices}
        assert (dirs.plugin_dir / mig_socket_name("nvidia.com/gpu")).is_socket()
