"""Issue 14's targets: the default policy through the real scheduler path against the FGD
paper's figures, reproduced with `--method paper`, on the same files and seeds in one run.

Per pod file and seed: `fgd` with --method paper (the paper's own simulator; its published
FGD figure is the bar), the default policy through the scheduler path (`--through-scheduler`:
kube-scheduler emulation -> the allocator's extender over HTTP -> API server), and the
default policy in process (`--method vgpu`).

    .venv/bin/python -m bench.simulate_paths [--files default|all|a,b,...] [--seeds 1]
        [--first-seed 0] [--nodes 120] [--workers 1] [--methods paper,vgpu,through-scheduler]
        [--raw FILE] [--reuse FILE] [--no-write] [--trace ../shared/traces/openb]

--nodes N keeps the first N nodes of the node list (0 = all 1,213); the default run (120
nodes, one seed) takes about a minute. Every finished replay is appended to --raw (JSON
lines) and the table is rewritten, so an interrupted run keeps what it finished: run the
same command again with --reuse set to the --raw file and only the missing replays run.

Its own sections of docs/benchmarks.md: `simulate-paths-files` for the whole cluster,
`simulate-paths-small` for --nodes N (the hand-written `simulate-paths` section, with the
default file's 10-seed table, is never touched).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from bench.report import write_section
from bench.simulate_table import FILES
from services.allocator.core import DEFAULT_POLICY
from services.simulate.replay import ReplayResult, from_record, mean_results, to_record
from services.simulate.runner import Job, run_jobs
from services.simulate.trace import read_nodes

TRACE = Path(__file__).resolve().parents[2] / "shared" / "traces" / "openb"
NODE_LIST = "openb_node_list_gpu_node.csv"
# The paper's FGD at 130% demand, from its artifact (default file: the paper's Figure 7).
PAPER_FGD_130 = {"default": 95.39}
METHODS = {"paper": "fgd", "vgpu": DEFAULT_POLICY, "through-scheduler": DEFAULT_POLICY}
THROUGH = "through-scheduler"
Key = tuple[str, str, int]  # pod file, method, seed


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


def _earlier(path: Path, nodes: int) -> dict[Key, ReplayResult]:
    """Replays a --raw file holds for this cluster size, by (file, method, seed)."""
    found: dict[Key, ReplayResult] = {}
    if not path.exists():
        return found
    for line in path.read_text().splitlines():
        record = json.loads(line)
        if record.get("nodes") == nodes and record.get("policy") == METHODS.get(
            record.get("method", "")
        ):
            found[(record["file"], record["method"], record["seed"])] = from_record(record)
    return found


def _rows(files: Sequence[str], methods: Sequence[str], done: dict[Key, ReplayResult],
          full: bool) -> tuple[list[str], list[str]]:  # fmt: skip
    """The per-method rows and, per file, through the scheduler against the others."""
    rows, versus = [], []
    for file in files:
        means: dict[str, dict[str, object]] = {}
        for method in methods:
            runs = [r for (f, m, _), r in sorted(done.items()) if f == file and m == method]
            if not runs:
                continue
            merged = means[method] = mean_results(runs)
            published = PAPER_FGD_130.get(file, "-") if full and method == "paper" else ""
            seeds = ",".join(str(s) for s in merged["seed"])
            mean_seconds = sum(r.seconds for r in runs) / len(runs)
            rows.append(
                f"| {file} | {method} | {METHODS[method]} | {seeds} | "
                f"{_cell(merged['alloc_at_100'])} | {_cell(merged['alloc_at_130'])} | "
                f"{published} | {merged['failed_pods']:.0f} | {merged['decision_ms_p50']:.2f} | "
                f"{merged['decision_ms_p99']:.2f} | {mean_seconds:.0f} |"
            )
        through = means.get(THROUGH)
        if through is None or through["alloc_at_130"] is None:
            continue
        cells = []
        for other in ("paper", "vgpu"):
            theirs = means.get(other)
            same = theirs is not None and theirs["seed"] == through["seed"]
            value = theirs["alloc_at_130"] if same and theirs else None
            cells.append("-" if value is None else f"{through['alloc_at_130'] - value:+.2f}")
        seeds = [r for (f, m, _), r in sorted(done.items()) if f == file and m == THROUGH]
        low = min(r.alloc_at[1.3] for r in seeds if 1.3 in r.alloc_at) * 100
        versus.append(f"| {file} | {_cell(through['alloc_at_130'])} | {low:.2f} | "
                      f"{' | '.join(cells)} |")  # fmt: skip
    return rows, versus


def _markdown(command: str, scope: str, rows: list[str], versus: list[str], missing: int) -> str:
    table = "\n".join(
        [
            "| pod file | method | policy | seeds | @100% | @130% | paper's FGD @130% | "
            "failed pods | p50 ms | p99 ms | s per replay |",
            "|---|---|---|---|---|---|---|---|---|---|---|",
            *rows,
        ]
    )
    comparison = ""
    if versus:
        comparison = (
            "\n\nThrough the scheduler against the others at 130% (mean of the same seeds; "
            "lowest seed through the scheduler beside it):\n\n"
            "| pod file | through @130% | lowest seed | minus paper's fgd | minus in process |\n"
            "|---|---|---|---|---|\n" + "\n".join(versus)
        )
    pending = f"\n\n{missing} replay(s) of the command not done yet." if missing else ""
    return (
        "### Every pod file through the scheduler path (issue 14)\n\n"
        f"`{command}` on {scope} of `openb_node_list_gpu_node.csv`, 130% demand, "
        "written as replays finish. `paper`: the FGD paper's simulator with its `fgd`; `vgpu`: "
        f"{DEFAULT_POLICY} in process; `{THROUGH}`: {DEFAULT_POLICY} through the "
        "kube-scheduler emulation, the allocator's extender over HTTP and the API server. "
        "Latency: in process the decision; through the scheduler the extender's filter + "
        "prioritize round trips as the emulation sees them (HTTP and JSON included, one "
        "process for allocator, API server and scheduler).\n\n" + table + comparison + pending
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--files", default="default", help="comma-separated, or 'all'")
    parser.add_argument("--seeds", type=int, default=1)
    parser.add_argument("--first-seed", type=int, default=0)
    parser.add_argument("--nodes", type=int, default=120)
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--skip-through", action="store_true", help="the same as leaving "
                        f"{THROUGH} out of --methods")  # fmt: skip
    parser.add_argument("--raw", type=Path, default=Path("/tmp/vgpu-simulate-paths.jsonl"))
    parser.add_argument("--reuse", type=Path, help="a --raw file: its replays are not run again")
    parser.add_argument("--no-write", action="store_true", help="print only")
    parser.add_argument("--table-only", action="store_true", help="replay nothing: the table "
                        "of what --reuse holds, the rest counted as not done")  # fmt: skip
    parser.add_argument("--trace", type=Path, default=TRACE, help="the openb trace folder")
    args = parser.parse_args(argv)
    files = list(FILES) if args.files == "all" else [
        f.strip() for f in args.files.split(",") if f.strip()
    ]  # fmt: skip
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    unknown = [m for m in methods if m not in METHODS] + [
        f for f in files if not (args.trace / f"openb_pod_list_{f}.csv").exists()
    ]
    if unknown:
        parser.error(f"unknown method or pod file: {', '.join(unknown)}")
    if args.skip_through and THROUGH in methods:
        methods.remove(THROUGH)
    seeds = range(args.first_seed, args.first_seed + args.seeds)
    done = _earlier(args.reuse, args.nodes) if args.reuse else {}
    scope = "all 1,213 nodes" if not args.nodes else f"the first {args.nodes} nodes"
    command = " ".join(["python -m bench.simulate_paths", *(argv or sys.argv[1:])])
    section = "simulate-paths-small" if args.nodes else "simulate-paths-files"
    wanted = [(f, m, s) for f in files for m in methods for s in seeds]
    raw = args.raw.open("a")
    started = time.monotonic()

    def write() -> str:
        shown = {key: result for key, result in done.items() if key in wanted}
        rows, versus = _rows(files, methods, shown, full=not args.nodes)
        markdown = _markdown(command, scope, rows, versus, len(wanted) - len(shown))
        if not args.no_write:
            write_section(section, markdown)
        return markdown

    with tempfile.TemporaryDirectory() as tmp:
        nodes = _subset(args.trace, args.nodes, Path(tmp))
        todo = [] if args.table_only else [key for key in wanted if key not in done]
        # The slow through-scheduler replays first, so the workers are busy to the end.
        todo.sort(key=lambda key: key[1] != THROUGH)
        jobs = [
            Job(nodes, args.trace / f"openb_pod_list_{f}.csv", METHODS[m], s, method=m)
            for f, m, s in todo
        ]
        keys = dict(zip(map(id, jobs), todo, strict=True))

        def finished(job: Job, result: ReplayResult) -> None:
            key = keys[id(job)]
            done[key] = result
            record = {"file": key[0], "nodes": args.nodes, **to_record(result)}
            raw.write(json.dumps(record) + "\n")
            raw.flush()
            os.fsync(raw.fileno())
            print(
                f"{key[0]} {key[1]} seed {key[2]}: {result.to_json()['alloc_at_130']}% at 130%, "
                f"{result.failed_pods} failed, {result.seconds:.0f}s "
                f"({time.monotonic() - started:.0f}s into the run)",
                file=sys.stderr,
                flush=True,
            )
            write()

        run_jobs(jobs, workers=args.workers, on_done=finished, ordered=False)
    print(write())
    return 0


if __name__ == "__main__":
    sys.exit(main())
