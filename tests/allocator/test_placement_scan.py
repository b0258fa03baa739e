"""best_node's and prioritize's scan of the node table score exactly as the loop over the
nodes does (and the simulator's least_stranded for CPU-only pods as its own loop).

Two identical clusters take the same random stream of events (GPU pods of every openb shape,
multi-container pods, CPU-only pods, pods ending, host usage from outside, nodes joining, going
silent and coming back): one core scores by the column scan (node_table.py), the other node
by node (``scan_columns = False``), as filter still does. Every best_node answer and every
allocation must be the same, for every policy; so must prioritize's scores of some names.
"""

from __future__ import annotations

import dataclasses
import random
from typing import Any

import msgspec
import numpy as np
import pytest

from services.allocator.cluster import CapacityConfig, ClusterState
from services.allocator.core import PlacementCore, PodRef
from services.allocator.fragmentation import WorkloadMix
from services.allocator.ledger import Ledger
from services.allocator.pod_request import PodRequest, Selection
from services.allocator.policies import POLICIES, HostPack, ScoreContext
from services.common.schemas import NodeInventory
from services.simulate.baselines import baseline_policies
from services.simulate.replay import _least_stranded_loop, inventories, least_stranded, manifest
from services.simulate.trace import OPENB_MODEL_MEMORY_MIB, TraceNode, TracePod

TIMEOUT_S = 30.0
MODELS = ("T4", "V100M32", "A10", "P100")


def _nodes(rng: random.Random, count: int, prefix: str = "n") -> list[NodeInventory]:
    trace_nodes = []
    for i in range(count):
        model = rng.choice(MODELS)
        trace_nodes.append(
            TraceNode(
                name=f"{prefix}{i:03d}",
                cpu_milli=rng.choice((0, 32000, 64000, 96000)),
                memory_mib=rng.choice((0, 262144, 524288)),
                gpus=rng.choice((1, 2, 4, 8)),
                model=model,
                gpu_memory_mib=OPENB_MODEL_MEMORY_MIB[model],
            )
        )
    return [
        msgspec.structs.replace(inventory, max_pods=rng.choice((0, 0, 6)))
        for inventory in inventories(trace_nodes)
    ]


def _gpu_pod(rng: random.Random, number: int) -> dict[str, Any]:
    return _trace_pod(rng, number)[0]


def _trace_pod(rng: random.Random, number: int) -> tuple[dict[str, Any], TracePod]:
    gpus = rng.choice((1, 1, 1, 2, 4, 8, 0))
    milli = rng.choice((50, 110, 250, 500, 810, 1000)) if gpus == 1 else 1000 * gpus
    models = rng.choice(((), (), (), ("T4",), ("V100M32", "A10")))
    trace_pod = TracePod(
        f"p{number}",
        cpu_milli=rng.choice((1000, 4000, 8000, 16000, 32000)),
        memory_mib=rng.choice((1024, 16384, 65536)),
        num_gpu=gpus,
        gpu_milli=milli,
        gpu_models=models,
    )
    spec = manifest(trace_pod, f"u{number}")
    if gpus and rng.random() < 0.1:  # a second container: the bound test is skipped
        limits = {"nvidia.com/gpu": "1", "nvidia.com/gpumem": "2000"}
        second = {"name": "side", "resources": {"limits": limits}}
        spec["spec"]["containers"].append(second)
    return spec, trace_pod


class Twin:
    def __init__(self, policy: str, seed: int, nodes: list[NodeInventory], clock: Any) -> None:
        cluster = ClusterState(TIMEOUT_S, CapacityConfig(split_count=10), clock=clock)
        for inventory in nodes:
            cluster.update(inventory)
        ledger = Ledger(cluster)
        policies = {**POLICIES, **baseline_policies(seed, ledger)}
        mix = WorkloadMix(window=300, refresh_every=25)
        self.core = PlacementCore(
            cluster, ledger, node_policy=policy, gpu_policy=policy, policies=policies, mix=mix
        )


