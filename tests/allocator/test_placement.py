"""Placement on nodes through the placement core: fit, policies, selection. No I/O."""

from __future__ import annotations

from typing import Any

import pytest

from services.allocator.cluster import CapacityConfig, ClusterState
from services.allocator.core import PlacementCore, PodRef, Unplaceable
from services.allocator.fragmentation import Shape, WorkloadMix
from services.allocator.ledger import Ledger
from services.allocator.placement import describe_request
from services.common.schemas import ContainerRequest, GpuDevice, NodeInventory

from .helpers import A100_MIB, container, gpu, pod


def make_core(
    *inventories: NodeInventory, policy: str = "binpack", **capacity: Any
) -> PlacementCore:
    cluster = ClusterState(15, CapacityConfig(**capacity))
    for inventory in inventories:
        cluster.update(inventory)
    return PlacementCore(cluster, Ledger(cluster), node_policy=policy, gpu_policy=policy)


def node(name: str = "n", count: int = 4, **fields: Any) -> NodeInventory:
    return NodeInventory(node=name, gpus=[gpu(name, i) for i in range(count)], **fields)


def place(core: PlacementCore, p: dict[str, Any], on: str = "n") -> dict[str, list[str]]:
    request = core.parse(p)
    allocation = core.commit(
        PodRef("default", p["metadata"]["name"], p["metadata"]["uid"]), on, request
    )
    return {name: [s.uuid for s in c.slices] for name, c in allocation.containers.items()}


def test_binpack_fills_the_fuller_gpu_and_spread_the_emptier() -> None:
    for policy, expected in (("binpack", "GPU-n-0"), ("spread", "GPU-n-1")):
        core = make_core(node(count=2), policy=policy)
        place(core, pod("first", [container("m", mem=10000)]))  # lands on GPU 0 either way
        assert place(core, pod("second", [container("m", mem=1000)])) == {"m": [expected]}


def test_ties_go_to_the_lowest_index_and_gpus_are_distinct() -> None:
    core = make_core(node(count=4))
    assert place(core, pod("a", [container("m", gpus=3, mem=1000)])) == {
        "m": ["GPU-n-0", "GPU-n-1", "GPU-n-2"]
    }


def test_memory_percent_is_of_the_card_minus_the_reserve() -> None:
    core = make_core(node(count=1), memory_reserve_mib=960)
    p = pod("p", [container("m", percent=50)])
    allocation = core.commit(PodRef("default", "p", p["metadata"]["uid"]), "n", core.parse(p))
    assert allocation.containers["m"].slices[0].memory_mib == (A100_MIB - 960) // 2
    whole = pod("w", [container("m", gpus=1)])
    with pytest.raises(Unplaceable, match="all of its memory"):
        core.commit(PodRef("default", "w", "u"), "n", core.parse(whole))


def test_unhealthy_and_mig_gpus_are_skipped() -> None:
    gpus = [
        GpuDevice(uuid="G0", index=0, model="A100", memory_mib=A100_MIB, healthy=False),
        GpuDevice(uuid="G1", index=1, model="A100", memory_mib=A100_MIB, mig_mode=True),
        GpuDevice(uuid="G2", index=2, model="A100", memory_mib=A100_MIB),
    ]
    core = make_core(NodeInventory(node="n", gpus=gpus))
    assert place(core, pod("p", [container("m", mem=1)])) == {"m": ["G2"]}


def test_no_fit_names_container_request_and_room() -> None:
    core = make_core(NodeInventory(node="n", gpus=[gpu("n", 0, healthy=False), gpu("n", 1)]))
    outcome = core.filter(
        core.parse(pod("p", [container("train", gpus=2, mem=20000, cores=30)])), ["n"]
    )
    message = outcome.failed["n"]
    assert "'train'" in message
    assert "nvidia.com/gpu: 2, nvidia.com/gpumem: 20000, nvidia.com/gpucores: 30" in message
    assert "2 GPUs each with 20000 MiB and 30% compute free" in message
    assert "1 of 2 GPUs have that room, 1 unhealthy" in message


def test_task_slots_limit_sharers_per_gpu() -> None:
    core = make_core(node(count=1), split_count=2)
    place(core, pod("a", [container("m", mem=10)]))
    place(core, pod("b", [container("m", mem=10)]))
    outcome = core.filter(core.parse(pod("c", [container("m", mem=10)])), ["n"])
    assert "0 of 1 GPUs have that room" in outcome.failed["n"]


