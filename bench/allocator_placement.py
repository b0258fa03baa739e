"""Replay the openb trace through the placement engine and compare policies.

Alibaba's openb GPU-sharing trace (cluster-trace-gpu-v2023), published with Weng et al.,
"Beware of Fragmentation: Scheduling GPU-Sharing Workloads with Fragmentation Gradient
Descent", USENIX ATC'23. As in the paper: every GPU node of openb_node_list_gpu_node.csv is a
candidate; the GPU pods of openb_pod_list_default.csv are shuffled with a fixed seed and more
are drawn at random from the file until the GPU demand reaches 130% of the cluster's GPU
capacity; pods arrive one at a time and never leave. Each pod goes through the same
PlacementCore the extender uses (filter every node, prioritize, pick the best, commit). The
figure is the GPU allocation ratio (allocated GPU share / capacity) at 100% and 130% demand.

    .venv/bin/python -m bench.allocator_placement [--seeds 3] [--policies fgd,binpack]

Differences from the paper's simulator: CPU-only pods are left out (the extender never sees
them) and CPU/memory of GPU pods are honoured through the nodes' capacity hints; FGD learns
the request mix online from the pods it has seen (a sliding window), not from the whole file.
"""

from __future__ import annotations

import argparse
import csv
import random
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.report import write_section
from services.allocator.cluster import ClusterState
from services.allocator.core import PlacementCore, PodRef
from services.allocator.fragmentation import WorkloadMix
from services.allocator.ledger import Ledger
from services.allocator.pod_request import PodRequest
from services.allocator.policies import POLICIES, Policy, ScoreContext, Trial, relative_scores
from services.common.schemas import GpuDevice, NodeInventory
from services.simulate.trace import OPENB_MODEL_MEMORY_MIB

TRACE = Path(__file__).resolve().parents[2] / "shared" / "traces" / "openb"
MODEL_MIB = OPENB_MODEL_MEMORY_MIB


class RandomPolicy:
    """Baseline: any GPU set, any node (the paper's Random). Also shows the plug-in API."""

    name = "random"

    def __init__(self, seed: int) -> None:
        self._random = random.Random(seed)

    def gpu_score(self, ctx: ScoreContext, trial: Trial, gpus: Sequence[Any], adds: Any) -> float:
        return self._random.random()

    def node_score(self, ctx: ScoreContext, trial: Trial, pod: PodRequest) -> float:
        return self._random.random()

    def to_scores(self, raw: Mapping[str, float]) -> dict[str, int]:
        return relative_scores(raw)


@dataclass(frozen=True)
class TracePod:
    name: str
    cpu_milli: int
    memory_mib: int
    gpus: int
    milli: int  # share of one GPU when gpus == 1

    @property
    def gpu_share(self) -> float:
        return self.gpus * self.milli / 1000

    def manifest(self, uid: str) -> dict[str, Any]:
        if self.milli < 1000:
            share = self.milli // 10
            limits = {
                "nvidia.com/gpu": "1",
                "nvidia.com/gpumem-percentage": str(share),
                "nvidia.com/gpucores": str(share),
            }
        else:
            limits = {"nvidia.com/gpu": str(self.gpus)}
        requests = {"cpu": f"{self.cpu_milli}m", "memory": f"{self.memory_mib}Mi", **limits}
        return {
            "metadata": {"name": self.name, "namespace": "openb", "uid": uid},
            "spec": {
                "containers": [
                    {"name": "main", "resources": {"limits": limits, "requests": requests}}
                ]
            },
        }


def load_nodes(path: Path) -> list[NodeInventory]:
    nodes = []
    with path.open() as f:
        for row in csv.DictReader(f):
            count, model = int(row["gpu"]), row["model"]
            nodes.append(
                NodeInventory(
                    node=row["sn"],
                    gpus=[
                        GpuDevice(
                            uuid=f"{row['sn']}-gpu{i}",
                            index=i,
                            model=model,
                            memory_mib=MODEL_MIB[model],
                            numa_node=i * 2 // count,
                        )
                        for i in range(count)
                    ],
                    cpu_milli=int(row["cpu_milli"]),
                    host_memory_mib=int(row["memory_mib"]),
                )
            )
    return nodes


def load_pods(path: Path) -> list[TracePod]:
    pods = []
    with path.open() as f:
        for row in csv.DictReader(f):
            gpus = int(row["num_gpu"])
            if gpus == 0:
                continue
            pods.append(
                TracePod(
                    name=row["name"],
                    cpu_milli=int(row["cpu_milli"]),
                    memory_mib=int(row["memory_mib"]),
                    gpus=gpus,
                    milli=int(row["gpu_milli"]) if gpus == 1 else 1000,
                )
            )
    return pods


