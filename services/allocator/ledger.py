"""Placement decisions: one PodAllocation per pod uid, containers keyed by NAME.

The ledger is the allocator's memory of what it promised, and the only writer of usage into
the cluster state: recording a pod adds its charges (pod_charges: init containers reuse the
app containers' slices) to its node's GPUs, releasing takes them off. It also remembers which
containers were already offered as a kubelet hint.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from services.common.schemas import ContainerRequest, GpuSlice, PodAllocation

from .cluster import Charge, ClusterState
from .host_usage import HostUsage
from .placement import pod_charges
from .pod_request import PodRequest


class LedgerError(ValueError):
    pass


@dataclass
class _Entry:
    allocation: PodAllocation
    requests: dict[str, ContainerRequest]
    charges: dict[str, Charge]
    cpu_milli: int = 0
    memory_mib: int = 0
    hinted: set[str] = field(default_factory=set)
    pod_request: PodRequest | None = None  # selection and policies: to re-place containers
    # Dynamic MIG: (container, GPU uuid) -> the agent's container key its instance was made for.
    mig_served: dict[tuple[str, str], str] = field(default_factory=dict)


def derived_request(allocation: PodAllocation, container: str) -> ContainerRequest | None:
    """A request that yields the recorded slices again (for records rebuilt from storage)."""
    decided = allocation.containers.get(container)
    if decided is None or not decided.slices:
        return None
    first = decided.slices[0]
    return ContainerRequest(
        container=container,
        gpus=len(decided.slices),
        memory_mib=first.memory_mib,
        cores=first.cores,
        init=decided.init,
    )


class Ledger:
    def __init__(self, cluster: ClusterState) -> None:
        self.cluster = cluster
        self.host = HostUsage(cluster)  # CPU, memory and pod slots of every pod, GPU or not
        self._pods: dict[str, _Entry] = {}  # insertion order = bind order
        self._by_node: dict[str, dict[str, _Entry]] = {}

    def record(
        self,
        allocation: PodAllocation,
        requests: dict[str, ContainerRequest] | None = None,
        cpu_milli: int = 0,
        memory_mib: int = 0,
    ) -> None:
        if allocation.uid in self._pods:
            raise LedgerError(f"pod uid {allocation.uid} is already recorded")
        entry = _Entry(
            allocation,
            dict(requests or {}),
            pod_charges(allocation.containers),
            cpu_milli,
            memory_mib,
        )
        self._pods[allocation.uid] = entry
        self._by_node.setdefault(allocation.node, {})[allocation.uid] = entry
        self.cluster.charge(allocation.node, entry.charges, 0, 0, +1)
        self.host.reserve(allocation.uid, allocation.node, cpu_milli, memory_mib)

    def release(self, uid: str) -> PodAllocation | None:
        entry = self._pods.pop(uid, None)
        if entry is None:
            return None
        node = entry.allocation.node
        on_node = self._by_node.get(node, {})
        on_node.pop(uid, None)
        if not on_node:
            self._by_node.pop(node, None)
        self.cluster.charge(node, entry.charges, 0, 0, -1)
        self.host.unreserve(uid)
        return entry.allocation

    def replace(self, allocation: PodAllocation) -> None:
        """Take another replica's version of a pod's record (claims, moves)."""
        old = self._pods.get(allocation.uid)
        hinted = old.hinted if old is not None else set()
        requests = old.requests if old is not None else {}
        cpu, memory = (old.cpu_milli, old.memory_mib) if old is not None else (0, 0)
        pod_request = old.pod_request if old is not None else None
        self.release(allocation.uid)
        self.record(allocation, requests, cpu, memory)
        self._pods[allocation.uid].hinted = hinted
        self._pods[allocation.uid].pod_request = pod_request

    def reapply(self, node: str) -> None:
        """Recompute a node's usage from its records (its GPUs changed, or it came back)."""
        self.cluster.reset_usage(node)
        for entry in self._by_node.get(node, {}).values():
            self.cluster.charge(node, entry.charges, 0, 0, +1)
        self.host.reapply(node)

    def get(self, uid: str) -> PodAllocation | None:
        entry = self._pods.get(uid)
        return None if entry is None else entry.allocation

    def request_of(self, uid: str, container: str) -> ContainerRequest | None:
        entry = self._pods.get(uid)
        if entry is None:
            return None
        return entry.requests.get(container) or derived_request(entry.allocation, container)

    def set_pod_request(self, uid: str, request: PodRequest) -> None:
        entry = self._pods.get(uid)
        if entry is not None:
            entry.pod_request = request

    def pod_request_of(self, uid: str) -> PodRequest | None:
        """The pod's whole request as bound (None for records taken from storage)."""
        entry = self._pods.get(uid)
        return None if entry is None else entry.pod_request

    def charges_of(self, uid: str) -> dict[str, Charge]:
        entry = self._pods.get(uid)
        return {} if entry is None else dict(entry.charges)

    def find(self, node: str, namespace: str, name: str) -> PodAllocation | None:
        """The most recently bound pod of that name on that node."""
        for entry in reversed(self._by_node.get(node, {}).values()):
            if entry.allocation.namespace == namespace and entry.allocation.name == name:
                return entry.allocation
        return None

    def on_node(self, node: str) -> list[PodAllocation]:
        """In bind order."""
        return [entry.allocation for entry in self._by_node.get(node, {}).values()]

    def nodes(self) -> list[str]:
        return list(self._by_node)

    def reserved(self, node: str) -> dict[str, Charge]:
        """What is promised per GPU uuid on `node` (memory, compute, task slots)."""
        totals: dict[str, Charge] = {}
        for entry in self._by_node.get(node, {}).values():
            for uuid, charge in entry.charges.items():
                totals[uuid] = totals.get(uuid, Charge()) + charge
        return totals

    def move(self, uid: str, container: str, slices: list[GpuSlice]) -> None:
        entry = self._pods[uid]
        node = entry.allocation.node
        self.cluster.charge(node, entry.charges, 0, 0, -1)
        entry.allocation.containers[container].slices = slices
        entry.charges = pod_charges(entry.allocation.containers)
        self.cluster.charge(node, entry.charges, 0, 0, +1)

    def mark_hinted(self, uid: str, container: str) -> None:
        self._pods[uid].hinted.add(container)

    def unmark_hinted(self, uid: str, container: str) -> None:
        entry = self._pods.get(uid)
        if entry is not None:
            entry.hinted.discard(container)

    def mark_mig(self, uid: str, container: str, gpu_uuid: str, key: str) -> None:
        self._pods[uid].mig_served[(container, gpu_uuid)] = key

    def mig_key(self, uid: str, container: str, gpu_uuid: str) -> str | None:
        entry = self._pods.get(uid)
        return None if entry is None else entry.mig_served.get((container, gpu_uuid))

    def is_hinted(self, uid: str, container: str) -> bool:
        entry = self._pods.get(uid)
        return entry is not None and container in entry.hinted

    def all(self) -> list[PodAllocation]:
        return [entry.allocation for entry in self._pods.values()]

    def __len__(self) -> int:
        return len(self._pods)

    def __contains__(self, uid: object) -> bool:
        return uid in self._pods
