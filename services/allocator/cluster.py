"""The cluster as placement sees it: nodes, their GPUs' capacity and what is promised on them.

Capacity comes from the node agents' inventories: a GPU's schedulable memory is the card's
memory minus a reserve (CUDA context, driver), times its memory scaling (> 1
oversubscribes, as HAMi's deviceMemoryScaling); compute is 100 per GPU times its cores
scaling; task slots are its split count. Each figure is the GPU's own where its agent states
it, else the allocator's setting; a per-node memory scaling in the allocator's settings wins
over both (``gpu_capacity``). Usage is the sum of the ledger's charges. Every change to a
node bumps its ``version``, which is what the placement caches key on.

Freshness is measured on this process's monotonic clock at receipt, not from the sender's
``sent_at``, so clock skew between nodes cannot make a live node look dead (or the reverse).
A node that falls silent keeps its allocations; it only takes no new ones.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import NamedTuple

import msgspec

from services.common.schemas import GpuDevice, NodeInventory
from services.common.sharing import VGPU

from .mig_fit import live_mask, mig_capacity
from .node_table import NodeTable

FULL_COMPUTE = 100
_NO_GPU = GpuDevice(uuid="", index=-1, model="", memory_mib=0)  # states nothing


class Charge(NamedTuple):
    """What one pod holds on one GPU (a tuple: placement creates millions of these)."""

    memory_mib: int = 0
    cores: int = 0
    slots: int = 0
    # Dynamic MIG: memory slices held by MIG instances (mig_fit.py); disjoint between pods,
    # so they add and subtract like the other figures.
    mig_mask: int = 0

    def __add__(self, other: Charge) -> Charge:  # type: ignore[override]
        return Charge(
            self.memory_mib + other.memory_mib,
            self.cores + other.cores,
            self.slots + other.slots,
            self.mig_mask + other.mig_mask,
        )

    def __sub__(self, other: Charge) -> Charge:
        return Charge(
            self.memory_mib - other.memory_mib,
            self.cores - other.cores,
            self.slots - other.slots,
            self.mig_mask - other.mig_mask,
        )


@dataclass(eq=False)
class GpuState:
    device: GpuDevice
    base_memory_mib: int  # the card minus the reserve: what 100% of the card means
    memory_mib: int  # schedulable: base x the GPU's memory scaling
    slots: int  # task slots (split count)
    used: Charge = field(default_factory=Charge)
    compute: int = FULL_COMPUTE  # compute shares may sum to this: 100 x the cores scaling
    mig_live_mask: int = 0  # dynamic MIG: memory slices its existing GIs hold (inventory)

    @property
    def uuid(self) -> str:
        return self.device.uuid

    @property
    def index(self) -> int:
        return self.device.index

    @property
    def healthy(self) -> bool:
        # vgpu slices a GPU in MIG mode only by dynamic MIG (MIG instances made on demand).
        return self.device.healthy and (not self.device.mig_mode or self.device.mig_dynamic)

    @property
    def sharing_mode(self) -> str:
        return self.device.sharing_mode

    @property
    def free_memory(self) -> int:
        return self.memory_mib - self.used.memory_mib

    @property
    def free_cores(self) -> int:
        return self.compute - self.used.cores

    @property
    def free_slots(self) -> int:
        return self.slots - self.used.slots

    def state_key(self) -> tuple[object, ...]:
        """Everything fit and fragmentation depend on, except identity: a memo key."""
        return (
            self.device.model,
            self.base_memory_mib,
            self.free_memory,
            self.free_cores,
            self.free_slots,
            self.healthy,
        )


@dataclass(frozen=True)
class NodeStatus:
    """Whether a node can take new placements now; `reason` says why not."""

    gpus: tuple[GpuDevice, ...] | None  # None: never heard of
    silent_s: float = 0.0
    reason: str = ""

    @property
    def available(self) -> bool:
        return not self.reason


@dataclass(eq=False)
class NodeState:
    name: str
    inventory: NodeInventory
    gpus: list[GpuState]  # index order
    by_uuid: dict[str, GpuState]
    memory_scaling: float
    received_at: float
    # What kube-scheduler sees (the Node's allocatable; else the agent's capacity hints;
    # 0 = not known, then not checked) and what every pod bound here holds (host_usage.py).
    cpu_milli: int = 0
    host_memory_mib: int = 0
    max_pods: int = 0
    used_cpu_milli: int = 0
    used_memory_mib: int = 0
    used_pods: int = 0
    version: int = 0
    cache: dict[object, tuple[int, object]] = field(default_factory=dict)
    positions: dict[str, int] = field(default_factory=dict)  # uuid -> index in `gpus`
    _signature: tuple[int, tuple[object, ...]] | None = field(default=None, repr=False)
    _free_cores: tuple[int, tuple[int, ...]] | None = field(default=None, repr=False)

    # What an idle node can hold, without identity (its GPUs never change: a new inventory
    # makes a new NodeState), and the models among its GPUs.
    capacity_signature: tuple[object, ...] = field(init=False)
    models: tuple[str, ...] = field(init=False)

    def __post_init__(self) -> None:
        self.positions = {g.uuid: i for i, g in enumerate(self.gpus)}
        self.capacity_signature = (
            tuple(
                (
                    g.device.model,
                    g.base_memory_mib,
                    g.memory_mib,
                    g.slots,
                    g.compute,
                    g.device.numa_node,
                    g.device.sharing_mode,
                    g.device.mig_dynamic,
                )
                for g in self.gpus
            ),
            self.cpu_milli,
            self.host_memory_mib,
            self.max_pods,
        )
        self.models = tuple(sorted({g.device.model for g in self.gpus}))

    def signature(self) -> tuple[object, ...]:
        """The node's GPUs as placement sees them, without identity: nodes with equal
        signatures fit and score a GPU-only request alike (memoised per version)."""
        memo = self._signature
        if memo is None or memo[0] != self.version:
            positions = self.positions
            signature = tuple(
                (
                    *g.state_key(),
                    g.memory_mib,
                    g.slots,
                    g.compute,
                    g.device.numa_node,
                    tuple(sorted(positions[p] for p in g.device.nvlink_peers if p in positions)),
                    g.device.sharing_mode,
                    g.device.mig_dynamic and (g.device.model, g.used.mig_mask | g.mig_live_mask),
                )
                for g in self.gpus
            )
            memo = self._signature = (self.version, signature)
        return memo[1]

    def free_cores(self) -> tuple[int, ...]:
        """Free compute of the GPUs that could take one more slice, largest first (memoised
        per version): a quick bound on what fits."""
        memo = self._free_cores
        if memo is None or memo[0] != self.version:
            # Only vgpu GPUs are bounded by compute: a replica of the others asks none.
            free = sorted(
                (
                    g.compute - g.used.cores if g.device.sharing_mode == VGPU else g.compute
                    for g in self.gpus
                    if g.healthy and g.free_slots > 0
                ),
                reverse=True,
            )
            memo = self._free_cores = (self.version, tuple(free))
        return memo[1]

    def touch(self) -> None:
        self.version += 1
        if len(self.cache) > 256:  # shapes come and go; keep the cache bounded
            self.cache.clear()


class Allocatable(NamedTuple):
    """A Node's status.allocatable as kube-scheduler reads it (0 = not stated)."""

    cpu_milli: int = 0
    memory_mib: int = 0
    pods: int = 0


