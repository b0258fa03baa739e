"""One replay: a trace's arrival sequence through the allocator's PlacementCore.

The simulator builds the same ClusterState / Ledger / PlacementCore the extender uses and
drives them synchronously: parse -> observe -> best_node (filter + exact score over every
node) -> commit. Nothing about placement is re-implemented here.

CPU-only pods never reach the extender in a real cluster (kube-scheduler places them), so
the core does not rank them. They still take CPU and host memory on the node they land on,
which the paper counts, so the simulator stands in for kube-scheduler for them, the same way
for every policy, and records them through the same `commit`: by default on the node where
they strand the fewest GPUs (`least_stranded`); `least-allocated` is kube-scheduler's
default scoring (measured: it strands about 5% of the GPUs, docs/simulate.md).
"""

from __future__ import annotations

import dataclasses
import gc
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from services.allocator.cluster import CapacityConfig, ClusterState
from services.allocator.core import DEFAULT_POLICY, PlacementCore, PodRef
from services.allocator.fragmentation import WorkloadMix
from services.allocator.ledger import Ledger
from services.allocator.placement import host_problem
from services.allocator.pod_request import PodRequest
from services.allocator.policies import POLICIES, HostPack, Policy
from services.common.schemas import GpuDevice, NodeInventory
from services.simulate.baselines import baseline_policies
from services.simulate.trace import TraceNode, TracePod

CHECKPOINTS = (1.0, 1.1, 1.2, 1.3)  # demand levels reported, as in the paper's figures
CURVE_STEP = 0.01  # demand resolution of the plotted curve
NAMESPACE = "trace"
_HOST = HostPack()  # its notion of stranded GPUs, for pods without GPUs
_USABLE_KEY = ("hostpack", "usable-gpus")  # NodeTable.derived key
CpuPlacer = Callable[[PlacementCore, PodRequest], "str | None"]


def policy_names() -> list[str]:
    """Every policy `vgpu simulate` knows: the engine's own and the paper's baselines."""
    return sorted({*POLICIES, *baseline_policies(0)})


def inventories(nodes: Sequence[TraceNode]) -> list[NodeInventory]:
    """Trace nodes as the node agent would report them (GPU memory from the model table)."""
    return [
        NodeInventory(
            node=node.name,
            gpus=[
                GpuDevice(
                    uuid=f"{node.name}-gpu{i}",
                    index=i,
                    model=node.model,
                    memory_mib=node.gpu_memory_mib,
                    numa_node=i * 2 // node.gpus,
                )
                for i in range(node.gpus)
            ],
            cpu_milli=node.cpu_milli,
            host_memory_mib=node.memory_mib,
        )
        for node in nodes
    ]


def manifest(pod: TracePod, uid: str) -> dict[str, Any]:
    """The pod as vgpu's resources ask for it.

    A share of one GPU becomes the same percentage of the card's memory (the engine turns it
    into MiB with the GPU's model memory) and of its compute; whole GPUs are a bare
    nvidia.com/gpu. Accepted models become nvidia.com/use-gputype."""
    limits: dict[str, str] = {}
    if pod.num_gpu == 1 and pod.gpu_milli < 1000:
        percent = max(1, round(pod.gpu_milli / 10))
        limits = {
            "nvidia.com/gpu": "1",
            "nvidia.com/gpumem-percentage": str(percent),
            "nvidia.com/gpucores": str(percent),
        }
    elif pod.num_gpu:
        limits = {"nvidia.com/gpu": str(pod.num_gpu)}
    requests = {"cpu": f"{pod.cpu_milli}m", "memory": f"{pod.memory_mib}Mi", **limits}
    annotations = {"nvidia.com/use-gputype": ",".join(pod.gpu_models)} if pod.gpu_models else {}
    return {
        "metadata": {"name": pod.name, "namespace": NAMESPACE, "uid": uid,
                     "annotations": annotations},
        "spec": {"containers": [{"name": "main", "resources": {"limits": limits,
                                                               "requests": requests}}]},
    }  # fmt: skip


def build_core(
    nodes: Sequence[TraceNode], policy: str, seed: int, split_count: int = 10
) -> PlacementCore:
    capacity = CapacityConfig(memory_reserve_mib=0, split_count=split_count, memory_scaling=1.0)
    cluster = ClusterState(node_timeout_s=1e12, capacity=capacity)
    for inventory in inventories(nodes):
        cluster.update(inventory)
    ledger = Ledger(cluster)
    policies: dict[str, Policy] = {**POLICIES, **baseline_policies(seed, ledger)}
    return PlacementCore(
        cluster, ledger, node_policy=policy, gpu_policy=policy, policies=policies,
        mix=WorkloadMix(window=2000),
    )  # fmt: skip


