"""The scheduler emulation's column scans give exactly what kube_scoring's scalar functions
give, node by node, over random clusters and pods as they fill up: the fit filter, the
rotating-start search for feasible nodes, LeastAllocated + BalancedAllocation."""

from __future__ import annotations

import random

import numpy as np
import pytest

from services.simulators import kube_scoring
from services.simulators.kube_columns import NodeColumns
from services.simulators.kube_scoring import NodeInfo, PodDemand

GI = 1024**3
IGNORED = frozenset({"nvidia.com/gpumem"})


def random_node(rng: random.Random, i: int) -> NodeInfo:
    allocatable = {"pods": rng.choice((3, 8, 110))}
    if rng.random() > 0.05:  # a few nodes state no cpu or no memory at all
        allocatable["cpu"] = rng.choice((0, 4000, 32_000, 96_000, 128_000))
    if rng.random() > 0.05:
        allocatable["memory"] = rng.choice((0, 8 * GI, 256 * GI, 1024 * GI + 7))
    if rng.random() < 0.7:
        allocatable["nvidia.com/gpu"] = rng.choice((10, 20, 80))
    if rng.random() < 0.1:
        del allocatable["pods"]  # fit_problem's default of 110
    return NodeInfo(f"node-{i:04d}", allocatable)


def random_demand(rng: random.Random) -> PodDemand:
    requests: dict[str, int] = {}
    if rng.random() < 0.8:
        requests["cpu"] = rng.choice((0, 100, 1000, 4000, 16_000, 64_000))
    if rng.random() < 0.8:
        requests["memory"] = rng.choice((0, GI, 3 * GI + 1, 64 * GI))
    if rng.random() < 0.5:
        requests["nvidia.com/gpu"] = rng.choice((1, 2, 8))
    if rng.random() < 0.2:
        requests["nvidia.com/gpumem"] = 4000  # ignored by the scheduler
    if rng.random() < 0.05:
        requests["example.com/fpga"] = 1  # no node has it
    return PodDemand(
        requests,
        non_zero_cpu=requests.get("cpu") or kube_scoring.DEFAULT_MILLI_CPU,
        non_zero_memory=requests.get("memory") or kube_scoring.DEFAULT_MEMORY,
    )


def scalar_feasible(
    nodes: list[NodeInfo], demand: PodDemand, start: int, wanted: int
) -> tuple[list[int], int]:
    """The emulation's former one-node-at-a-time search (kube-scheduler's)."""
    found: list[int] = []
    examined = 0
    for offset in range(len(nodes)):
        row = (start + offset) % len(nodes)
        examined += 1
        if kube_scoring.fit_problem(nodes[row], demand, IGNORED) is None:
            found.append(row)
            if len(found) >= wanted:
                break
    return found, examined


def scalar_score(node: NodeInfo, demand: PodDemand) -> int:
    score = kube_scoring.least_allocated(node, demand)
    if not kube_scoring.balanced_allocation_skipped(demand):
        score += kube_scoring.balanced_allocation(node, demand)
    return score


@pytest.mark.parametrize("seed", range(6))
def test_columns_match_the_scalar_functions_as_the_cluster_fills(seed: int) -> None:
    rng = random.Random(seed)
    count = rng.choice((1, 7, 150, 400))
    nodes = [random_node(rng, i) for i in range(count)]
    columns = NodeColumns(nodes)
    start = 0
    for _ in range(300):
        demand = random_demand(rng)
        expected_fit = [kube_scoring.fit_problem(n, demand, IGNORED) is None for n in nodes]
        assert columns.fits(demand, IGNORED).tolist() == expected_fit
        wanted = kube_scoring.num_feasible_nodes_to_find(count, rng.choice((0, 0, 10, 100)))
        rows, examined = columns.feasible(demand, IGNORED, start, wanted)
        assert (rows.tolist(), examined) == scalar_feasible(nodes, demand, start, wanted)
        start = (start + examined) % count
        every = np.arange(count, dtype=np.int64)
        assert columns.scores(every, demand).tolist() == [scalar_score(n, demand) for n in nodes]
        if rows.size:
            columns.add(int(rng.choice(rows.tolist())), demand)
        else:
            columns.add(rng.randrange(count), demand)  # overcommitted nodes score too


def test_a_resource_first_seen_after_binds_counts_what_was_bound() -> None:
    nodes = [NodeInfo("a", {"cpu": 1000, "memory": GI, "pods": 110})]
    columns = NodeColumns(nodes)
    fpga = PodDemand({"example.com/fpga": 1}, 100, 100)
    columns.add(0, fpga)
    columns.add(0, fpga)
    assert nodes[0].requested["example.com/fpga"] == 2
    assert columns.fits(fpga).tolist() == [False]  # the node has none
    assert int(columns.pods[0]) == nodes[0].pods == 2
