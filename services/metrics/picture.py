"""The current picture of the cluster, built only from what arrives on NATS (and KV at start).

Freshness is measured on this service's own monotonic clock when a message arrives, never
from the sender's `sent_at`, so a skewed clock can neither revive nor bury a node. Events that
decode but make no sense raise `EventRejected` (the service counts them); nothing here does I/O.
The picture also remembers what changed since the last `take_changes()`, for the live stream.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from services.common.schemas import (
    AllocationEvent,
    ContainerUsage,
    GpuUsage,
    NodeInventory,
    NodeUsage,
    PendingPod,
    PodAllocation,
    SliceViolation,
)

Clock = Callable[[], float]
TOMBSTONE_TTL_S = 3600.0  # a released pod stays released even if an older record turns up


class EventRejected(ValueError):
    """An event that decoded but cannot be applied; `reason` is a short metric label."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


@dataclass
class NodeState:
    inventory: NodeInventory
    seen: float  # monotonic time of the last inventory
    usage: dict[str, GpuUsage] = field(default_factory=dict)
    usage_seen: float = float("-inf")


@dataclass
class ContainerState:
    usage: ContainerUsage
    seen: float


@dataclass
class PendingState:
    pod: PendingPod
    seen: float
    first_seen: float  # monotonic, when this service first heard of it


@dataclass
class Finding:
    """A standing finding of a node agent's verification on one container's GPU."""

    reason: str  # the agent's sentence; "" if only its usage report's flag was heard
    since: float  # Unix time this service heard of it (its own clock, not the sender's)
    measured_mib: int = -1  # NVML's figure at the time; -1 unknown


FindingKey = tuple[str, str]  # GPU uuid, kind (one of KINDS)
KINDS = ("over_limit", "tampering", "over_compute")  # as the node agent names them


@dataclass
class Changes:
    nodes: set[str] = field(default_factory=set)
    pods: set[str] = field(default_factory=set)  # pod uids
    pending: bool = False

    def __bool__(self) -> bool:
        return bool(self.nodes or self.pods or self.pending)


ContainerKey = tuple[str, str, str, str]  # node, namespace, pod, container


def _require(condition: bool, reason: str, message: str) -> None:
    if not condition:
        raise EventRejected(reason, message)


def _check_inventory(inventory: NodeInventory) -> None:
    _require(bool(inventory.node), "no_node", "inventory without a node name")
    uuids = [gpu.uuid for gpu in inventory.gpus]
    _require(all(uuids), "bad_gpu", f"inventory of {inventory.node} has a GPU without uuid")
    _require(
        len(set(uuids)) == len(uuids),
        "bad_gpu",
        f"inventory of {inventory.node} lists a GPU uuid twice",
    )
    for gpu in inventory.gpus:
        _require(
            gpu.memory_mib >= 0 and gpu.index >= 0,
            "bad_gpu",
            f"inventory of {inventory.node}: GPU {gpu.uuid} has negative memory or index",
        )


def _check_allocation(allocation: PodAllocation) -> None:
    what = f"allocation of {allocation.namespace}/{allocation.name}"
    _require(bool(allocation.uid), "no_uid", f"{what} has no pod uid")
    _require(bool(allocation.node), "no_node", f"{what} has no node")
    for name, container in allocation.containers.items():
        _require(bool(name), "bad_slice", f"{what} has a container without a name")
        for piece in container.slices:
            _require(
                bool(piece.uuid) and piece.memory_mib >= 0 and 0 <= piece.cores <= 100,
                "bad_slice",
                f"{what}: container {name!r} has a slice with a bad uuid, memory or cores",
            )


def _check_container_usage(usage: ContainerUsage) -> None:
    _require(
        bool(usage.node and usage.namespace and usage.pod and usage.container),
        "no_identity",
        "container usage without node, namespace, pod or container",
    )
    for device in usage.devices:
        _require(
            bool(device.uuid) and device.memory_used_mib >= 0 and device.memory_limit_mib >= 0,
            "bad_device",
            f"container usage of {usage.namespace}/{usage.pod}/{usage.container}: "
            f"device {device.uuid!r} has a bad uuid or negative memory",
        )