@dataclass(frozen=True)
class CapacityConfig:
    memory_reserve_mib: int = 0
    split_count: int = 10
    memory_scaling: float = 1.0
    node_memory_scaling: Mapping[str, float] = field(default_factory=dict)
    cores_scaling: float = 1.0


class GpuCapacity(NamedTuple):
    """What one GPU offers placement: memory scaling, compute total (percent), task slots."""

    memory_scaling: float
    compute: int
    slots: int


def gpu_capacity(config: CapacityConfig, node: str, gpu: GpuDevice) -> GpuCapacity:
    """The GPU's sharing figures. Precedence: the allocator's per-node memory scaling (an
    operator's override), then what the node's agent states for the GPU, then the allocator's
    cluster-wide setting (agents that state nothing)."""
    memory = config.node_memory_scaling.get(node) or gpu.memory_scaling or config.memory_scaling
    cores = gpu.cores_scaling or config.cores_scaling
    # A shared or exclusive GPU states its device IDs (replicas, modes.py); else the
    # agent's split count, else the allocator's.
    slots = gpu.replicas or gpu.split_count or config.split_count
    return GpuCapacity(memory, max(1, round(FULL_COMPUTE * cores)), slots)


class ClusterState:
    def __init__(
        self,
        node_timeout_s: float,
        capacity: CapacityConfig | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._timeout_s = node_timeout_s
        self.capacity = capacity or CapacityConfig()
        self._clock = clock
        self._nodes: dict[str, NodeState] = {}
        self.capacity_version = 0  # bumps when any node's GPUs change: never-fits caches
        # Cluster-wide, kept up to date per change: idle nodes by GPU count, free compute
        # in GPUs' worth (what policies weigh against keeping whole nodes free).
        self.idle_nodes: dict[int, int] = {}
        self.free_gpus = 0.0
        self.free_by_model: dict[str, float] = {}
        self.gpus_by_model: dict[str, int] = {}
        self._classes: tuple[int, list[NodeState]] | None = None
        self._allocatable: dict[str, Allocatable] = {}  # from Node objects (cluster watch)
        # What changed since the node table last looked (node_table.py): names of nodes whose
        # figures changed, and a count that moves when the set of nodes does.
        self.layout_version = 0
        self._changed: set[str] = set()
        self._table: NodeTable | None = None
        # Moves with every change a placement or a score could read (usage, capacity, new
        # nodes), not with heartbeats: equal generations, equal answers (the filter's scan
        # reused by prioritize, core.py).
        self.generation = 0

    # -- inventory ------------------------------------------------------------------------

    def update(self, inventory: NodeInventory) -> bool:
        """Keep `inventory` as the node's latest; True when its GPUs changed (or are new).

        A GPU listed twice keeps its first entry: placement relies on uuids being distinct.
        The node's usage is carried over; the caller re-applies charges when GPUs changed.
        """
        first: dict[str, GpuDevice] = {}
        for gpu in inventory.gpus:
            first.setdefault(gpu.uuid, gpu)
        unique = sorted(first.values(), key=lambda g: g.index)
        if len(unique) != len(inventory.gpus):
            inventory = msgspec.structs.replace(inventory, gpus=unique)
        previous = self._nodes.get(inventory.node)
        now = self._clock()
        host = self.host_capacity(inventory)
        if (
            previous is not None
            and previous.inventory.gpus == inventory.gpus
            and (previous.cpu_milli, previous.host_memory_mib, previous.max_pods) == host
        ):
            previous.inventory = inventory
            previous.received_at = now
            self._changed.add(inventory.node)
            return False
        self._build(inventory, host, previous, now)
        return True

    def host_capacity(self, inventory: NodeInventory) -> Allocatable:
        """The node's CPU, memory and pod capacity: the Node object's allocatable where the
        cluster stated it (what kube-scheduler checks), else the agent's hints."""
        stated = self._allocatable.get(inventory.node)
        hints = Allocatable(inventory.cpu_milli, inventory.host_memory_mib, inventory.max_pods)
        if stated is None:
            return hints
        return Allocatable(*(s or h for s, h in zip(stated, hints, strict=True)))

    def set_allocatable(self, node: str, allocatable: Allocatable | None) -> bool:
        """Take (or, with None, forget) a Node object's allocatable; True when the node's
        capacity changed."""
        if allocatable is None:
            if self._allocatable.pop(node, None) is None:
                return False
        elif self._allocatable.get(node) == allocatable:
            return False
        else:
            self._allocatable[node] = allocatable
        previous = self._nodes.get(node)
        if previous is None:
            return False
        host = self.host_capacity(previous.inventory)
        if (previous.cpu_milli, previous.host_memory_mib, previous.max_pods) == host:
            return False
        self._build(previous.inventory, host, previous, previous.received_at)
        return True

    def allocatable(self, node: str) -> Allocatable | None:
        return self._allocatable.get(node)

    def _build(
        self,
        inventory: NodeInventory,
        host: Allocatable,
        previous: NodeState | None,
        received_at: float,
    ) -> None:
        """A new NodeState for the node (its capacity changed), usage carried over."""
        unique = inventory.gpus
        capacities = [gpu_capacity(self.capacity, inventory.node, gpu) for gpu in unique]
        gpus = [self._gpu_state(g, c) for g, c in zip(unique, capacities, strict=True)]
        # The node's figure on its allocations: its most oversubscribed GPU.
        scaling = max(
            (c.memory_scaling for c in capacities),
            default=gpu_capacity(self.capacity, inventory.node, _NO_GPU).memory_scaling,
        )
        node = NodeState(
            name=inventory.node,
            inventory=inventory,
            gpus=gpus,
            by_uuid={g.uuid: g for g in gpus},
            memory_scaling=scaling,
            received_at=received_at,
            cpu_milli=host.cpu_milli,
            host_memory_mib=host.memory_mib,
            max_pods=host.pods,
            version=(previous.version + 1) if previous else 0,
        )
        if previous is not None:
            for gpu in gpus:
                old = previous.by_uuid.get(gpu.uuid)
                if old is not None:
                    gpu.used = old.used
            node.used_cpu_milli = previous.used_cpu_milli
            node.used_memory_mib = previous.used_memory_mib
            node.used_pods = previous.used_pods
        if previous is not None:
            self._account(previous, -1)
        else:
            self.layout_version += 1
        self._changed.add(inventory.node)
        self._nodes[inventory.node] = node
        self._account(node, 1)
        self.capacity_version += 1
        self.generation += 1

    def _account(self, node: NodeState, sign: int) -> None:
        """Add (1) or remove (-1) the node's part of the cluster-wide figures."""
        if all(not g.used.slots for g in node.gpus):
            size = len(node.gpus)
            self.idle_nodes[size] = self.idle_nodes.get(size, 0) + sign
        for gpu in node.gpus:
            free = sign * (gpu.compute - gpu.used.cores) / gpu.compute
            self.free_gpus += free
            model = gpu.device.model
            self.free_by_model[model] = self.free_by_model.get(model, 0.0) + free
            self.gpus_by_model[model] = self.gpus_by_model.get(model, 0) + sign

    def _gpu_state(self, gpu: GpuDevice, capacity: GpuCapacity) -> GpuState:
        if gpu.mig_dynamic:  # MIG carves the card in hardware: no reserve, no oversubscription
            whole = mig_capacity(gpu.model) or gpu.memory_mib  # the full-GPU profile
            return GpuState(
                device=gpu,
                base_memory_mib=whole,
                memory_mib=whole,
                slots=capacity.slots,
                mig_live_mask=live_mask(gpu.mig_devices),
            )
        base = max(0, gpu.memory_mib - self.capacity.memory_reserve_mib)
        return GpuState(
            device=gpu,
            base_memory_mib=base,
            memory_mib=int(base * capacity.memory_scaling),
            slots=capacity.slots,
            compute=capacity.compute,
        )

    # -- usage ----------------------------------------------------------------------------

    def charge(
        self, node: str, charges: Mapping[str, Charge], cpu_milli: int, memory_mib: int, sign: int
    ) -> None:
        """Add (sign 1) or remove (sign -1) a pod's charges on a node's GPUs."""
        state = self._nodes.get(node)
        if state is None:
            return  # unknown node: the ledger keeps the charge; applied when it reports
        self._account(state, -1)
        for uuid, charge in charges.items():
            gpu = state.by_uuid.get(uuid)
            if gpu is not None:
                gpu.used = gpu.used + charge if sign > 0 else gpu.used - charge
        state.used_cpu_milli += sign * cpu_milli
        state.used_memory_mib += sign * memory_mib
        self._account(state, 1)
        state.touch()
        self._changed.add(node)
        self.generation += 1

    def charge_host(self, node: str, cpu_milli: int, memory_mib: int, pods: int) -> None:
        """Add (or, negative, remove) what a pod holds of the node's CPU, memory and pod
        slots. GPU placements do not depend on it (checked uncached): no version bump."""
        state = self._nodes.get(node)
        if state is None:
            return  # unknown node: host_usage keeps it; applied when the node reports
        state.used_cpu_milli += cpu_milli
        state.used_memory_mib += memory_mib
        state.used_pods += pods
        self._changed.add(node)
        self.generation += 1

    def reset_usage(self, node: str) -> None:
        state = self._nodes.get(node)
        if state is None:
            return
        self._account(state, -1)
        for gpu in state.gpus:
            gpu.used = Charge()
        state.used_cpu_milli = state.used_memory_mib = state.used_pods = 0
        self._account(state, 1)
        state.touch()
        self._changed.add(node)
        self.generation += 1

    def take_changes(self) -> tuple[int, set[str]]:
        """The layout version and the nodes changed since the last call (NodeTable's)."""
        changed, self._changed = self._changed, set()
        return self.layout_version, changed

    def table(self) -> NodeTable:
        """Every node's figures as columns, up to date (one table per cluster: it alone
        takes the changes)."""
        if self._table is None:
            self._table = NodeTable(self)
        else:
            self._table.sync()
        return self._table

    # -- views ----------------------------------------------------------------------------

    def node(self, name: str) -> NodeState | None:
        return self._nodes.get(name)

    def gpus(self, node: str) -> tuple[GpuDevice, ...] | None:
        state = self._nodes.get(node)
        return None if state is None else tuple(state.inventory.gpus)

    def silent_s(self, state: NodeState) -> float:
        return self._clock() - state.received_at

    def status(self, node: str) -> NodeStatus:
        state = self._nodes.get(node)
        if state is None:
            return NodeStatus(
                gpus=None,
                reason=f"node {node!r}: no GPU inventory received from its vgpu node agent",
            )
        gpus = tuple(state.inventory.gpus)
        silent_s = self._clock() - state.received_at
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

    def is_fresh(self, state: NodeState) -> bool:
        return self._clock() - state.received_at <= self._timeout_s

    def fresh_since(self) -> float:
        """Nodes heard from at or after this (monotonic) time are fresh: one clock read for
        a whole call instead of one per node."""
        return self._clock() - self._timeout_s

    def lookup(self) -> Callable[[str], NodeState | None]:
        return self._nodes.get

    def all_gpus(self) -> dict[str, tuple[GpuDevice, ...]]:
        """Every node ever heard of, fresh or not: the cluster's capacity."""
        return {node: tuple(s.inventory.gpus) for node, s in self._nodes.items()}

    def states(self) -> Iterable[NodeState]:
        return self._nodes.values()

    def capacity_classes(self) -> list[NodeState]:
        """One node of each capacity signature: every idle node is like one of these."""
        memo = self._classes
        if memo is None or memo[0] != self.capacity_version:
            classes: dict[tuple[object, ...], NodeState] = {}
            for node in self._nodes.values():
                classes.setdefault(node.capacity_signature, node)
            memo = self._classes = (self.capacity_version, list(classes.values()))
        return memo[1]

    def nodes(self) -> list[str]:
        return sorted(self._nodes)
