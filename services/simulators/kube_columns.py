"""The scheduler emulation's node cache as columns (numpy arrays), one row per node.

kube-scheduler's default profile reads the same few figures of every node for every pod:
NodeResourcesFit's Filter over about 500 of 1,213 nodes, then LeastAllocated and
BalancedAllocation over the survivors. The scalar functions in kube_scoring.py do this one
node at a time (milliseconds per pod in Python); here the same integer and float arithmetic
runs on arrays. The results are the scalar functions' exactly (tests/simulators/
test_kube_columns.py pins them over random clusters and pods): integers stay int64 with
non-negative floor division (truncation, as Go's), and BalancedAllocation's fractions are
the same IEEE double operations (every figure is below 2**53, so int -> float is exact).

The NodeInfo objects stay the source of truth for what a node holds; `add` updates both.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np

from services.simulators import kube_scoring
from services.simulators.kube_scoring import CPU, MAX_NODE_SCORE, MEMORY, PODS, NodeInfo, PodDemand

DEFAULT_MAX_PODS = 110  # fit_problem's default when a node states no pods


class NodeColumns:
    """`nodes` in the given order; row i is nodes[i]."""

    def __init__(self, nodes: Sequence[NodeInfo]) -> None:
        self.nodes = list(nodes)
        count = len(self.nodes)
        self.names = [n.name for n in self.nodes]
        self.row = {name: i for i, name in enumerate(self.names)}
        self._alloc: dict[str, np.ndarray] = {}
        self._requested: dict[str, np.ndarray] = {}
        for name in {r for n in self.nodes for r in (*n.allocatable, *n.requested)}:
            self._column(name)
        self.max_pods = np.array(
            [n.allocatable.get(PODS, DEFAULT_MAX_PODS) for n in self.nodes], dtype=np.int64
        )
        self.pods = np.array([n.pods for n in self.nodes], dtype=np.int64)
        self.non_zero_cpu = np.array([n.non_zero_cpu for n in self.nodes], dtype=np.int64)
        self.non_zero_memory = np.array([n.non_zero_memory for n in self.nodes], dtype=np.int64)
        self._count = count

    def _column(self, name: str) -> tuple[np.ndarray, np.ndarray]:
        """Allocatable and requested of one resource (zeros where a node has none)."""
        if name not in self._alloc:
            self._alloc[name] = np.array(
                [n.allocatable.get(name, 0) for n in self.nodes], dtype=np.int64
            )
            self._requested[name] = np.array(
                [n.requested.get(name, 0) for n in self.nodes], dtype=np.int64
            )
        return self._alloc[name], self._requested[name]

    def fits(self, demand: PodDemand, ignored: Iterable[str] = ()) -> np.ndarray:
        """NodeResourcesFit's Filter on every row: True where fit_problem is None."""
        mask = self.pods + 1 <= self.max_pods
        skip = set(ignored)
        for name, value in demand.requests.items():
            if value == 0 or name in skip:
                continue
            alloc, requested = self._column(name)
            mask &= value <= alloc - requested
        return mask

    def feasible(self, demand: PodDemand, ignored: Iterable[str], start: int, wanted: int
                 ) -> tuple[np.ndarray, int]:  # fmt: skip
        """Rows that fit, examined from `start` round the ring, until `wanted` fit: the rows
        in examination order and how many rows were examined (kube-scheduler's
        findNodesThatPassFilters with its rotating start index)."""
        count = self._count
        if not count:
            return np.zeros(0, dtype=np.int64), 0
        order = (np.arange(count, dtype=np.int64) + start) % count
        found = np.flatnonzero(self.fits(demand, ignored)[order])
        if len(found) >= wanted > 0:
            return order[found[:wanted]], int(found[wanted - 1]) + 1
        return order[found], count

    def scores(self, rows: np.ndarray, demand: PodDemand) -> np.ndarray:
        """LeastAllocated + BalancedAllocation (unless its PreScore skips) of `rows`."""
        total = self._least_allocated(rows, demand)
        if not kube_scoring.balanced_allocation_skipped(demand):
            total += self._balanced_allocation(rows, demand)
        return total

    def _least_allocated(self, rows: np.ndarray, demand: PodDemand) -> np.ndarray:
        parts = []
        for name, used in (
            (CPU, self.non_zero_cpu[rows] + demand.non_zero_cpu),
            (MEMORY, self.non_zero_memory[rows] + demand.non_zero_memory),
        ):
            alloc = self._column(name)[0][rows]
            has = alloc != 0
            score = np.where(
                used > alloc, 0, (alloc - used) * MAX_NODE_SCORE // np.where(has, alloc, 1)
            )
            parts.append((has, np.where(has, score, 0)))
        counted = parts[0][0].astype(np.int64) + parts[1][0]
        summed = parts[0][1] + parts[1][1]
        return np.where(counted > 0, summed // np.maximum(counted, 1), 0)

    def _balanced_allocation(self, rows: np.ndarray, demand: PodDemand) -> np.ndarray:
        fractions = []
        for name in (CPU, MEMORY):
            alloc, requested = self._column(name)
            alloc = alloc[rows]
            has = alloc != 0
            used = requested[rows] + demand.requests.get(name, 0)
            share = np.minimum(1.0, used / np.where(has, alloc, 1))
            fractions.append((has, share))
        (cpu_has, cpu), (memory_has, memory) = fractions
        std = np.abs(cpu - memory) / 2
        balanced = ((1 - std) * MAX_NODE_SCORE).astype(np.int64)  # truncation, as int()
        return np.where(cpu_has & memory_has, balanced, MAX_NODE_SCORE)

    def add(self, row: int, demand: PodDemand) -> None:
        """A pod bound to `row` (the scheduler's assume): its NodeInfo and the columns."""
        for name in demand.requests:
            self._column(name)  # a new column reads NodeInfo: before it counts the pod
        self.nodes[row].add(demand)
        for name, value in demand.requests.items():
            self._requested[name][row] += value
        self.pods[row] += 1
        self.non_zero_cpu[row] += demand.non_zero_cpu
        self.non_zero_memory[row] += demand.non_zero_memory