def _replay_both(policy: str, seed: int, events: int = 400) -> int:
    rng = random.Random(seed)
    now = [0.0]
    nodes = _nodes(rng, 60)
    scan, loop = (Twin(policy, seed, nodes, lambda: now[0]) for _ in range(2))
    loop.core.scan_columns = False
    placed: list[str] = []
    decisions = 0
    for number in range(events):
        roll = rng.random()
        if roll < 0.04 and placed:  # a pod ends
            uid = placed.pop(rng.randrange(len(placed)))
            for twin in (scan, loop):
                twin.core.ledger.release(uid)
            continue
        if roll < 0.07:  # time passes: most nodes report, a few stay silent for a while
            now[0] += TIMEOUT_S * 0.6
            for inventory in nodes:
                if rng.random() < 0.9:
                    for twin in (scan, loop):
                        twin.core.cluster.update(inventory)
            continue
        if roll < 0.08:  # a node joins
            new = _nodes(rng, 1, prefix=f"j{number}-")
            nodes.extend(new)
            for twin in (scan, loop):
                twin.core.cluster.update(new[0])
            continue
        if roll < 0.10:  # a pod vgpu did not place takes host CPU and memory
            name, cpu = rng.choice(nodes).node, rng.choice((2000, 8000))
            for twin in (scan, loop):
                twin.core.cluster.charge_host(name, cpu, 4096, 1)
            continue
        spec, trace_pod = _trace_pod(rng, number)
        requests = [twin.core.parse(spec) for twin in (scan, loop)]
        if requests[0].containers:
            for twin, request in zip((scan, loop), requests, strict=True):
                twin.core.observe(request)
            if rng.random() < 0.3:  # as the extender asks: some names, in its order
                names = [i.node for i in rng.sample(nodes, 25)] + ["unknown-node"]
                assert scan.core.prioritize(requests[0], names) == loop.core.prioritize(
                    requests[1], names
                )
            chosen = scan.core.best_node(requests[0])
            expected = loop.core.best_node(requests[1])
        else:  # the simulator's stand-in for kube-scheduler
            requests = [
                dataclasses.replace(
                    r, cpu_milli=trace_pod.cpu_milli, memory_mib=trace_pod.memory_mib
                )
                for r in requests
            ]
            chosen = least_stranded(scan.core, requests[0])
            expected = _least_stranded_loop(loop.core, requests[1])
        assert chosen == expected, f"event {number}: {spec['metadata']['name']}"
        decisions += 1
        if chosen is None or not scan.core.cluster.status(chosen).available:
            continue  # least_stranded, as the simulator's, does not ask about freshness
        ref = PodRef("t", f"p{number}", f"u{number}")
        allocations = [
            twin.core.commit(ref, chosen, request)
            for twin, request in zip((scan, loop), requests, strict=True)
        ]
        assert allocations[0].containers == allocations[1].containers
        placed.append(ref.uid)
    return decisions


@pytest.mark.parametrize("policy", [*POLICIES, "bestfit", "random", "gpuclustering"])
def test_the_scan_places_as_the_loop(policy: str) -> None:
    assert _replay_both(policy, seed=7) > 150


@pytest.mark.parametrize("seed", [1, 2])
def test_the_scan_places_as_the_loop_default_policy_more_seeds(seed: int) -> None:
    assert _replay_both("hostpack", seed) > 150


def test_host_scores_equal_host_score_to_the_last_bit() -> None:
    rng = random.Random(5)
    now = [0.0]
    nodes = _nodes(rng, 60)
    core = Twin("hostpack", 0, nodes, lambda: now[0]).core
    for number in range(300):  # fill part of the cluster, with model-restricted pods in the mix
        request = core.parse(_gpu_pod(rng, number))
        if not request.containers:
            continue
        core.observe(request)
        node = core.best_node(request)
        if node is not None:
            core.commit(PodRef("t", f"p{number}", f"u{number}"), node, request)
    policy = HostPack()
    table = core.cluster.table()
    ctx = ScoreContext(core.mix.snapshot(), core.cluster, core.mix.model_shares())
    assert ctx.model_shares  # the model penalty is in play
    rows = np.arange(len(table.names))
    views = np.array(
        [(rng.uniform(0, 8), rng.uniform(0, 8), rng.random() < 0.3) for _ in rows], dtype=float
    )
    for cpu in (0, 1000, 12000, 64000):
        for use_types in ((), ("t4",)):
            pod = PodRequest(containers=(), selection=Selection(use_types=use_types), cpu_milli=cpu)
            vector = policy.host_scores(ctx, table, rows, views, pod)
            scalar = [
                policy.host_score(ctx, table.nodes[r], (v[0], v[1], bool(v[2])), pod)
                for r, v in zip(rows.tolist(), views.tolist(), strict=True)
            ]
            assert vector.tolist() == scalar
