"""Node freshness, capacity (reserve, scaling, slots) and the ledger's bookkeeping, no I/O."""

from __future__ import annotations

import msgspec

from services.allocator.cluster import CapacityConfig, Charge, ClusterState
from services.allocator.ledger import Ledger
from services.common.schemas import ContainerAllocation, GpuSlice, PodAllocation

from .helpers import node_inventory


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_unknown_fresh_and_stale_nodes() -> None:
    clock = FakeClock()
    store = ClusterState(node_timeout_s=15, clock=clock)
    unknown = store.status("n1")
    assert not unknown.available and "no GPU inventory received from its vgpu node agent" in (
        unknown.reason
    )
    assert store.update(node_inventory("n1")) is True
    assert store.update(node_inventory("n1")) is False  # same GPUs: a heartbeat
    clock.now += 15
    assert store.status("n1").available
    clock.now += 2.5
    stale = store.status("n1")
    assert not stale.available
    assert "'n1'" in stale.reason and "silent for 17.5s" in stale.reason
    store.update(node_inventory("n1"))
    assert store.status("n1").available


def test_capacity_applies_reserve_scaling_and_split_count() -> None:
    cluster = ClusterState(
        15,
        CapacityConfig(
            memory_reserve_mib=960, split_count=4, memory_scaling=1.0,
            node_memory_scaling={"big": 1.5},
        ),
    )  # fmt: skip
    cluster.update(node_inventory("n1", count=1, memory_mib=40960))
    cluster.update(node_inventory("big", count=1, memory_mib=40960))
    (gpu,) = cluster.node("n1").gpus  # type: ignore[union-attr]
    assert (gpu.base_memory_mib, gpu.memory_mib, gpu.slots) == (40000, 40000, 4)
    (scaled,) = cluster.node("big").gpus  # type: ignore[union-attr]
    assert (scaled.base_memory_mib, scaled.memory_mib) == (40000, 60000)
    assert cluster.node("big").memory_scaling == 1.5  # type: ignore[union-attr]


def _allocation(uid: str, node: str, name: str, slices: dict[str, list[GpuSlice]], init=()):
    return PodAllocation(
        namespace="ns",
        name=name,
        uid=uid,
        node=node,
        containers={
            c: ContainerAllocation(container=c, slices=s, init=c in init) for c, s in slices.items()
        },
    )


def test_ledger_charges_usage_find_release() -> None:
    cluster = ClusterState(15)
    cluster.update(node_inventory("n", count=1))
    ledger = Ledger(cluster)
    s0 = GpuSlice(uuid="GPU-n-0", index=0, memory_mib=1000, cores=10)
    ledger.record(_allocation("u1", "n", "p", {"a": [s0], "b": [s0]}))
    ledger.record(_allocation("u2", "n", "p", {"a": [s0]}))
    ledger.record(_allocation("u3", "m", "q", {"a": [s0]}))
    assert ledger.reserved("n") == {"GPU-n-0": Charge(3000, 30, 3)}
    assert cluster.node("n").by_uuid["GPU-n-0"].used == Charge(3000, 30, 3)  # type: ignore[union-attr]
    found = ledger.find("n", "ns", "p")
    assert found is not None and found.uid == "u2"  # the latest pod of that name
    assert [a.uid for a in ledger.on_node("n")] == ["u1", "u2"]
    version = cluster.node("n").version  # type: ignore[union-attr]
    assert ledger.release("u2") is not None
    assert ledger.release("u2") is None
    assert cluster.node("n").version > version  # type: ignore[union-attr]
    assert ledger.reserved("n") == {"GPU-n-0": Charge(2000, 20, 2)}
    assert ledger.reserved("nowhere") == {}


def test_init_containers_ride_on_the_app_containers_slices() -> None:
    cluster = ClusterState(15)
    cluster.update(node_inventory("n", count=2))
    ledger = Ledger(cluster)
    app = GpuSlice(uuid="GPU-n-0", index=0, memory_mib=8000, cores=50)
    small_init = GpuSlice(uuid="GPU-n-0", index=0, memory_mib=4000, cores=20)
    big_init = GpuSlice(uuid="GPU-n-0", index=0, memory_mib=12000, cores=10)
    ledger.record(
        _allocation(
            "u", "n", "p", {"i1": [small_init], "i2": [big_init], "a": [app]}, init=("i1", "i2")
        )
    )
    # max(sum of apps, largest init) per resource: init containers run one at a time.
    assert ledger.reserved("n") == {"GPU-n-0": Charge(12000, 50, 1)}


def test_usage_survives_an_inventory_change() -> None:
    cluster = ClusterState(15)
    cluster.update(node_inventory("n", count=1))
    ledger = Ledger(cluster)
    ledger.record(
        _allocation(
            "u", "n", "p", {"a": [GpuSlice(uuid="GPU-n-0", index=0, memory_mib=5, cores=0)]}
        )
    )
    assert cluster.update(node_inventory("n", count=2)) is True
    ledger.reapply("n")
    assert cluster.node("n").by_uuid["GPU-n-0"].used.memory_mib == 5  # type: ignore[union-attr]


def test_idle_nodes_and_free_gpus_follow_every_charge() -> None:
    cluster = ClusterState(15)
    for name, count in (("a", 2), ("b", 4)):
        cluster.update(node_inventory(name, count))
    assert cluster.idle_nodes == {2: 1, 4: 1} and cluster.free_gpus == 6
    cluster.charge("b", {"GPU-b-0": Charge(1000, 30, 1)}, 0, 0, 1)
    assert cluster.idle_nodes == {2: 1, 4: 0} and cluster.free_gpus == 5.7
    assert cluster.free_by_model == {"A100-40GB": 5.7} and cluster.gpus_by_model == {"A100-40GB": 6}
    cluster.update(msgspec.structs.replace(node_inventory("b", 4), cpu_milli=8000))
    assert cluster.idle_nodes == {2: 1, 4: 0}, "a new inventory keeps the node's usage"
    cluster.charge("b", {"GPU-b-0": Charge(1000, 30, 1)}, 0, 0, -1)
    cluster.reset_usage("a")
    assert cluster.idle_nodes == {2: 1, 4: 1} and cluster.free_gpus == 6
