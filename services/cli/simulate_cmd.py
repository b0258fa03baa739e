"""`vgpu simulate`: replay a cluster trace through the placement engine, compare policies."""

from __future__ import annotations

from pathlib import Path

import click

from services.allocator.core import DEFAULT_POLICY
from services.allocator.policies import POLICIES as ENGINE_POLICIES
from services.simulate.replay import CPU_POD_PLACERS, policy_names
from services.simulate.trace import TraceError, read_nodes, read_pods
from services.simulate.workload import gpu_capacity

FILE = click.Path(exists=True, dir_okay=False, path_type=Path)


@click.command("simulate")
@click.option(
    "--nodes",
    "nodes_file",
    type=FILE,
    required=True,
    help="Node list: openb CSV or vgpu YAML (.yaml/.yml).",
)
@click.option(
    "--pods",
    "pods_file",
    type=FILE,
    required=True,
    help="Pod list: openb CSV or vgpu YAML (.yaml/.yml).",
)
@click.option(
    "--policy",
    "policies",
    multiple=True,
    metavar="NAME",
    help=f"Policy to replay (repeatable; default: all). Default policy: {DEFAULT_POLICY}.",
)
@click.option("--seed", default=0, show_default=True, help="Shuffle / draw seed.")
@click.option(
    "--demand",
    default=1.3,
    show_default=True,
    help="Stop when GPU demand reaches this multiple of the GPU capacity.",
)
@click.option(
    "--cpu-pods",
    type=click.Choice(sorted(CPU_POD_PLACERS)),
    default="least-stranded",
    show_default=True,
    help="Where pods without GPUs go (kube-scheduler's part).",
)
@click.option(
    "--method",
    type=click.Choice(["vgpu", "paper"]),
    default="vgpu",
    show_default=True,
    help="vgpu: GPU pods through vgpu's placement engine, CPU-only pods by --cpu-pods; paper: "
    "the FGD paper's simulator "
    "(its resource model, workload sampling and baselines, each placing CPU-only pods too).",
)
@click.option(
    "--through-scheduler",
    is_flag=True,
    help="Replay through the real services: a kube-scheduler emulation (default profile, the "
    "deploy config's extenders) calling the allocator's extender over HTTP in Kubernetes mode "
    "against the in-process API server, inventories over a real nats-server. Slow: minutes "
    f"per replay at 1,213 nodes. Policies: the engine's (default {DEFAULT_POLICY}).",
)
@click.option(
    "--scheduler-config",
    type=FILE,
    default=None,
    help="With --through-scheduler: the KubeSchedulerConfiguration to emulate (its extenders, "
    "weights, managedResources, percentageOfNodesToScore). Default: deploy/k8s's.",
)
@click.option("--jobs", default=1, show_default=True, help="Policies replayed in parallel.")
@click.option("--json", "as_json", is_flag=True, help="One JSON object per policy.")
@click.option(
    "--plot",
    "plot_file",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="Write allocation ratio vs demand (PNG).",
)
def simulate(
    nodes_file: Path, pods_file: Path, policies: tuple[str, ...], seed: int, demand: float,
    cpu_pods: str, method: str, through_scheduler: bool, scheduler_config: Path | None,
    jobs: int, as_json: bool, plot_file: Path | None,
) -> None:  # fmt: skip
    """Replay a trace (the ATC'23 FGD paper's method) and report GPU allocation per policy."""
    from services.simulate import paper, through
    from services.simulate.report import PlotUnavailable, json_lines, plot, require_plotting, table
    from services.simulate.runner import Job, ProgressBar, run_job, run_jobs

    if through_scheduler:
        if method != "vgpu":
            raise click.BadParameter(
                "--through-scheduler replays vgpu's own path; it cannot be combined with "
                f"--method {method}",
                param_hint="--method",
            )
        method = through.METHOD
    elif scheduler_config is not None:
        raise click.BadParameter("only with --through-scheduler", param_hint="--scheduler-config")
    if method == paper.METHOD:
        known = list(paper.POLICIES)
    elif method == through.METHOD:
        known = sorted(ENGINE_POLICIES)
    else:
        known = policy_names()
    unknown = [p for p in policies if p not in known]
    if unknown:
        raise click.BadParameter(
            f"unknown policy {', '.join(unknown)} for --method {method} "
            f"(known: {', '.join(known)})",
            param_hint="--policy",
        )
    if not demand > 0:
        raise click.BadParameter(f"must be positive, got {demand}", param_hint="--demand")
    if plot_file is not None:
        try:
            require_plotting()
        except PlotUnavailable as exc:
            raise click.ClickException(str(exc)) from exc
    try:
        nodes, pods = read_nodes(nodes_file), read_pods(pods_file)
    except TraceError as exc:
        raise click.ClickException(str(exc)) from exc
    if not gpu_capacity(nodes):
        raise click.ClickException(f"{nodes_file}: no node has GPUs: nothing to place on")
    if not any(p.gpu_demand > 0 for p in pods):
        raise click.ClickException(f"{pods_file}: no pod asks for GPUs: demand never grows")
    default = [DEFAULT_POLICY] if method == through.METHOD else known
    chosen = list(dict.fromkeys(policies)) or default
    job_list = [
        Job(nodes_file, pods_file, p, seed, demand, cpu_pods, method, scheduler_config)
        for p in chosen
    ]
    if jobs > 1:
        results = run_jobs(job_list, workers=jobs)
    else:
        results = [run_job(j, (nodes, pods), ProgressBar(j.policy)) for j in job_list]
    click.echo(json_lines(results) if as_json else table(results, method))
    if plot_file is not None:
        plot(results, plot_file, title=f"{pods_file.name} on {nodes_file.name}, seed {seed}")
        if not as_json:
            click.echo(f"plot written to {plot_file}")
