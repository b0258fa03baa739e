"""Simulated GPUs report the load of what really runs: nothing while idle, a synthetic
workload inside each admitted container's slice, and nothing again once cleanup removed it.

Real parts throughout: a nats-server, the kubelet simulator, the node agent with
`simulate="2xA100-40GB"`, and a small ALLOC_CLAIM responder standing in for the allocator
(10 GiB and 30 % of each GPU, as in test_resolver).
"""

from __future__ import annotations

import os
import time

import pytest

from services.common import subjects
from services.common.bus import Bus
from services.common.embedded_nats import EmbeddedNats
from services.common.schemas import ClaimRequest, GpuUsage, NodeUsage
from services.nodeagent.gpus.simulated import SimulatedGpuBackend, simulated_pid
from services.nodeagent.grant import container_key
from tests.nodeagent.harness import NODE, NodeDirs, gpu_pod, running_node, wait_until
from tests.nodeagent.test_resolver import ClaimResponder

SLICE_MIB, SLICE_CORES = 10240, 30  # what ClaimResponder decides per GPU


class UsageInbox:
    def __init__(self) -> None:
        self.messages: list[NodeUsage] = []

    async def __call__(self, message: NodeUsage) -> None:
        self.messages.append(message)

    def since(self, count: int) -> list[dict[str, GpuUsage]]:
        return [{g.uuid: g for g in m.gpus} for m in self.messages[count:]]


@pytest.fixture
async def usages(bus: Bus) -> UsageInbox:
    inbox = UsageInbox()
    await bus.subscribe(subjects.usage(NODE), NodeUsage, inbox)
    await bus.serve(
        subjects.ALLOC_CLAIM, ClaimRequest, ClaimResponder(), queue=subjects.ALLOCATOR_QUEUE
    )
    await bus.client.flush()
    return inbox


def is_idle(usage: GpuUsage) -> bool:
    return (usage.memory_used_mib, usage.sm_util_percent, usage.memory_util_percent) == (0, 0, 0)


def in_slice(usage: GpuUsage) -> bool:
    return (
        0.5 * SLICE_MIB <= usage.memory_used_mib <= 0.9 * SLICE_MIB
        and 0 < usage.sm_util_percent <= SLICE_CORES
    )


async def test_published_usage_follows_the_admitted_container(
    nats_server: EmbeddedNats, usages: UsageInbox, dirs: NodeDirs
) -> None:
    async with running_node(nats_server.url, dirs) as (kubelet, agent):
        gpus = [g.uuid for g in agent.gpus]
        # Nothing admitted yet: both GPUs idle, in every sample.
        await wait_until(lambda: len(usages.messages) >= 3, what="usage samples while idle")
        assert all(is_idle(s[g]) for s in usages.since(0) for g in gpus)

        result = await kubelet.admit(gpu_pod("busy", {"main": 1}))
        assert result.admitted, result.error
        (container,) = result.containers
        key = container_key(container.device_ids)
        await wait_until(
            (dirs.container_root / key / "config" / "limits").exists, what="limit file"
        )
        busy = container.envs["NVIDIA_VISIBLE_DEVICES"]
        (other,) = [g for g in gpus if g != busy]

        seen = len(usages.messages)
        await wait_until(lambda: len(usages.messages) >= seen + 3, what="samples while busy")
        samples = usages.since(seen)  # the first may have been sampled before the claim
        assert all(in_slice(s[busy]) for s in samples[1:]), [s[busy] for s in samples]
        assert all(is_idle(s[other]) for s in samples)  # never touched
        backend = agent.gpu_backend
        assert isinstance(backend, SimulatedGpuBackend)
        assert [(p.pid, p.uuid) for p in backend.processes()] == [(simulated_pid(key), busy)]

        # The pod goes; once the janitor removes its directory the GPU is idle again.
        assert kubelet.remove("default", "busy")
        old = time.time() - 3600
        os.utime(dirs.container_root / key, (old, old))
        assert await agent.janitor.sweep() == [key]
        seen = len(usages.messages)
        await wait_until(lambda: len(usages.messages) >= seen + 3, what="samples after cleanup")
        # The first sample may have been taken before the sweep; the rest are idle.
        assert all(is_idle(s[g]) for s in usages.since(seen + 1) for g in gpus)
        assert backend.processes() == []


async def test_a_restarted_agent_loads_the_gpus_of_containers_still_running(
    nats_server: EmbeddedNats, usages: UsageInbox, dirs: NodeDirs
) -> None:
    async with running_node(nats_server.url, dirs) as (kubelet, _):
        result = await kubelet.admit(gpu_pod("long", {"main": 2}))
        assert result.admitted, result.error
        key = container_key(result.containers[0].device_ids)
        await wait_until(
            (dirs.container_root / key / "config" / "limits").exists, what="limit file"
        )
    # A new agent on the same node finds the directory and serves it again at once.
    async with running_node(nats_server.url, dirs) as (_, agent):
        seen = len(usages.messages)
        await wait_until(lambda: len(usages.messages) >= seen + 2, what="samples after restart")
        assert all(in_slice(s[g.uuid]) for s in usages.since(seen + 1) for g in agent.gpus)