def test_oversubscription_scales_memory_and_marks_the_record() -> None:
    core = make_core(node(count=1), node_memory_scaling={"n": 2.0})
    p1, p2 = pod("a", [container("m", mem=30000)]), pod("b", [container("m", mem=30000)])
    place(core, p1)
    record = core.commit(PodRef("default", "b", p2["metadata"]["uid"]), "n", core.parse(p2))
    assert record.memory_scaling == 2.0 and record.policy == "binpack/binpack"


def test_gpu_type_and_uuid_selection() -> None:
    gpus = [
        GpuDevice(uuid="T0", index=0, model="Tesla T4", memory_mib=15000),
        GpuDevice(uuid="A0", index=1, model="NVIDIA A100-SXM4-40GB", memory_mib=A100_MIB),
        GpuDevice(uuid="A1", index=2, model="NVIDIA A100-SXM4-40GB", memory_mib=A100_MIB),
    ]
    core = make_core(NodeInventory(node="n", gpus=gpus))
    p = pod("p", [container("m", mem=100)])
    p["metadata"]["annotations"] = {
        "nvidia.com/use-gputype": "a100",
        "nvidia.com/nouse-gpuuuid": "A0",
    }
    assert place(core, p) == {"m": ["A1"]}
    nobody = pod("q", [container("m", mem=100)])
    nobody["metadata"]["annotations"] = {"nvidia.com/use-gputype": "H100"}
    outcome = core.filter(core.parse(nobody), ["n", "other"])
    reason = outcome.unresolvable["other"]
    assert "can never fit" in reason and "nvidia.com/use-gputype=h100" in reason


def test_numa_binding_keeps_a_container_on_one_numa_node() -> None:
    gpus = [
        GpuDevice(uuid=f"G{i}", index=i, model="A100", memory_mib=A100_MIB, numa_node=i % 2)
        for i in range(4)
    ]
    core = make_core(NodeInventory(node="n", gpus=gpus))
    p = pod("p", [container("m", gpus=2, mem=100)])
    p["metadata"]["annotations"] = {"nvidia.com/numa-bind": "true"}
    assert place(core, p) == {"m": ["G0", "G2"]}
    three = pod("q", [container("m", gpus=3, mem=100)])
    three["metadata"]["annotations"] = {"nvidia.com/numa-bind": "true"}
    outcome = core.filter(core.parse(three), ["n"])
    assert "nvidia.com/numa-bind" in outcome.unresolvable["n"]


def test_topology_prefers_nvlink_connected_gpus() -> None:
    links = {0: ["G3"], 3: ["G0"], 1: ["G2"], 2: ["G1"]}
    gpus = [
        GpuDevice(uuid=f"G{i}", index=i, model="A100", memory_mib=A100_MIB, nvlink_peers=links[i])
        for i in range(4)
    ]
    core = make_core(NodeInventory(node="n", gpus=gpus), policy="topology")
    assert place(core, pod("p", [container("m", gpus=2, mem=100)])) == {"m": ["G0", "G3"]}
    p = pod("q", [container("m", gpus=2, mem=100)])
    p["metadata"]["annotations"] = {"hami.io/gpu-scheduler-policy": "spread"}
    assert place(core, p) == {"m": ["G1", "G2"]}  # the pod's own policy wins


def test_fgd_avoids_leaving_a_sliver_no_common_shape_can_use() -> None:
    core = make_core(node(count=2), policy="fgd")
    core.mix = WorkloadMix(seed=[Shape(gpus=1, memory_percent=50, cores=50)] * 10)
    place(core, pod("a", [container("m", percent=40, cores=40)]))  # GPU 0 keeps 60%
    # Binpack would put a half on GPU 0 and leave 10% nobody can use; FGD takes GPU 1.
    assert place(core, pod("b", [container("m", percent=50, cores=50)])) == {"m": ["GPU-n-1"]}
    binpack = make_core(node(count=2), policy="binpack")
    place(binpack, pod("a", [container("m", percent=40, cores=40)]))
    assert place(binpack, pod("b", [container("m", percent=50, cores=50)])) == {"m": ["GPU-n-0"]}