def make_core(nodes: list[NodeInventory], policy: str, seed: int) -> PlacementCore:
    cluster = ClusterState(node_timeout_s=1e9)
    for inventory in nodes:
        cluster.update(inventory)
    policies: dict[str, Policy] = {**POLICIES, "random": RandomPolicy(seed)}
    return PlacementCore(
        cluster, Ledger(cluster), node_policy=policy, gpu_policy=policy, policies=policies,
        mix=WorkloadMix(window=2000),
    )  # fmt: skip


def replay(
    nodes: list[NodeInventory], pods: list[TracePod], policy: str, seed: int
) -> dict[str, float]:
    """Allocation ratios at 100% and 130% demand for one policy and one seed."""
    capacity = sum(len(n.gpus) for n in nodes)
    core = make_core(nodes, policy, seed)
    rng = random.Random(seed)
    order = pods[:]
    rng.shuffle(order)
    demand = allocated = 0.0
    ratios: dict[str, float] = {}
    arrived = 0
    started = time.perf_counter()
    while demand < 1.3 * capacity:
        pod = order[arrived] if arrived < len(order) else rng.choice(pods)
        arrived += 1
        request = core.parse(pod.manifest(f"u{arrived}"))
        core.observe(request)
        node = core.best_node(request)
        if node is not None:
            core.commit(PodRef("openb", pod.name, f"u{arrived}"), node, request)
            allocated += pod.gpu_share
        demand += pod.gpu_share
        if "100%" not in ratios and demand >= capacity:
            ratios["100%"] = allocated / capacity
    ratios["130%"] = allocated / capacity
    ratios["pods"] = arrived
    ratios["seconds"] = time.perf_counter() - started
    return ratios


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--policies", default="random,spread,binpack,topology,fgd")
    parser.add_argument("--trace", type=Path, default=TRACE)
    parser.add_argument("--no-write", action="store_true", help="print only")
    args = parser.parse_args(argv)
    node_file = args.trace / "openb_node_list_gpu_node.csv"
    pod_file = args.trace / "openb_pod_list_default.csv"
    if not node_file.exists() or not pod_file.exists():
        print(f"trace not found under {args.trace}", file=sys.stderr)
        return 1
    nodes, pods = load_nodes(node_file), load_pods(pod_file)
    capacity = sum(len(n.gpus) for n in nodes)
    print(f"{len(nodes)} GPU nodes, {capacity} GPUs; {len(pods)} GPU pods in the default file")
    rows = []
    for policy in args.policies.split(","):
        runs = [replay(nodes, pods, policy, seed) for seed in range(args.seeds)]
        mean = {k: sum(r[k] for r in runs) / len(runs) for k in ("100%", "130%", "seconds")}
        rows.append((policy, mean))
        print(
            f"{policy:<9} allocation ratio at 100% demand {mean['100%']:.2%}, at 130% "
            f"{mean['130%']:.2%}  ({mean['seconds']:.1f} s per replay)",
            flush=True,
        )
    best = max(rows, key=lambda row: row[1]["100%"])[0]
    table = "\n".join(
        f"| {p} | {m['100%']:.2%} | {m['130%']:.2%} | {m['seconds']:.1f} |" for p, m in rows
    )
    markdown = f"""### Placement policies on the openb trace

`.venv/bin/python -m bench.allocator_placement --seeds {args.seeds}`: the GPU pods of
`openb_pod_list_default.csv` onto the {len(nodes)} nodes / {capacity} GPUs of
`openb_node_list_gpu_node.csv` (Alibaba cluster-trace-gpu-v2023, Weng et al., USENIX ATC'23),
shuffled with seeds 0..{args.seeds - 1} and drawn until demand reaches 130% of capacity;
each pod through `PlacementCore.best_node` + `commit`. GPU allocation ratio, mean of the seeds:

| policy (node and GPU level) | at 100% demand | at 130% demand | s per replay |
|---|---|---|---|
{table}

Best at 100% demand: **{best}** (the allocator's default). The paper reports, at 130% demand
with its own simulator (CPU-only pods included, mix known in advance): Random 87.47%,
BestFit 93.08%, FGD 95.39%."""
    if not args.no_write:
        write_section("allocator-placement", markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