@dataclass
class ReplayResult:
    policy: str
    seed: int
    capacity_gpus: int
    pods: int = 0
    failed_pods: int = 0
    alloc_at: dict[float, float] = field(default_factory=dict)  # demand -> allocation ratio
    curve: list[tuple[float, float]] = field(default_factory=list)  # (demand, ratio)
    decision_ms: list[float] = field(default_factory=list)
    # The same decisions in CPU time of the deciding thread: what wall time would be on an
    # idle machine (on a shared one, wall time also counts other processes' turns).
    decision_cpu_ms: list[float] = field(default_factory=list)
    seconds: float = 0.0
    recorded_ms: dict[float, float] = field(default_factory=dict)  # percentiles, from a record
    method: str = "vgpu"  # vgpu: through vgpu's engine; paper: the FGD paper's simulator

    def percentile_ms(self, q: float) -> float:
        if not self.decision_ms:
            return self.recorded_ms.get(q, 0.0)
        ordered = sorted(self.decision_ms)
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))]

    def cpu_percentile_ms(self, q: float) -> float:
        """percentile_ms of the decisions' CPU time (0 when not measured)."""
        ordered = sorted(self.decision_cpu_ms)
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else 0.0

    def to_json(self) -> dict[str, Any]:
        def at(level: float) -> float | None:
            value = self.alloc_at.get(level)
            return None if value is None else round(100 * value, 2)

        return {
            "policy": self.policy,
            "method": self.method,
            "seed": self.seed,
            "alloc_at_100": at(1.0),
            "alloc_at_110": at(1.1),
            "alloc_at_120": at(1.2),
            "alloc_at_130": at(1.3),
            "failed_pods": self.failed_pods,
            "decision_ms_p50": round(self.percentile_ms(0.50), 3),
            "decision_ms_p99": round(self.percentile_ms(0.99), 3),
        }


def to_record(result: ReplayResult) -> dict[str, Any]:
    """A replay as one JSON object: the JSON keys plus what tables and plots need."""
    return {
        **result.to_json(),
        "capacity_gpus": result.capacity_gpus,
        "pods": result.pods,
        "seconds": round(result.seconds, 2),
        "curve": result.curve,
    }


def from_record(record: dict[str, Any]) -> ReplayResult:
    """The replay `to_record` wrote (latencies as their percentiles only)."""
    return ReplayResult(
        policy=record["policy"],
        seed=record["seed"],
        capacity_gpus=record["capacity_gpus"],
        pods=record["pods"],
        failed_pods=record["failed_pods"],
        alloc_at={
            level: record[f"alloc_at_{round(level * 100)}"] / 100
            for level in CHECKPOINTS
            if record.get(f"alloc_at_{round(level * 100)}") is not None
        },
        curve=[(demand, ratio) for demand, ratio in record["curve"]],
        seconds=record["seconds"],
        recorded_ms={0.5: record["decision_ms_p50"], 0.99: record["decision_ms_p99"]},
        method=record.get("method", "vgpu"),
    )


def least_allocated(core: PlacementCore, request: PodRequest) -> str | None:
    """kube-scheduler's default for a pod without GPUs: most CPU and memory share left."""
    best: tuple[float, str] | None = None
    for node in core.cluster.states():
        if host_problem(node, request) is not None:
            continue
        left = _share_left(node.cpu_milli, node.used_cpu_milli + request.cpu_milli)
        left += _share_left(node.host_memory_mib, node.used_memory_mib + request.memory_mib)
        if best is None or (-left, node.name) < best:
            best = (-left, node.name)
    return None if best is None else best[1]


def least_stranded(core: PlacementCore, request: PodRequest) -> str | None:
    """A pod without GPUs where the hostpack policy's host score ranks it best (what the
    extender's prioritize answers: HostPack.cpu_pod_scores, where its CPU strands the fewest
    usable free GPUs, then where those GPUs need the smallest share of the CPU left), then
    as least_allocated. On the node table's columns; the few nodes near the best are scored
    again by cpu_pod_scores itself, so the choice is `_least_stranded_loop`'s (the tests
    compare them)."""
    table = core.cluster.table()
    need_cpu, need_memory = request.cpu_milli, request.memory_mib
    rows = np.flatnonzero(table.may_take(-math.inf, 0, 0, need_cpu, need_memory))
    if not rows.size:
        return None
    usable = table.derived(_USABLE_KEY, _HOST.usable_gpus)[rows]
    total_cpu = table.cpu_milli[rows]
    cpu = total_cpu - table.used_cpu_milli[rows]
    growth = _HOST.stranded_many(usable, cpu - need_cpu) - _HOST.stranded_many(usable, cpu)
    after = cpu - need_cpu
    need = usable * _HOST.cpu_per_gpu_milli
    share = np.where(
        usable == 0, 0.0, np.where(after <= need, 1.0, need / np.where(after > 0, after, 1))
    )
    score = -_HOST.weight * np.round(growth, 9) - _HOST.reserve_weight * share
    score = np.where((total_cpu == 0) | (table.gpu_count[rows] == 0), 0.0, score)
    # numpy's rounding is not Python's to the last bit: cpu_pod_scores decides near the best.
    near = rows[score >= float(score.max()) - 1e-7]
    candidates = [table.nodes[int(row)] for row in near]
    exact = _HOST.cpu_pod_scores(request, candidates)
    best: tuple[float, float, str] | None = None
    for node in candidates:
        left = _share_left(node.cpu_milli, node.used_cpu_milli + need_cpu)
        left += _share_left(node.host_memory_mib, node.used_memory_mib + need_memory)
        key = (-exact[node.name], -left, node.name)
        if best is None or key < best:
            best = key
    return None if best is None else best[2]