class ClusterPicture:
    def __init__(
        self,
        stale_after_s: float,
        pending_ttl_s: float = 900.0,
        clock: Clock = time.monotonic,
    ) -> None:
        self.stale_after_s = stale_after_s
        self.pending_ttl_s = pending_ttl_s
        self.clock = clock
        self.nodes: dict[str, NodeState] = {}
        self.pods: dict[str, PodAllocation] = {}  # by pod uid
        self.containers: dict[ContainerKey, ContainerState] = {}
        self.pending: dict[str, PendingState] = {}  # by pod uid
        # Standing violations per container, from the agents' SliceViolation messages and
        # the flags in their usage reports; they end with a report without the flag or with
        # the pod (docs/nodeagent.md, "Verification from outside").
        self.findings: dict[ContainerKey, dict[FindingKey, Finding]] = {}
        self._by_name: dict[tuple[str, str, str], str] = {}  # (node, ns, name) -> uid
        self._released: dict[str, float] = {}  # pod uid -> when
        self._shown_up: dict[str, bool] = {}  # node -> up as last reported in changes
        self._changes = Changes()

    # -- events ------------------------------------------------------------------------

    def on_inventory(self, inventory: NodeInventory) -> None:
        _check_inventory(inventory)
        now = self.clock()
        state = self.nodes.get(inventory.node)
        if state is None:
            self.nodes[inventory.node] = NodeState(inventory=inventory, seen=now)
            self._changes.nodes.add(inventory.node)
            return
        # A heartbeat that repeats the same GPUs changes nothing anyone would draw.
        if state.inventory.gpus != inventory.gpus or not self.is_up(inventory.node, now):
            self._changes.nodes.add(inventory.node)
        state.inventory, state.seen = inventory, now

    def on_usage(self, usage: NodeUsage) -> None:
        state = self.nodes.get(usage.node)
        _require(state is not None, "unknown_node", f"usage from {usage.node!r} before inventory")
        assert state is not None
        known = {gpu.uuid for gpu in state.inventory.gpus}
        for gpu in usage.gpus:
            _require(
                gpu.uuid in known,
                "unknown_gpu",
                f"usage from {usage.node} names GPU {gpu.uuid!r}, not in its inventory",
            )
            _require(
                gpu.memory_used_mib >= 0 and gpu.sm_util_percent >= 0,
                "bad_usage",
                f"usage from {usage.node}: GPU {gpu.uuid} has negative figures",
            )
        state.usage = {gpu.uuid: gpu for gpu in usage.gpus}
        state.usage_seen = self.clock()
        self._changes.nodes.add(usage.node)

    def on_container_usage(self, usage: ContainerUsage) -> None:
        _check_container_usage(usage)
        key = (usage.node, usage.namespace, usage.pod, usage.container)
        self.containers[key] = ContainerState(usage=usage, seen=self.clock())
        self._reconcile_findings(key, usage)
        self._changes.nodes.add(usage.node)
        uid = self.pod_uid(usage.node, usage.namespace, usage.pod)
        if uid:
            self._changes.pods.add(uid)

    def _reconcile_findings(self, key: ContainerKey, usage: ContainerUsage) -> None:
        """The report's flags are the agent's standing findings: keep those (with the reason
        a SliceViolation gave), drop the rest, note new ones without a reason."""
        flagged = {(d.uuid, kind) for d in usage.devices
                   for kind in d.violation.split(",") if kind in KINDS}  # fmt: skip
        known = self.findings.get(key, {})
        if not flagged and not known:
            return
        if not self.pod_uid(usage.node, usage.namespace, usage.pod):
            flagged = set()  # no such pod here: findings only for slices that exist
        measured = {d.uuid: d.measured_mib for d in usage.devices}
        now = time.time()
        kept = {k: known.get(k) or Finding("", now, measured.get(k[0], -1)) for k in flagged}
        if kept:
            self.findings[key] = kept
        else:
            self.findings.pop(key, None)

    def on_violation(self, violation: SliceViolation) -> None:
        what = f"violation of {violation.namespace}/{violation.pod}/{violation.container}"
        _require(bool(violation.node and violation.namespace and violation.pod
                      and violation.container and violation.gpu), "no_identity",
                 "violation without node, namespace, pod, container or GPU")  # fmt: skip
        _require(violation.kind in KINDS, "bad_kind", f"{what}: unknown kind {violation.kind!r}")
        uid = self.pod_uid(violation.node, violation.namespace, violation.pod)
        _require(bool(uid), "unknown_pod", f"{what}: no such pod is bound to {violation.node}")
        key = (violation.node, violation.namespace, violation.pod, violation.container)
        self.findings.setdefault(key, {})[(violation.gpu, violation.kind)] = Finding(
            violation.reason, time.time(), violation.measured_mib
        )
        self._changes.nodes.add(violation.node)
        self._changes.pods.add(uid)

    def on_allocation(self, event: AllocationEvent) -> None:
        allocation = event.allocation
        _check_allocation(allocation)
        if event.kind == "released":
            self._release(allocation.uid)
            self._released[allocation.uid] = self.clock()
            self._changes.nodes.add(allocation.node)
            return
        self._record(allocation)

    def on_pending(self, pending: PendingPod) -> None:
        _require(bool(pending.uid), "no_uid", f"pending pod {pending.namespace}/{pending.name} "
                 "has no uid")  # fmt: skip
        if not pending.waiting or pending.uid in self.pods:
            if self.pending.pop(pending.uid, None) is not None:
                self._changes.pending = True
            return
        now = self.clock()
        known = self.pending.get(pending.uid)
        first = known.first_seen if known is not None else now
        self.pending[pending.uid] = PendingState(pod=pending, seen=now, first_seen=first)
        self._changes.pending = True

    def load_decisions(self, allocations: Iterable[PodAllocation]) -> int:
        """Records read back from the allocator's KV state; events already applied win."""
        loaded = 0
        for allocation in allocations:
            _check_allocation(allocation)
            if allocation.uid not in self.pods and allocation.uid not in self._released:
                self._record(allocation)
                loaded += 1
        return loaded

    def resync_decisions(
        self, allocations: Iterable[PodAllocation], read_started: float
    ) -> tuple[int, int]:
        """Make the pods what the store holds (read after an outage): record what is
        missing, release what the store no longer has, except pods bound after the read
        began (their events are newer than the read). (added, released)."""
        stored = {}
        for allocation in allocations:
            try:
                _check_allocation(allocation)
            except EventRejected:
                continue
            stored[allocation.uid] = allocation
        added = self.load_decisions(a for a in stored.values() if a.uid not in self.pods)
        released = 0
        for uid, allocation in list(self.pods.items()):
            if uid not in stored and allocation.bound_at < read_started:
                self._release(uid)
                self._released[uid] = self.clock()
                released += 1
        return added, released

    def _record(self, allocation: PodAllocation) -> None:
        if allocation.uid in self._released:
            return  # an old record arriving after its release
        previous = self.pods.get(allocation.uid)
        if previous is not None and previous.node != allocation.node:
            self._changes.nodes.add(previous.node)
            self._by_name.pop((previous.node, previous.namespace, previous.name), None)
        self.pods[allocation.uid] = allocation
        self._by_name[(allocation.node, allocation.namespace, allocation.name)] = allocation.uid
        self._changes.nodes.add(allocation.node)
        self._changes.pods.add(allocation.uid)
        if self.pending.pop(allocation.uid, None) is not None:
            self._changes.pending = True

    def _release(self, uid: str) -> None:
        allocation = self.pods.pop(uid, None)
        self._changes.pods.add(uid)
        if allocation is None:
            return
        name_key = (allocation.node, allocation.namespace, allocation.name)
        if self._by_name.get(name_key) == uid:
            del self._by_name[name_key]
        self._changes.nodes.add(allocation.node)
        for key in [k for k in self.containers if k[:3] == (allocation.node,
                    allocation.namespace, allocation.name)]:  # fmt: skip
            del self.containers[key]
        for key in [k for k in self.findings if k[:3] == (allocation.node,
                    allocation.namespace, allocation.name)]:  # fmt: skip
            del self.findings[key]

    # -- ageing ------------------------------------------------------------------------

    def sweep(self) -> None:
        """Age out what nobody re-sent, and notice nodes going silent or coming back."""
        now = self.clock()
        for key, state in list(self.containers.items()):
            if now - state.seen > self.stale_after_s:
                del self.containers[key]
                self._changes.nodes.add(key[0])
                uid = self.pod_uid(key[0], key[1], key[2])
                if uid:
                    self._changes.pods.add(uid)
        for uid, pending in list(self.pending.items()):
            if now - pending.seen > self.pending_ttl_s:
                del self.pending[uid]
                self._changes.pending = True
        for uid, when in list(self._released.items()):
            if now - when > TOMBSTONE_TTL_S:
                del self._released[uid]
        for node in self.nodes:
            up = self.is_up(node, now)
            if self._shown_up.get(node) != up:
                self._shown_up[node] = up
                self._changes.nodes.add(node)
                self._changes.pods.update(p.uid for p in self.pods.values() if p.node == node)

    def take_changes(self) -> Changes:
        changes, self._changes = self._changes, Changes()
        for node in changes.nodes:
            self._shown_up[node] = self.is_up(node)
        return changes

    # -- questions ---------------------------------------------------------------------

    def is_up(self, node: str, now: float | None = None) -> bool:
        state = self.nodes.get(node)
        current = self.clock() if now is None else now
        return state is not None and current - state.seen <= self.stale_after_s

    def silent_s(self, node: str, now: float | None = None) -> float:
        state = self.nodes.get(node)
        current = self.clock() if now is None else now
        return float("inf") if state is None else max(0.0, current - state.seen)

    def fresh_usage(self, node: str, now: float | None = None) -> dict[str, GpuUsage]:
        """The node's GPU usage if it is recent and the node is up; else nothing (unknown)."""
        state = self.nodes.get(node)
        current = self.clock() if now is None else now
        if state is None or not self.is_up(node, current):
            return {}
        if current - state.usage_seen > self.stale_after_s:
            return {}
        return state.usage

    def container_usage(self, node: str, namespace: str, pod: str, container: str,
                        now: float | None = None) -> ContainerUsage | None:  # fmt: skip
        """The container's last report if it is recent and its node is up."""
        state = self.containers.get((node, namespace, pod, container))
        current = self.clock() if now is None else now
        if state is None or current - state.seen > self.stale_after_s:
            return None
        if not self.is_up(node, current):
            return None
        return state.usage

    def findings_of(self, node: str, namespace: str, pod: str, container: str,
                    uuid: str) -> dict[str, Finding]:  # fmt: skip
        """The standing findings of a container on one GPU, by kind."""
        found = self.findings.get((node, namespace, pod, container), {})
        return {kind: f for (gpu, kind), f in found.items() if gpu == uuid}

    def pod_uid(self, node: str, namespace: str, name: str) -> str:
        """The uid of the pod of that name bound to that node ("" if none)."""
        return self._by_name.get((node, namespace, name), "")
