"""kube-scheduler's default filtering and scoring arithmetic, as pure functions.

What the scheduler emulation (services/simulators/scheduler.py) needs to place a pod the way
kube-scheduler's default profile does: the NodeResourcesFit filter, NodeResourcesFit scoring
with LeastAllocated (cpu and memory, weight 1 each, non-zero requests), NodeResourcesBalanced-
Allocation (cpu and memory, actual requests), how many nodes a cycle examines
(numFeasibleNodesToFind), how extender scores are added, and the uniform choice among the
highest totals. The arithmetic (int64, truncating division) follows the reference
kube-scheduler-scoring.md sections 3, 4, 6, 7 and 8.
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from services.common.quantity import milli_value, parse_quantity
from services.common.quantity import value as quantity_value

MAX_NODE_SCORE = 100
MAX_EXTENDER_PRIORITY = 10
EXTENDER_SCORE_FACTOR = MAX_NODE_SCORE // MAX_EXTENDER_PRIORITY
DEFAULT_MILLI_CPU = 100  # a container without a cpu request counts this much when scoring
DEFAULT_MEMORY = 200 * 1024 * 1024  # ... and this much memory (bytes)
MIN_FEASIBLE_NODES = 100
MIN_PERCENTAGE = 5
CPU, MEMORY, PODS = "cpu", "memory", "pods"


def quantity(value: Any, milli: bool = False) -> int:
    """A resource.Quantity as an integer (in thousandths when `milli`), rounded up as
    kube-scheduler's MilliValue()/Value() do; QuantityError names a malformed one."""
    amount = parse_quantity(value)
    return milli_value(amount) if milli else quantity_value(amount)


@dataclass(frozen=True)
class PodDemand:
    """A pod's requests as kube-scheduler counts them: `requests` (actual; cpu in millicores,
    memory in bytes, extended resources as integers) and cpu/memory with the non-zero
    defaults applied per container (scoring only)."""

    requests: Mapping[str, int]
    non_zero_cpu: int
    non_zero_memory: int


def _container_requests(container: Mapping[str, Any]) -> dict[str, int]:
    resources = container.get("resources") or {}
    requests = dict(resources.get("requests") or {})
    for name, value in (resources.get("limits") or {}).items():
        requests.setdefault(name, value)  # the API server defaults requests to limits
    return {name: quantity(v, milli=name == CPU) for name, v in requests.items()}


def pod_demand(pod: Mapping[str, Any]) -> PodDemand:
    """Sum of the app containers, raised to any init container's (per resource)."""
    spec = pod.get("spec") or {}
    total: dict[str, int] = {}
    cpu = memory = 0
    for container in spec.get("containers") or []:
        own = _container_requests(container)
        for name, value in own.items():
            total[name] = total.get(name, 0) + value
        cpu += own.get(CPU, DEFAULT_MILLI_CPU)
        memory += own.get(MEMORY, DEFAULT_MEMORY)
    for container in spec.get("initContainers") or []:
        own = _container_requests(container)
        for name, value in own.items():
            total[name] = max(total.get(name, 0), value)
        cpu = max(cpu, own.get(CPU, DEFAULT_MILLI_CPU))
        memory = max(memory, own.get(MEMORY, DEFAULT_MEMORY))
    return PodDemand(total, cpu, memory)


@dataclass
class NodeInfo:
    """What kube-scheduler's cache holds for one node."""

    name: str
    allocatable: dict[str, int]  # cpu in millicores, memory in bytes, pods, extended
    requested: dict[str, int] = field(default_factory=dict)
    non_zero_cpu: int = 0
    non_zero_memory: int = 0
    pods: int = 0

    def add(self, demand: PodDemand) -> None:
        for name, value in demand.requests.items():
            self.requested[name] = self.requested.get(name, 0) + value
        self.non_zero_cpu += demand.non_zero_cpu
        self.non_zero_memory += demand.non_zero_memory
        self.pods += 1


def fit_problem(node: NodeInfo, demand: PodDemand, ignored: Iterable[str] = ()) -> str | None:
    """NodeResourcesFit's Filter: the reason the pod does not fit, or None."""
    if node.pods + 1 > node.allocatable.get(PODS, 110):
        return "Too many pods"
    skip = set(ignored)
    for name, value in demand.requests.items():
        if value == 0 or name in skip:
            continue
        if value > node.allocatable.get(name, 0) - node.requested.get(name, 0):
            return f"Insufficient {name}"
    return None


def least_allocated(node: NodeInfo, demand: PodDemand) -> int:
    """NodeResourcesFit score, LeastAllocated over cpu and memory (weights 1)."""
    scores = []
    for alloc, req in (
        (node.allocatable.get(CPU, 0), node.non_zero_cpu + demand.non_zero_cpu),
        (node.allocatable.get(MEMORY, 0), node.non_zero_memory + demand.non_zero_memory),
    ):
        if alloc == 0:
            continue  # a resource the node does not have is left out of the average
        scores.append(0 if req > alloc else (alloc - req) * MAX_NODE_SCORE // alloc)
    return sum(scores) // len(scores) if scores else 0


def balanced_allocation_skipped(demand: PodDemand) -> bool:
    """NodeResourcesBalancedAllocation's PreScore returns Skip (the plugin scores no node this
    cycle) for a pod that requests neither cpu nor memory (v1.33+, issue #129138)."""
    return not demand.requests.get(CPU) and not demand.requests.get(MEMORY)


def balanced_allocation(node: NodeInfo, demand: PodDemand) -> int:
    """NodeResourcesBalancedAllocation over cpu and memory (actual requests)."""
    fractions = []
    for name in (CPU, MEMORY):
        alloc = node.allocatable.get(name, 0)
        if alloc:
            used = node.requested.get(name, 0) + demand.requests.get(name, 0)
            fractions.append(min(1.0, used / alloc))
    if len(fractions) < 2:
        return MAX_NODE_SCORE
    std = abs(fractions[0] - fractions[1]) / 2
    return int((1 - std) * MAX_NODE_SCORE)


def num_feasible_nodes_to_find(nodes: int, percentage: int = 0) -> int:
    """How many feasible nodes a cycle looks for before it stops filtering."""
    if nodes < MIN_FEASIBLE_NODES or percentage >= 100:
        return nodes
    if percentage <= 0:
        percentage = max(MIN_PERCENTAGE, 50 - nodes // 125)
    return min(nodes, max(MIN_FEASIBLE_NODES, nodes * percentage // 100))


def extender_total(scores: Mapping[str, int], weight: int) -> dict[str, int]:
    """An extender's prioritize answer as it adds to the nodes' totals."""
    return {host: score * weight * EXTENDER_SCORE_FACTOR for host, score in scores.items()}


def select_host(totals: Sequence[tuple[str, int]], rng: random.Random) -> str:
    """The highest total; among equal ones a uniform pick by reservoir sampling, in the
    order given (kube-scheduler's selectHost)."""
    if not totals:
        raise ValueError("no node to select")
    best_name, best = totals[0]
    count = 1
    for name, total in totals[1:]:
        if total > best:
            best_name, best, count = name, total, 1
        elif total == best:
            count += 1
            if rng.randrange(count) == 0:
                best_name = name
    return best_name