def _least_stranded_loop(core: PlacementCore, request: PodRequest) -> str | None:
    """least_stranded one node at a time: the reference the column version must match."""
    fitting = [node for node in core.cluster.states() if host_problem(node, request) is None]
    scores = _HOST.cpu_pod_scores(request, fitting)
    best: tuple[float, float, str] | None = None
    for node in fitting:
        left = _share_left(node.cpu_milli, node.used_cpu_milli + request.cpu_milli)
        left += _share_left(node.host_memory_mib, node.used_memory_mib + request.memory_mib)
        key = (-scores[node.name], -left, node.name)
        if best is None or key < best:
            best = key
    return None if best is None else best[2]


def _share_left(capacity: int, used: int) -> float:
    return (capacity - used) / capacity if capacity else 1.0


CPU_POD_PLACERS: dict[str, Callable[[PlacementCore, PodRequest], str | None]] = {
    "least-stranded": least_stranded,
    "least-allocated": least_allocated,
}


def _place(core: PlacementCore, pod: TracePod, uid: str, cpu_pods: CpuPlacer) -> bool:
    request = core.parse(manifest(pod, uid))
    if not request.containers:
        # The core leaves host needs of CPU-only pods to kube-scheduler: state them here.
        request = dataclasses.replace(request, cpu_milli=pod.cpu_milli, memory_mib=pod.memory_mib)
        node = cpu_pods(core, request)
    else:
        core.observe(request)
        node = core.best_node(request)
    if node is None:
        return False
    core.commit(PodRef(NAMESPACE, pod.name, uid), node, request)
    return True


class CurveRecorder:
    """Samples a replay's allocation ratio as demand grows: every CURVE_STEP for the curve,
    and at each checkpoint level for the table."""

    def __init__(self, result: ReplayResult, levels: Sequence[float] = CHECKPOINTS) -> None:
        self._result = result
        self._next_point = CURVE_STEP
        self.pending = list(levels)  # checkpoint levels not reached yet, ascending

    def record(self, demand: float, ratio: float) -> None:
        while demand + 1e-12 >= self._next_point:
            self._result.curve.append((round(self._next_point, 4), ratio))
            self._next_point += CURVE_STEP
        while self.pending and demand + 1e-12 >= self.pending[0]:
            self._result.alloc_at[self.pending.pop(0)] = ratio


def replay(
    nodes: Sequence[TraceNode],
    sequence: Sequence[TracePod],
    policy: str = DEFAULT_POLICY,
    seed: int = 0,
    *,
    split_count: int = 10,
    cpu_pods: str = "least-stranded",
    progress: Callable[[int, int], None] | None = None,
) -> ReplayResult:
    """Place `sequence` in order (pods never leave); allocation ratio as demand grows."""
    placer = CPU_POD_PLACERS[cpu_pods]
    core = build_core(nodes, policy, seed, split_count)
    gc.collect()
    gc.freeze()  # the cluster is long-lived: keep it out of the collector's full passes
    capacity = sum(node.gpus for node in nodes)
    if not capacity:
        raise ValueError("the node list has no GPUs")
    result = ReplayResult(policy=policy, seed=seed, capacity_gpus=capacity)
    asked = allocated = 0.0
    curve = CurveRecorder(result)
    started = time.perf_counter()
    timer, cpu_timer = time.perf_counter, time.thread_time
    for number, pod in enumerate(sequence):
        begin, cpu_begin = timer(), cpu_timer()
        placed = _place(core, pod, f"u{number}", placer)
        if pod.num_gpu:
            result.decision_ms.append((timer() - begin) * 1000)
            result.decision_cpu_ms.append((cpu_timer() - cpu_begin) * 1000)
        if placed:
            allocated += pod.gpu_demand
        else:
            result.failed_pods += 1
        asked += pod.gpu_demand
        curve.record(asked / capacity, allocated / capacity)
        if progress is not None:
            progress(number + 1, len(sequence))
    result.pods = len(sequence)
    result.seconds = time.perf_counter() - started
    return result


def mean_results(results: Sequence[ReplayResult]) -> dict[str, Any]:
    """The JSON keys averaged over seeds (seed becomes the list of seeds)."""
    rows = [r.to_json() for r in results]
    merged: dict[str, Any] = {
        "policy": rows[0]["policy"], "method": rows[0]["method"], "seed": [r["seed"] for r in rows],
    }  # fmt: skip
    for key in rows[0]:
        if key in ("policy", "method", "seed"):
            continue
        values = [r[key] for r in rows if r[key] is not None]
        merged[key] = round(sum(values) / len(values), 3) if len(values) == len(rows) else None
    return merged