def test_fgd_node_scores_are_relative() -> None:
    core = make_core(node("n1", count=1), node("n2", count=1), policy="fgd")
    core.mix = WorkloadMix(seed=[Shape(gpus=1, memory_percent=50, cores=50)] * 10)
    place(core, pod("a", [container("m", percent=40, cores=40)]), on="n1")
    scores = core.prioritize(
        core.parse(pod("b", [container("m", percent=50, cores=50)])), ["n1", "n2"]
    )
    assert scores == {"n1": 0, "n2": 10}


def test_capacity_and_never_fits() -> None:
    core = make_core(node("small", count=1), node("big", count=4))
    outcome = core.filter(core.parse(pod("p", [container("main", gpus=2)])), ["small", "big"])
    assert outcome.passed == ["big"]
    assert "'small' can never hold it" in outcome.unresolvable["small"]
    never = core.filter(core.parse(pod("q", [container("wide", gpus=5)])), ["small"])
    assert "most GPUs on one node: 4" in never.unresolvable["small"]
    together = core.filter(
        core.parse(pod("r", [container("x", gpus=4), container("y", gpus=1)])), ["big"]
    )
    assert "together" in together.unresolvable["big"]


def test_describe_request() -> None:
    def req(gpus: int = 1, pct: int = 0, cores: int = 0) -> ContainerRequest:
        return ContainerRequest(container="c", gpus=gpus, memory_percent=pct, cores=cores)

    assert describe_request(req(cores=100)) == "nvidia.com/gpu: 1"
    assert (
        describe_request(req(pct=25, cores=100))
        == "nvidia.com/gpu: 1, nvidia.com/gpumem-percentage: 25, nvidia.com/gpucores: 100"
    )


def test_best_node_drives_filter_prioritize_and_pick_without_http() -> None:
    core = make_core(node("n1", count=1), node("n2", count=1))
    place(core, pod("a", [container("m", mem=10000)]), on="n2")
    assert core.best_node(core.parse(pod("b", [container("m", mem=1000)]))) == "n2"  # binpack
    assert core.best_node(core.parse(pod("c", [container("m", mem=10**6)]))) is None


def test_node_capacity_hints_bound_cpu_and_memory_when_reported() -> None:
    core = make_core(node("n", count=2, cpu_milli=4000, host_memory_mib=8192))

    def cpu_pod(name: str, cpu: str) -> dict[str, Any]:
        p = pod(name, [container("m", mem=10)])
        p["spec"]["containers"][0]["resources"]["requests"] = {
            "cpu": cpu,
            "nvidia.com/gpumem": "10",
        }
        return p

    place(core, cpu_pod("a", "3"))
    outcome = core.filter(core.parse(cpu_pod("b", "2")), ["n"])
    assert "the pod needs 2000m CPU; 1000m of 4000m free" in outcome.failed["n"]
    never = core.filter(core.parse(cpu_pod("c", "5")), ["n"])
    assert "the pod needs 5000m CPU" in never.unresolvable["n"]
    assert "largest node: 4000m CPU" in never.unresolvable["n"]
    assert core.filter(core.parse(cpu_pod("d", "500m")), ["n"]).passed == ["n"]


def test_equivalent_nodes_share_a_result_but_each_gets_its_own_gpus_and_reasons() -> None:
    core = make_core(node("a", count=2), node("b", count=2), node("c", count=1))
    big = core.parse(pod("big", [container("m", gpus=2, mem=1000)]))
    # b is scored from a's result (same signature): it still places on b's own GPUs.
    assert core.filter(big, ["a", "b", "c"]).passed == ["a", "b"]
    assert core._shared, "equivalent nodes should have shared one evaluation"
    assert place(core, pod("big", [container("m", gpus=2, mem=1000)]), on="b") == {
        "m": ["GPU-b-0", "GPU-b-1"]
    }
    # An unfit result shared between a and an equivalent node names each node.
    core.cluster.update(node("d", count=2))
    place(core, pod("fill-a", [container("m", gpus=2, mem=A100_MIB)]), on="a")
    place(core, pod("fill-d", [container("m", gpus=2, mem=A100_MIB)]), on="d")
    failed = core.filter(big, ["a", "d"]).failed
    assert failed["a"].startswith("node 'a':") and failed["d"].startswith("node 'd':")
    assert "0 of 2 GPUs have that room" in failed["d"]


def test_uuid_selection_is_never_shared_between_equivalent_nodes() -> None:
    core = make_core(node("a", count=1), node("b", count=1))
    only_b = pod("p", [container("m", mem=1000)])
    only_b["metadata"]["annotations"] = {"nvidia.com/use-gpuuuid": "GPU-b-0"}
    outcome = core.filter(core.parse(only_b), ["a", "b"])
    assert outcome.passed == ["b"] and "a" in outcome.unresolvable


