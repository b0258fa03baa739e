"""Placement by the figures each node's agent states for its GPUs (4paradigm's
--device-memory-scaling, --device-cores-scaling, --device-split-count), the allocator's
settings as fallback and override, and the equal share of a bare GPU count. No I/O."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from services.allocator.cluster import CapacityConfig, ClusterState
from services.allocator.core import PlacementCore, PodRef, Unplaceable
from services.allocator.ledger import Ledger
from services.common.resources import RequestConfig
from services.common.schemas import NodeInventory

from .helpers import A100_MIB, container, gpu, pod


def stated(name: str = "n", count: int = 1, **sharing: Any) -> NodeInventory:
    """A node whose agent states `sharing` (memory_scaling, cores_scaling, split_count)."""
    gpus = [msgspec.structs.replace(gpu(name, i), **sharing) for i in range(count)]
    return NodeInventory(node=name, gpus=gpus)


def make_core(
    *inventories: NodeInventory, equal_share: bool = False, **capacity: Any
) -> PlacementCore:
    cluster = ClusterState(15, CapacityConfig(**capacity))
    for inventory in inventories:
        cluster.update(inventory)
    return PlacementCore(
        cluster,
        Ledger(cluster),
        node_policy="binpack",
        gpu_policy="binpack",
        request_config=RequestConfig(count_only_equal_share=equal_share),
    )


def commit(core: PlacementCore, p: dict[str, Any], on: str = "n") -> Any:
    return core.commit(
        PodRef("default", p["metadata"]["name"], p["metadata"]["uid"]), on, core.parse(p)
    )


def test_cores_scaling_bounds_the_sum_of_compute_shares_at_100_x_s() -> None:
    core = make_core(stated(cores_scaling=1.5))
    for name in ("a", "b", "c"):
        commit(core, pod(name, [container("m", mem=100, cores=50)]))  # 150% in all
    outcome = core.filter(core.parse(pod("d", [container("m", mem=100, cores=1)])), ["n"])
    assert "1% compute free; 0 of 1 GPUs have that room" in outcome.failed["n"]
    # Without scaling, the third 50% share is already refused.
    plain = make_core(stated())
    for name in ("a", "b"):
        commit(plain, pod(name, [container("m", mem=100, cores=50)]))
    with pytest.raises(Unplaceable, match="50% compute"):
        commit(plain, pod("c", [container("m", mem=100, cores=50)]))


def test_the_allocator_setting_applies_to_gpus_that_state_no_cores_scaling() -> None:
    core = make_core(stated(), cores_scaling=2.0)
    for name in ("a", "b", "c", "d"):
        commit(core, pod(name, [container("m", mem=100, cores=50)]))
    with pytest.raises(Unplaceable):
        commit(core, pod("e", [container("m", mem=100, cores=50)]))
    # A GPU's own figure wins over the allocator's cluster-wide one.
    own = make_core(stated(cores_scaling=1.0), cores_scaling=2.0)
    commit(own, pod("a", [container("m", mem=100, cores=100)]))
    with pytest.raises(Unplaceable):
        commit(own, pod("b", [container("m", mem=100, cores=1)]))


def test_memory_scaling_precedence() -> None:
    half = A100_MIB // 2
    # The node's own figure oversubscribes: three slices of half the card fit at 1.5.
    core = make_core(stated(memory_scaling=1.5))
    for name in ("a", "b", "c"):
        allocation = commit(core, pod(name, [container("m", mem=half)]))
    assert allocation.memory_scaling == 1.5
    with pytest.raises(Unplaceable):
        commit(core, pod("d", [container("m", mem=1)]))
    # The allocator's memory_scaling is the fallback for GPUs that state nothing...
    assert make_core(stated(), memory_scaling=2.0).cluster.node("n").memory_scaling == 2.0  # type: ignore[union-attr]
    # ...and loses to the GPU's own figure; the per-node setting overrides both.
    assert (
        make_core(stated(memory_scaling=1.5), memory_scaling=2.0).cluster.node("n").memory_scaling  # type: ignore[union-attr]
        == 1.5
    )
    override = make_core(stated(memory_scaling=1.5), node_memory_scaling={"n": 1.0})
    commit(override, pod("a", [container("m", mem=half)]))
    commit(override, pod("b", [container("m", mem=half)]))
    with pytest.raises(Unplaceable):
        commit(override, pod("c", [container("m", mem=half)]))


def test_split_count_stated_by_the_node_bounds_tasks() -> None:
    core = make_core(stated(split_count=2), split_count=10)
    commit(core, pod("a", [container("m", mem=10)]))
    commit(core, pod("b", [container("m", mem=10)]))
    with pytest.raises(Unplaceable, match="0 of 1 GPUs have that room"):
        commit(core, pod("c", [container("m", mem=10)]))


def test_count_only_request_gets_the_equal_share_when_asked() -> None:
    # S = 1.5, M = the card, K = 4: each bare `nvidia.com/gpu: 1` gets 1.5 x M / 4.
    core = make_core(stated(memory_scaling=1.5, split_count=4), equal_share=True)
    share = int(A100_MIB * 1.5) // 4
    for name in ("a", "b", "c", "d"):
        allocation = commit(core, pod(name, [container("m", gpus=1)]))
        slice_ = allocation.containers["m"].slices[0]
        assert (slice_.memory_mib, slice_.cores) == (share, 0)
    with pytest.raises(Unplaceable, match="an equal share of its memory"):
        commit(core, pod("e", [container("m", gpus=1)]))
    # A request naming memory or cores is read as before.
    asked = make_core(stated(split_count=4), equal_share=True)
    allocation = commit(asked, pod("a", [container("m", gpus=1, mem=1000)]))
    assert allocation.containers["m"].slices[0].memory_mib == 1000


def test_count_only_request_takes_whole_gpus_by_default() -> None:
    core = make_core(stated(memory_scaling=1.5, split_count=4))
    allocation = commit(core, pod("a", [container("m", gpus=1)]))
    slice_ = allocation.containers["m"].slices[0]
    assert (slice_.memory_mib, slice_.cores) == (A100_MIB, 100)
    with pytest.raises(Unplaceable):
        commit(core, pod("b", [container("m", gpus=1)]))


def aws(name: str, vgpus: int, webhook_form: bool = False) -> dict[str, Any]:
    limits: dict[str, Any] = {"k8s.amazonaws.com/vgpu": vgpus}
    if webhook_form:  # what the admission webhook writes: the GPU the kubelet hands out, + N
        limits["nvidia.com/gpu"] = 1
    return pod(name, [{"name": "m", "resources": {"limits": limits}}])


def test_aws_vgpus_are_shares_of_each_gpus_own_count() -> None:
    # AWS's `k8s.amazonaws.com/vgpu: N` asks N of the GPU's K vGPUs, K being the split count
    # its node agent states (the agent's --vgpu): one place, so allocator and agent agree.
    core = make_core(stated("four", split_count=4), stated("ten", count=2, split_count=10))
    on_four = commit(core, aws("a", 2), on="four").containers["m"].slices[0]
    assert (on_four.memory_mib, on_four.cores) == (A100_MIB // 2, 50)
    on_ten = commit(core, aws("b", 2, webhook_form=True), on="ten").containers["m"].slices[0]
    assert (on_ten.memory_mib, on_ten.cores) == (A100_MIB * 2 // 10, 20)
    # All K vGPUs are the whole GPU; more than K is refused naming the GPU's count.
    whole = commit(core, aws("c", 10), on="ten").containers["m"].slices[0]
    assert (whole.memory_mib, whole.cores) == (A100_MIB, 100)
    outcome = core.filter(core.parse(aws("d", 5)), ["four"])
    never = outcome.unresolvable["four"]  # kube-scheduler need not retry: no GPU there can
    assert "k8s.amazonaws.com/vgpu: 5 is more than the 4 vGPUs of one GPU" in never
    # GPUs whose agent states no count use the allocator's split count.
    fallback = make_core(stated(), split_count=5)
    share = commit(fallback, aws("e", 1)).containers["m"].slices[0]
    assert (share.memory_mib, share.cores) == (A100_MIB // 5, 20)
