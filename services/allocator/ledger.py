"""Placement decisions: one PodAllocation per pod uid, containers keyed by NAME.

The ledger is the allocator's memory of what it promised; what is reserved on a GPU is the
sum of the slices on it. It also remembers each container's request (so a claim can move a
container onto other GPUs) and which containers were already offered as a kubelet hint.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from services.common.schemas import ContainerRequest, GpuSlice, PodAllocation

from .placement import Reserved


class LedgerError(ValueError):
    pass


@dataclass
class _Entry:
    allocation: PodAllocation
    requests: dict[str, ContainerRequest]
    hinted: set[str] = field(default_factory=set)


class Ledger:
    def __init__(self) -> None:
        self._pods: dict[str, _Entry] = {}  # insertion order = bind order
        self._by_node: dict[str, dict[str, _Entry]] = {}

    def record(self, allocation: PodAllocation, requests: dict[str, ContainerRequest]) -> None:
        if allocation.uid in self._pods:
            raise LedgerError(f"pod uid {allocation.uid} is already recorded")
        entry = _Entry(allocation, requests)
        self._pods[allocation.uid] = entry
        self._by_node.setdefault(allocation.node, {})[allocation.uid] = entry

    def release(self, uid: str) -> PodAllocation | None:
        entry = self._pods.pop(uid, None)
        if entry is None:
            return None
        on_node = self._by_node.get(entry.allocation.node, {})
        on_node.pop(uid, None)
        if not on_node:
            self._by_node.pop(entry.allocation.node, None)
        return entry.allocation

    def get(self, uid: str) -> PodAllocation | None:
        entry = self._pods.get(uid)
        return None if entry is None else entry.allocation

    def request_of(self, uid: str, container: str) -> ContainerRequest | None:
        entry = self._pods.get(uid)
        return None if entry is None else entry.requests.get(container)

    def find(self, node: str, namespace: str, name: str) -> PodAllocation | None:
        """The most recently bound pod of that name on that node."""
        for entry in reversed(self._by_node.get(node, {}).values()):
            if entry.allocation.namespace == namespace and entry.allocation.name == name:
                return entry.allocation
        return None

    def on_node(self, node: str) -> list[PodAllocation]:
        """In bind order."""
        return [entry.allocation for entry in self._by_node.get(node, {}).values()]

    def reserved(self, node: str, skip: tuple[str, str] | None = None) -> dict[str, Reserved]:
        """Memory and compute promised per GPU uuid on `node`, leaving out (uid, container)."""
        totals: dict[str, Reserved] = {}
        for uid, entry in self._by_node.get(node, {}).items():
            for name, container in entry.allocation.containers.items():
                if (uid, name) == skip:
                    continue
                for piece in container.slices:
                    totals[piece.uuid] = totals.get(piece.uuid, Reserved()).plus(
                        piece.memory_mib, piece.cores
                    )
        return totals

    def move(self, uid: str, container: str, slices: list[GpuSlice]) -> None:
        self._pods[uid].allocation.containers[container].slices = slices

    def mark_hinted(self, uid: str, container: str) -> None:
        self._pods[uid].hinted.add(container)

    def is_hinted(self, uid: str, container: str) -> bool:
        entry = self._pods.get(uid)
        return entry is not None and container in entry.hinted

    def all(self) -> list[PodAllocation]:
        return [entry.allocation for entry in self._pods.values()]

    def __len__(self) -> int:
        return len(self._pods)
