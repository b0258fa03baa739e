"""The proof that Allocate never mixes up pods: 20 pods of different shapes bound to one node
within a second through the REAL allocator, admitted by the kubelet simulator in a shuffled
order, and every container's limit file checked against its own request."""

from __future__ import annotations

import asyncio
import random
import time
from typing import Any

from services.allocator.backend import LocalClusterBackend
from services.allocator.service import Allocator
from services.common.embedded_nats import EmbeddedNats
from services.nodeagent.grant import container_key
from services.simulators.scheduler import SchedulerSimulator
from tests.nodeagent.harness import NODE, NodeDirs, running_node, wait_until

# Tight on purpose: with the allocator's default GPU policy (it packs) 4 GPUs hold the 20 pods'
# 30 slices with few task slots to spare. The kubelet asks GetPreferredAllocation without
# saying for which pod; in a shuffled admission the hint is often another pending container's,
# so a claim lands on GPUs reserved for containers that have not started yet. The allocator
# then re-plans around those unclaimed reservations (docs/allocator.md, "claim").
GPUS_PER_NODE = 4


def container(name: str, gpus: int, memory: int, cores: int, **extra: Any) -> dict[str, Any]:
    limits = {
        "nvidia.com/gpu": str(gpus),
        "nvidia.com/gpumem": str(memory),
        "nvidia.com/gpucores": str(cores),
    }
    return {"name": name, "image": "cuda:12", "resources": {"limits": limits}, **extra}


def pod(
    name: str, containers: list[dict[str, Any]], init: list[dict[str, Any]] | None = None
) -> dict[str, Any]:
    spec: dict[str, Any] = {"containers": containers, "schedulerName": "vgpu-scheduler"}
    if init:
        spec["initContainers"] = init
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": f"team-{len(name) % 3}", "uid": f"uid-{name}"},
        "spec": spec,
    }


def twenty_pods() -> list[dict[str, Any]]:
    """Every memory size distinct, so a mixed-up container is always caught. Memory is not
    the bottleneck (the sum fits one GPU), task slots are (10 per GPU, 30 slices here): which
    GPU the kubelet picks may differ from the allocator's plan in a shuffled admission, and the
    claim then moves the slice, re-planning unclaimed reservations that stand in the way;
    what must never happen is a container running with another's limits, or none."""
    pods = []
    for i in range(8):  # one container, one GPU
        pods.append(pod(f"single-{i}", [container("main", 1, 500 + 37 * i, 1 + i % 3)]))
    for i in range(4):  # two containers with different slices
        pair = [container("trainer", 1, 800 + 41 * i, 2), container("eval", 1, 300 + 43 * i, 1)]
        pods.append(pod(f"pair-{i}", pair))
    for i in range(3):  # multi-GPU
        pods.append(pod(f"multi-{i}", [container("main", 2, 1000 + 47 * i, 3)]))
    for i in range(3):  # a sidecar (restartable init container) beside the app
        sidecar = container("proxy", 1, 200 + 53 * i, 1, restartPolicy="Always")
        pods.append(pod(f"sidecar-{i}", [container("app", 1, 600 + 59 * i, 2)], [sidecar]))
    for i in range(2):  # a plain init container handing its device on to the app container
        setup = container("setup", 1, 400 + 61 * i, 1)
        pods.append(pod(f"init-{i}", [container("app", 1, 900 + 67 * i, 3)], [setup]))
    assert len(pods) == 20
    return pods


def expected_limits(spec: dict[str, Any]) -> dict[str, tuple[int, int, int]]:
    """container name -> (device_count, memory per GPU, cores)."""
    found = {}
    for c in spec.get("initContainers", []) + spec["containers"]:
        limits = c["resources"]["limits"]
        found[c["name"]] = (
            int(limits["nvidia.com/gpu"]),
            int(limits["nvidia.com/gpumem"]),
            int(limits["nvidia.com/gpucores"]),
        )
    return found


def read_limits(text: str) -> dict[str, str]:
    return dict(line.split("=", 1) for line in text.splitlines())


async def test_twenty_pods_shuffled_each_container_gets_its_own_limits(
    nats_server: EmbeddedNats, allocator: Allocator, dirs: NodeDirs
) -> None:
    async with running_node(
        nats_server.url, dirs, simulate=f"{GPUS_PER_NODE}xA100-40GB", resolve_timeout_s=20.0
    ) as (kubelet, _):
        await wait_until(
            lambda: (
                NODE in allocator.inventory.nodes()
                if hasattr(allocator.inventory, "nodes")
                else True
            ),
            what="allocator knows the node",
        )
        await asyncio.sleep(0.2)  # the first inventory reaches the allocator
        pods = twenty_pods()
        backend = allocator.backend
        assert isinstance(backend, LocalClusterBackend)
        for spec in pods:
            backend.add_pod(spec)
        scheduler = SchedulerSimulator(allocator.url + "/scheduler")
        try:
            started = time.monotonic()
            results = await asyncio.gather(*(scheduler.schedule(p, [NODE]) for p in pods))
            bind_s = time.monotonic() - started
        finally:
            await scheduler.close()
        assert [r.node for r in results] == [NODE] * 20, [r.describe() for r in results]
        assert bind_s < 5.0  # within a second on an idle machine; generous on a loaded one

        order = list(pods)
        random.Random(4).shuffle(order)
        admitted = {}
        for spec in order:
            result = await kubelet.admit(spec)
            assert result.admitted, result.error
            admitted[spec["metadata"]["name"]] = (spec, result)

        checked = 0
        for name, (spec, result) in admitted.items():
            wanted = expected_limits(spec["spec"])
            by_key: dict[str, list[str]] = {}
            for admitted_container in result.containers:
                key = container_key(admitted_container.device_ids)
                by_key.setdefault(key, []).append(admitted_container.name)
            for admitted_container in result.containers:
                key = container_key(admitted_container.device_ids)
                path = dirs.container_root / key / "config" / "limits"
                await wait_until(
                    path.exists, timeout_s=20, what=f"limits of {name}/{admitted_container.name}"
                )
                limits = read_limits(path.read_text())
                # A plain init container whose devices the app container took over shares its
                # directory (same device IDs): it runs with the app container's limits.
                owner = admitted_container.name
                if admitted_container.init and len(by_key[key]) > 1:
                    owner = next(n for n in by_key[key] if n != admitted_container.name)
                count, memory, cores = wanted[owner]
                assert (limits["namespace"], limits["pod"], limits["container"]) == (
                    spec["metadata"]["namespace"], name, owner,
                )  # fmt: skip
                assert limits["device_count"] == str(count)
                visible = admitted_container.envs["NVIDIA_VISIBLE_DEVICES"].split(",")
                assert [limits[f"device.{i}.uuid"] for i in range(count)] == visible
                for i in range(count):
                    assert limits[f"device.{i}.memory_limit_mib"] == str(memory), (name, owner)
                    assert limits[f"device.{i}.cores"] == str(cores), (name, owner)
                checked += 1
        assert checked == 29  # 8 + 4*2 + 3 + 3*2 + 2*2 containers
        # Every container claimed (but the plain init containers, whose devices the app
        # container took over: they are served as it), and no GPU holds more than it has.
        allocations = allocator.engine.allocations()
        unclaimed = sorted(
            (a.name, n) for a in allocations for n, c in a.containers.items() if not c.claimed
        )
        assert unclaimed == [("init-0", "setup"), ("init-1", "setup")]
        state = allocator.cluster.node(NODE)
        assert state is not None
        for gpu in state.gpus:
            assert gpu.used.memory_mib <= gpu.memory_mib and gpu.used.slots <= gpu.slots, gpu
