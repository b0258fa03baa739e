"""The current picture of the cluster, built only from what arrives on NATS."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from services.common.schemas import (
    AllocationEvent,
    GpuDevice,
    GpuUsage,
    NodeInventory,
    NodeUsage,
    PodAllocation,
)


@dataclass
class NodeView:
    inventory: NodeInventory
    last_seen: float
    usage: dict[str, GpuUsage] = field(default_factory=dict)


@dataclass
class GpuAllocation:
    memory_mib: int = 0
    cores: int = 0
    slices: int = 0


class ClusterPicture:
    def __init__(self, stale_after_s: float) -> None:
        self.stale_after_s = stale_after_s
        self.nodes: dict[str, NodeView] = {}
        self.pods: dict[str, PodAllocation] = {}  # by pod uid

    def on_inventory(self, inventory: NodeInventory, now: float | None = None) -> None:
        seen = time.time() if now is None else now
        view = self.nodes.get(inventory.node)
        if view is None:
            self.nodes[inventory.node] = NodeView(inventory=inventory, last_seen=seen)
        else:
            view.inventory, view.last_seen = inventory, seen

    def on_usage(self, usage: NodeUsage) -> None:
        view = self.nodes.get(usage.node)
        if view is not None:  # usage before inventory says nothing we could label
            view.usage = {gpu.uuid: gpu for gpu in usage.gpus}

    def on_allocation(self, event: AllocationEvent) -> None:
        if event.kind == "released":
            self.pods.pop(event.allocation.uid, None)
        else:
            self.pods[event.allocation.uid] = event.allocation

    def is_up(self, node: str, now: float | None = None) -> bool:
        view = self.nodes.get(node)
        current = time.time() if now is None else now
        return view is not None and current - view.last_seen <= self.stale_after_s

    def allocated(self) -> dict[str, GpuAllocation]:
        """What the allocator has handed out on each GPU, by GPU uuid."""
        totals: dict[str, GpuAllocation] = {}
        for pod in self.pods.values():
            for container in pod.containers.values():
                for piece in container.slices:
                    entry = totals.setdefault(piece.uuid, GpuAllocation())
                    entry.memory_mib += piece.memory_mib
                    entry.cores += piece.cores
                    entry.slices += 1
        return totals

    def gpus(self) -> list[tuple[str, GpuDevice]]:
        return [(node, gpu) for node, view in self.nodes.items() for gpu in view.inventory.gpus]
