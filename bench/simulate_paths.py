"""Issue 14's targets: the default policy through the real scheduler path against the FGD
paper's figures, reproduced with `--method paper`, on the same files and seeds in one run.

Per pod file: `fgd` with --method paper (the paper's own simulator; its published FGD
figure is the bar), the default policy through the scheduler path (`--through-scheduler`:
kube-scheduler emulation -> the allocator's extender over HTTP -> API server), and the
default policy in process (`--method vgpu`). Rewrites its section of docs/benchmarks.md.

    .venv/bin/python -m bench.simulate_paths [--files default] [--seeds 1] [--nodes 120]
        [--workers 1] [--skip-through] [--trace ../shared/traces/openb]

--nodes N keeps the first N nodes of the node list (0 = all 1,213); the default run (120
nodes, one seed) takes about two minutes; a full-size through-scheduler replay takes many
minutes per seed on a 2-core machine.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from bench.report import write_section
from services.allocator.core import DEFAULT_POLICY
from services.simulate.replay import ReplayResult, mean_results
from services.simulate.runner import Job, run_jobs
from services.simulate.trace import read_nodes

TRACE = Path(__file__).resolve().parents[2] / "shared" / "traces" / "openb"
NODE_LIST = "openb_node_list_gpu_node.csv"
# The paper's FGD at 130% demand, from its artifact (default file: the paper's Figure 7).
PAPER_FGD_130 = {"default": 95.39}


def _subset(trace: Path, nodes: int, workdir: Path) -> Path:
    if not nodes:
        return trace / NODE_LIST
    lines = (trace / NODE_LIST).read_text().splitlines()
    path = workdir / f"nodes-{nodes}.csv"
    path.write_text("\n".join(lines[: nodes + 1]) + "\n")
    read_nodes(path)  # fail early on a bad cut
    return path


def _cell(value: object) -> str:
    return "-" if value is None else f"{value:.2f}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--files", default="default")
    parser.add_argument("--seeds", type=int, default=1)
    parser.add_argument("--nodes", type=int, default=120)
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--skip-through", action="store_true")
    parser.add_argument("--trace", type=Path, default=TRACE, help="the openb trace folder")
    args = parser.parse_args(argv)
    files = [f.strip() for f in args.files.split(",") if f.strip()]
    methods = [("paper", "fgd"), ("vgpu", DEFAULT_POLICY)]
    if not args.skip_through:
        methods.append(("through-scheduler", DEFAULT_POLICY))
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        nodes = _subset(args.trace, args.nodes, Path(tmp))
        for file in files:
            pods = args.trace / f"openb_pod_list_{file}.csv"
            results: dict[tuple[str, str], list[ReplayResult]] = {}
            jobs = [
                Job(nodes, pods, policy, seed, method=method)
                for method, policy in methods
                for seed in range(args.seeds)
            ]
            for job, result in zip(jobs, run_jobs(jobs, workers=args.workers), strict=True):
                results.setdefault((job.method, job.policy), []).append(result)
                print(
                    f"{file} {job.method} {job.policy} seed {job.seed}: "
                    f"{result.to_json()['alloc_at_130']}% in {result.seconds:.0f}s",
                    file=sys.stderr,
                )
            # The published figure is for the whole cluster only.
            published = PAPER_FGD_130.get(file, "-") if not args.nodes else "-"
            for (method, policy), runs in results.items():
                merged = mean_results(runs)
                rows.append(
                    f"| {file} | {method} | {policy} | {len(runs)} | "
                    f"{_cell(merged['alloc_at_100'])} | {_cell(merged['alloc_at_130'])} | "
                    f"{published if method == 'paper' else ''} | "
                    f"{merged['decision_ms_p50']:.2f} | {merged['decision_ms_p99']:.2f} | "
                    f"{sum(r.seconds for r in runs) / len(runs):.0f} |"
                )
    scope = "all 1,213 nodes" if not args.nodes else f"the first {args.nodes} nodes"
    command = " ".join(["python -m bench.simulate_paths", *(argv or sys.argv[1:])])
    table = "\n".join(
        [
            "| pod file | method | policy | seeds | @100% | @130% | paper's FGD @130% | "
            "p50 ms | p99 ms | s per replay |",
            "|---|---|---|---|---|---|---|---|---|---|",
            *rows,
        ]
    )
    markdown = (
        "### Placement through the scheduler path against the paper's FGD (issue 14)\n\n"
        f"`{command}` on {scope} of `openb_node_list_gpu_node.csv`, seeds 0-{args.seeds - 1}, "
        "130% demand. Latency: for `paper` and `vgpu` the in-process decision; for "
        "`through-scheduler` the extender's filter + prioritize round trips as the "
        "scheduler emulation sees them (HTTP and JSON included, same process as the "
        "allocator).\n\n" + table
    )
    print(markdown)
    write_section("simulate-paths", markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
