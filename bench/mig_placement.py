"""Dynamic MIG placement cost: the same pods placed on dynamic-MIG GPUs and on plain GPUs.

N nodes of 8 A100-40GB each; pods ask one GPU with memory drawn from MIG-sized requests
(2-36 GiB, seeded). Each pod goes through PlacementCore as the extender uses it
(`best_node` over every node, then `commit`) until the cluster refuses 50 pods in a row.
Reported per mode: pods placed, mean and p99 microseconds per placement, and for MIG the
profiles used. The figures compare placement by MIG geometry with vgpu's memory slices on
the same machine in the same run.

    .venv/bin/python -m bench.mig_placement [--nodes 50] [--seed 0] [--no-write]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections import Counter

from bench.report import write_section
from services.allocator.cluster import CapacityConfig, ClusterState
from services.allocator.core import PlacementCore, PodRef
from services.allocator.ledger import Ledger
from services.common.schemas import GpuDevice, NodeInventory

GPUS_PER_NODE = 8
MEMORY_CHOICES_MIB = (2000, 4000, 4500, 8000, 9000, 12000, 16000, 19000, 30000, 36000)


def inventory(node: str, dynamic: bool) -> NodeInventory:
    gpus = [
        GpuDevice(
            uuid=f"GPU-{node}-{i}",
            index=i,
            model="A100-40GB",
            memory_mib=40960,
            mig_mode=dynamic,
            mig_dynamic=dynamic,
        )
        for i in range(GPUS_PER_NODE)
    ]
    return NodeInventory(node=node, gpus=gpus)


def pod(name: str, memory_mib: int) -> dict[str, object]:
    limits = {"nvidia.com/gpu": "1", "nvidia.com/gpumem": str(memory_mib)}
    return {
        "metadata": {"name": name, "namespace": "bench", "uid": name},
        "spec": {"containers": [{"name": "m", "resources": {"limits": limits}}]},
    }


def run(nodes: int, dynamic: bool, seed: int) -> tuple[int, list[float], Counter[str]]:
    cluster = ClusterState(3600, CapacityConfig(memory_reserve_mib=1024))
    for n in range(nodes):
        cluster.update(inventory(f"n{n}", dynamic))
    core = PlacementCore(cluster, Ledger(cluster))
    rng = random.Random(seed)
    times: list[float] = []
    profiles: Counter[str] = Counter()
    refused = placed = tried = 0
    while refused < 50:
        tried += 1
        spec = pod(f"p{tried}", rng.choice(MEMORY_CHOICES_MIB))
        started = time.perf_counter()
        request = core.parse(spec)
        node = core.best_node(request)
        if node is None:
            refused += 1
            continue
        allocation = core.commit(
            PodRef("bench", spec["metadata"]["name"], spec["metadata"]["uid"]), node, request
        )  # type: ignore[index]
        times.append(time.perf_counter() - started)
        placed += 1
        refused = 0
        for piece in allocation.containers["m"].slices:
            profiles[piece.mig_profile or "vgpu slice"] += 1
    return placed, times, profiles


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--nodes", type=int, default=50)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-write", action="store_true", help="print only")
    args = parser.parse_args(argv)
    rows = []
    for dynamic in (False, True):
        placed, times, profiles = run(args.nodes, dynamic, args.seed)
        micro = sorted(t * 1e6 for t in times)
        p99 = micro[min(len(micro) - 1, int(len(micro) * 0.99))]
        used = ", ".join(f"{name} {count}" for name, count in profiles.most_common())
        rows.append(
            f"| {'dynamic MIG' if dynamic else 'vgpu slices'} | {placed} "
            f"| {statistics.fmean(micro):.0f} | {p99:.0f} | {used} |"
        )
    table = "\n".join(
        [
            f"{args.nodes} nodes x {GPUS_PER_NODE} A100-40GB, seed {args.seed}, placing until "
            "50 pods in a row are refused:",
            "",
            "| GPUs | pods placed | mean us/pod | p99 us/pod | slices |",
            "|---|---|---|---|---|",
            *rows,
        ]
    )
    print(table)
    if not args.no_write:
        write_section(
            "mig-placement",
            "## Allocator: dynamic MIG placement\n\n"
            f"`.venv/bin/python -m bench.mig_placement --nodes {args.nodes} --seed {args.seed}`"
            " (bench/mig_placement.py): each pod through PlacementCore (`best_node` over every "
            "node, then `commit`).\n\n" + table,
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
