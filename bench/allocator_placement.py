"""The allocator's own placement policies on the openb trace (issue 3's benchmark).

A thin caller of `vgpu simulate` (services/simulate): the default openb pod file onto every
GPU node, the paper's method (shuffle with the seed, draw until 130% demand, pods never
leave), every pod through PlacementCore. For the paper's baselines and every pod file see
bench/simulate_table.py.

    .venv/bin/python -m bench.allocator_placement [--seeds 3] [--policies hostpack,binpack]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from bench.report import write_section
from bench.simulate_table import TRACE
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
    args = parser.parse_args(argv)
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


if __name__ == "__main__":
    sys.exit(main())
