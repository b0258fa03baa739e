"""The allocator's own placement policies on the openb trace (issue 3's benchmark).

A thin caller of `vgpu simulate` (services/simulate): the default openb pod file onto every
GPU node, the paper's method (shuffle with the seed, draw until 130% demand, pods never
leave), every pod through PlacementCore. For the paper's baselines and every pod file see
bench/simulate_table.py.

    .venv/bin/python -m bench.allocator_placement [--seeds 3] [--policies hostpack,binpack]

With --every-pod-file: the decision latency of the default policy on every openb pod file
(issue 14's target: p99 at most 5 ms at 1,213 nodes), wall time and the deciding thread's
CPU time, in its own section.

    .venv/bin/python -m bench.allocator_placement --every-pod-file [--seeds 1]
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from bench.report import write_section
from bench.simulate_table import FILES, TRACE
from services.allocator.core import DEFAULT_POLICY
from services.allocator.policies import POLICIES
from services.simulate.replay import mean_results
from services.simulate.runner import Job, run_jobs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--policies", default=",".join(POLICIES))
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--trace", type=Path, default=TRACE)
    parser.add_argument("--no-write", action="store_true", help="print only")
    parser.add_argument(
        "--every-pod-file", action="store_true", help="decision latency on every pod file"
    )
    args = parser.parse_args(argv)
    if args.every_pod_file:
        return every_pod_file(args.trace, args.seeds, args.workers, not args.no_write)
    nodes = args.trace / "openb_node_list_gpu_node.csv"
    pods = args.trace / "openb_pod_list_default.csv"
    if not nodes.exists() or not pods.exists():
        print(f"trace not found under {args.trace}", file=sys.stderr)
        return 1
    policies = args.policies.split(",")
    jobs = [Job(nodes, pods, policy, seed) for policy in policies for seed in range(args.seeds)]
    results = run_jobs(jobs, workers=args.workers)
    rows = []
    for policy in policies:
        mine = [r for r in results if r.policy == policy]
        mean = mean_results(mine)
        seconds = sum(r.seconds for r in mine) / len(mine)
        default = " **(default)**" if policy == DEFAULT_POLICY else ""
        rows.append(
            f"| {policy}{default} | {mean['alloc_at_100']:.2f} | {mean['alloc_at_130']:.2f} | "
            f"{mean['decision_ms_p50']:.2f} | {mean['decision_ms_p99']:.2f} | {seconds:.1f} |"
        )
        print(rows[-1], flush=True)
    markdown = f"""### The allocator's placement policies on the openb trace

`.venv/bin/python -m bench.allocator_placement --seeds {args.seeds}`: `vgpu simulate` of
`openb_pod_list_default.csv` on every node of `openb_node_list_gpu_node.csv`, seeds
0..{args.seeds - 1}, mean of the seeds (method and baselines: the `simulate` section below
and docs/simulate.md). Two replays at once on this 2-core machine.

| policy (node and GPU level) | alloc % at 100% demand | at 130% | p50 ms | p99 ms | s per replay |
|---|---|---|---|---|---|
{chr(10).join(rows)}"""
    if not args.no_write:
        write_section("allocator-placement", markdown)
    return 0


def every_pod_file(trace: Path, seeds: int, workers: int, write: bool) -> int:
    nodes = trace / "openb_node_list_gpu_node.csv"
    files = [f for f in FILES if (trace / f"openb_pod_list_{f}.csv").exists()]
    if not nodes.exists() or not files:
        print(f"trace not found under {trace}", file=sys.stderr)
        return 1
    jobs = [
        Job(nodes, trace / f"openb_pod_list_{name}.csv", DEFAULT_POLICY, seed)
        for name in files
        for seed in range(seeds)
    ]
    load_before = os.getloadavg()[0]
    results = run_jobs(jobs, workers=workers)
    load = f"{min(load_before, os.getloadavg()[0]):.1f}-{max(load_before, os.getloadavg()[0]):.1f}"
    rows = []
    for index, name in enumerate(files):
        mine = results[index * seeds : (index + 1) * seeds]
        worst = {  # the worst seed of each figure
            "p50": max(r.percentile_ms(0.5) for r in mine),
            "p99": max(r.percentile_ms(0.99) for r in mine),
            "cpu50": max(r.cpu_percentile_ms(0.5) for r in mine),
            "cpu99": max(r.cpu_percentile_ms(0.99) for r in mine),
        }
        decisions = sum(len(r.decision_ms) for r in mine)
        seconds = sum(r.seconds for r in mine) / len(mine)
        rows.append(
            f"| {name} | {decisions} | {worst['p50']:.2f} | {worst['p99']:.2f} | "
            f"{worst['cpu50']:.2f} | {worst['cpu99']:.2f} | {seconds:.1f} |"
        )
        print(rows[-1], flush=True)
    markdown = f"""### Placement decision latency on every openb pod file

`.venv/bin/python -m bench.allocator_placement --every-pod-file --seeds {seeds} --workers
{workers}`: `vgpu simulate` of each pod file on every node of `openb_node_list_gpu_node.csv`
(1,213 nodes, 6,212 GPUs), default policy ({DEFAULT_POLICY}), seeds 0..{seeds - 1}, {workers}
replay(s) at once. A decision is one GPU pod through parse, observe, `best_node` over every
node and `commit`.
Wall time is what the decision took; CPU time is the deciding thread's own
(`time.thread_time`), which is what wall time would be on an idle machine: on this shared
2-core VM other processes' turns land inside some decisions and inflate the wall-time tail
(1-minute load average {load} at the start and end of this run). The worst seed of each
figure; ms. Target (issue 14): p99 at most 5 ms.

| pod file | decisions | wall p50 | wall p99 | CPU p50 | CPU p99 | s per replay |
|---|---|---|---|---|---|---|
{chr(10).join(rows)}"""
    if write:
        write_section("allocator-placement-latency", markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
