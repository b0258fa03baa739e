"""Node freshness and the ledger's bookkeeping, without I/O."""

from __future__ import annotations

from services.allocator.inventory import InventoryStore
from services.allocator.ledger import Ledger
from services.allocator.placement import Reserved
from services.common.schemas import ContainerAllocation, GpuSlice, PodAllocation

from .helpers import node_inventory


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_unknown_fresh_and_stale_nodes() -> None:
    clock = FakeClock()
    store = InventoryStore(node_timeout_s=15, clock=clock)
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


def _allocation(uid: str, node: str, name: str, slices: dict[str, list[GpuSlice]]):
    return PodAllocation(
        namespace="ns",
        name=name,
        uid=uid,
        node=node,
        containers={c: ContainerAllocation(container=c, slices=s) for c, s in slices.items()},
    )


def test_ledger_reserved_skip_find_release() -> None:
    ledger = Ledger()
    s0 = GpuSlice(uuid="G0", index=0, memory_mib=1000, cores=10)
    ledger.record(_allocation("u1", "n", "p", {"a": [s0], "b": [s0]}), {})
    ledger.record(_allocation("u2", "n", "p", {"a": [s0]}), {})
    ledger.record(_allocation("u3", "m", "q", {"a": [s0]}), {})
    assert ledger.reserved("n") == {"G0": Reserved(3000, 30)}
    assert ledger.reserved("n", skip=("u1", "b")) == {"G0": Reserved(2000, 20)}
    found = ledger.find("n", "ns", "p")
    assert found is not None and found.uid == "u2"  # the latest pod of that name
    assert [a.uid for a in ledger.on_node("n")] == ["u1", "u2"]
    assert ledger.release("u2") is not None
    assert ledger.release("u2") is None
    assert ledger.reserved("n") == {"G0": Reserved(2000, 20)}
    assert ledger.reserved("nowhere") == {}
