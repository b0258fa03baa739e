"""The latest GPU inventory each node agent sent, and when it was received.

Freshness is measured on this process's monotonic clock at receipt, not from the sender's
``sent_at``, so clock skew between nodes cannot make a live node look dead (or the reverse).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import msgspec

from services.common.schemas import GpuDevice, NodeInventory


@dataclass(frozen=True)
class NodeRecord:
    inventory: NodeInventory
    received_at: float  # monotonic seconds


@dataclass(frozen=True)
class NodeStatus:
    """Whether a node can take new placements now; `reason` says why not."""

    gpus: tuple[GpuDevice, ...] | None  # None: never heard of
    silent_s: float = 0.0
    reason: str = ""

    @property
    def available(self) -> bool:
        return not self.reason


class InventoryStore:
    def __init__(self, node_timeout_s: float, clock: Callable[[], float] = time.monotonic):
        self._timeout_s = node_timeout_s
        self._clock = clock
        self._nodes: dict[str, NodeRecord] = {}

    def update(self, inventory: NodeInventory) -> bool:
        """Keep `inventory` as the node's latest; True when its GPUs changed (or are new).

        A GPU listed twice keeps its first entry: placement relies on uuids being distinct.
        """
        first: dict[str, GpuDevice] = {}
        for gpu in inventory.gpus:
            first.setdefault(gpu.uuid, gpu)
        unique = list(first.values())
        if len(unique) != len(inventory.gpus):
            inventory = msgspec.structs.replace(inventory, gpus=unique)
        previous = self._nodes.get(inventory.node)
        self._nodes[inventory.node] = NodeRecord(inventory, self._clock())
        return previous is None or previous.inventory.gpus != inventory.gpus

    def gpus(self, node: str) -> tuple[GpuDevice, ...] | None:
        record = self._nodes.get(node)
        return None if record is None else tuple(record.inventory.gpus)

    def status(self, node: str) -> NodeStatus:
        record = self._nodes.get(node)
        if record is None:
            return NodeStatus(
                gpus=None,
                reason=f"node {node!r}: no GPU inventory received from its vgpu node agent",
            )
        gpus = tuple(record.inventory.gpus)
        silent_s = self._clock() - record.received_at
        if silent_s > self._timeout_s:
            return NodeStatus(
                gpus=gpus,
                silent_s=silent_s,
                reason=(
                    f"node {node!r}: its vgpu node agent has been silent for {silent_s:.1f}s "
                    f"(a node counts as gone after {self._timeout_s:g}s without inventory)"
                ),
            )
        return NodeStatus(gpus=gpus, silent_s=silent_s)

    def all_gpus(self) -> dict[str, tuple[GpuDevice, ...]]:
        """Every node ever heard of, fresh or not: the cluster's capacity."""
        return {node: tuple(r.inventory.gpus) for node, r in self._nodes.items()}

    def nodes(self) -> list[str]:
        return sorted(self._nodes)
