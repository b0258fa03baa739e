"""The periodic reconcile of every booking lets the event loop run while it works (tens of
thousands of bookings would otherwise hold an extender call for tens of milliseconds), and a
booking that changed while it waited is judged on what it is now, not on the list it took.
The real placement engine, ledger and pod-watch handler (no store: Journal without KV)."""

from __future__ import annotations

import asyncio
import time

from services.allocator import LocalClusterBackend
from services.allocator.cluster import CapacityConfig, ClusterState
from services.allocator.core import PlacementCore
from services.allocator.engine import PlacementEngine
from services.allocator.ledger import Ledger
from services.allocator.reconcile import RECONCILE_SLICE, PodWatchHandler
from services.common.schemas import ContainerAllocation, GpuSlice, PodAllocation
from tests.allocator.helpers import container, node_inventory, pod


def _booking(number: int, node: str) -> PodAllocation:
    return PodAllocation(
        namespace="ml", name=f"p{number}", uid=f"u{number}", node=node,
        containers={"m": ContainerAllocation(container="m", slices=[
            GpuSlice(uuid=f"GPU-{node}-0", index=0, memory_mib=1, cores=0)])},
        bound_at=time.time() - 3600,
    )  # fmt: skip


def _running(number: int, node: str) -> dict:
    spec = pod(f"p{number}", [container("m", mem=1)], namespace="ml", uid=f"u{number}")
    spec["spec"]["nodeName"] = node
    return spec


async def test_reconcile_yields_and_spares_a_booking_moved_meanwhile() -> None:
    cluster = ClusterState(3600, CapacityConfig())
    for node in ("n1", "n2"):
        cluster.update(node_inventory(node, count=1))
    engine = PlacementEngine(PlacementCore(cluster, Ledger(cluster)), LocalClusterBackend())
    count = 3 * RECONCILE_SLICE
    for number in range(count):
        engine.ledger.record(_booking(number, "n1"))
    handler = PodWatchHandler(engine, release_unbound_after_s=60)
    await handler.on_list([_running(n, "n1") for n in range(count)], time.time())
    moved = 2 * RECONCILE_SLICE + 5  # past the first turns the loop gives away
    ran_midway: list[bool] = []

    async def meanwhile() -> None:
        """While reconcile waits: the pod was freed and bound to n2, as the watch says."""
        await engine.release(f"u{moved}", "test: moved")
        engine.ledger.record(_booking(moved, "n2"))
        await handler.on_change("MODIFIED", _running(moved, "n2"))
        ran_midway.append(True)

    async def reconcile() -> tuple[int, bool]:
        released = await handler.reconcile()
        return released, bool(ran_midway)

    reconciling = asyncio.create_task(reconcile())
    other = asyncio.create_task(meanwhile())
    released, other_ran = await reconciling
    assert other_ran  # the loop ran other work before reconcile ended
    await other
    assert released == 0  # every booking stands: the moved one is judged on n2, where it runs
    assert engine.ledger.get(f"u{moved}").node == "n2"
    assert len(engine.ledger) == count