def cpu_only(name: str, cpu: str, memory: str = "1Gi") -> dict[str, Any]:
    return pod(name, [{"name": "m", "resources": {"requests": {"cpu": cpu, "memory": memory}}}])


def test_pods_without_gpus_are_scored_where_their_cpu_strands_no_gpu() -> None:
    """hostpack's host score for a pod without GPUs: a node whose GPUs are all taken (full)
    or that vgpu has no inventory of (unknown) loses nothing; a node whose free GPUs would be
    left without CPU to feed them (free) scores lower; a node without room scores 0."""
    fields = {"cpu_milli": 64000, "host_memory_mib": 262144, "max_pods": 110}
    core = make_core(node("full", **fields), node("free", **fields),
                     node("crowded", **{**fields, "max_pods": 1}), policy="hostpack")  # fmt: skip
    place(core, pod("whole", [container("m", gpus=4)]), on="full")
    place(core, cpu_only("web", "1"), on="crowded")
    request = core.parse(cpu_only("batch", "40"))
    assert request.cpu_milli == 40000 and not request.containers
    names = ["free", "full", "unknown", "crowded"]
    assert core.prioritize(request, names) == {"free": 0, "full": 10, "unknown": 10, "crowded": 0}
    raw = core.cpu_pod_scores(request, names)
    assert raw["full"] == raw["unknown"] == 0.0 > raw["free"] and "crowded" not in raw
    # Among the best, the most CPU and memory left (LeastAllocated), then the name.
    assert core.best_node(request, names) == "unknown"
    assert core.best_node(request, ["free", "full"]) == "full"
    # A tiny pod strands nothing anywhere: it goes where no free GPU needs the CPU.
    small = core.parse(cpu_only("tiny", "100m"))
    assert core.prioritize(small, ["free", "full"]) == {"free": 0, "full": 10}
    assert core.best_node(small, ["free", "full"]) == "full"


def test_pods_without_gpus_keep_off_the_cpu_that_free_gpus_need() -> None:
    """Where no node would strand a GPU, a pod without GPUs goes where the free GPUs need the
    smallest share of the CPU left: a 2-GPU node with 104 cores before an idle 8-GPU node
    with 128 (whose CPU an 8-GPU pod asking 120 cores needs), a node without GPUs first."""
    core = make_core(
        node("eight", count=8, cpu_milli=128000, host_memory_mib=786432),
        node("two", count=2, cpu_milli=104000, host_memory_mib=524288),
        node("cpu", count=0, cpu_milli=32000, host_memory_mib=131072),
        policy="hostpack",
    )
    request = core.parse(cpu_only("batch", "12"))
    raw = core.cpu_pod_scores(request, ["eight", "two", "cpu"])
    assert raw["cpu"] == 0.0 > raw["two"] > raw["eight"]
    assert raw["eight"] > -0.1  # below any stranding: it only orders nodes alike in that
    assert core.best_node(request, ["eight", "two"]) == "two"
    assert core.best_node(request, ["eight", "two", "cpu"]) == "cpu"
    assert core.prioritize(request, ["eight", "two"]) == {"eight": 0, "two": 10}
    # The 8-GPU node keeps its CPU for a pod that needs nearly all of it while the 2-GPU
    # node has CPU to spare beyond its GPUs' (6 x 12 cores leave 32, its GPUs need 26).
    for number in range(6):
        place(core, cpu_only(f"web{number}", "12"), on=core.best_node(request, ["eight", "two"]))
    assert core.cluster.node("eight").used_cpu_milli == 0
    whole = core.parse(pod("train", [{"name": "m", "resources": {
        "limits": {"nvidia.com/gpu": "8"}, "requests": {"cpu": "120"}}}]))  # fmt: skip
    assert core.best_node(whole) == "eight"


def test_binpack_ranks_pods_without_gpus_alike() -> None:
    core = make_core(node("a", cpu_milli=8000), node("b", cpu_milli=8000))
    request = core.parse(cpu_only("web", "1"))
    assert core.prioritize(request, ["a", "b"]) == {"a": 10, "b": 10}
    assert core.prioritize(core.parse(cpu_only("big", "9")), ["a", "b"]) == {"a": 0, "b": 0}
