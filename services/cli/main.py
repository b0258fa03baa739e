"""The `vgpu` command: run the whole system locally, submit pods, or run one service."""

from __future__ import annotations

import asyncio
import importlib
import signal
import sys
from pathlib import Path
from typing import Any

import click
import msgspec

from services.cli.state import (
    StateError,
    default_state_file,
    default_store_dir,
    read_state,
    write_state,
)
from services.common.config import ConfigError, load_settings
from services.common.logs import configure_logging
from services.common.tracing import setup_tracing

CONFIG_OPTION = click.option(
    "--config", "config_file", type=click.Path(dir_okay=False), default=None,
    envvar="VGPU_CONFIG", help="YAML settings file (flags and VGPU_* variables override it).",
)  # fmt: skip


def _stop_on_signals() -> asyncio.Event:
    """An event set by SIGINT/SIGTERM; install it before saying "ready", or a Ctrl-C that
    follows at once would hit Python's default handler and abort the orderly stop."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stop.set)
    return stop


async def _until_signalled() -> None:
    await _stop_on_signals().wait()


class _LazyGroup(click.Group):
    """Imports a command's module only when that command runs (or help lists it): `vgpu
    simulate` pulls in the allocator's placement core, which `vgpu run` must not wait for."""

    lazy = {
        "delete": "services.cli.delete:delete_command",
        "inspect": "services.cli.inspect:inspect_command",
        "kubelet-sim": "services.cli.kubelet_sim_cmd:kubelet_sim",
        "run": "services.cli.run:run_command",
        "simulate": "services.cli.simulate_cmd:simulate",
    }

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted({*super().list_commands(ctx), *self.lazy})

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        if name in self.lazy:
            module, attribute = self.lazy[name].split(":")
            command: click.Command = getattr(importlib.import_module(module), attribute)
            return command
        return super().get_command(ctx, name)


@click.group(cls=_LazyGroup)
@click.version_option(package_name="vgpu")
def main() -> None:
    """vgpu: share NVIDIA GPUs between Kubernetes pods."""


@main.command()
@click.option("--nats-url", default="", help="Use this NATS server instead of an embedded one.")
@click.option("--nodes", default=2, show_default=True, help="Simulated nodes.")
@click.option("--simulate", default="4xA100-40GB", show_default=True, help="GPUs per node.")
@click.option("--allocator-port", default=8080, show_default=True)
@click.option("--extender-port", default=9443, show_default=True, help="HTTPS, client certs.")
@click.option("--metrics-port", default=9400, show_default=True)
@click.option("--otlp-endpoint", default="", envvar="VGPU_OTLP_ENDPOINT", help="Export traces.")
@click.option("--log-level", default="warning", show_default=True)
@click.option("--log-format", type=click.Choice(["text", "json"]), default="text")
@click.option("--state-file", type=click.Path(path_type=Path), default=None)
@click.option(
    "--store-dir", type=click.Path(file_okay=False, path_type=Path), default=None,
    help="The embedded NATS server's JetStream store, kept at Ctrl-C "
    "(default: beside the state file).",
)  # fmt: skip
@click.option("--fresh", is_flag=True, help="Empty the JetStream store first: forget every slice.")
@click.option(
    "--mode", type=click.Choice(["vgpu", "time-slicing", "mps", "exclusive"]), default="vgpu",
    show_default=True, help="How the nodes share their GPUs (docs/modes.md).",
)  # fmt: skip
@click.option(
    "--mig", is_flag=True,
    help="MIG: half the GPUs partitioned (nvidia.com/mig-<profile>), half dynamic MIG.",
)  # fmt: skip
# The 4paradigm device plugin's flags, given to every simulated node agent (docs/nodeagent.md).
@click.option(
    "--device-split-count", "split_count", type=click.IntRange(min=1), default=10,
    show_default=True, help="Tasks one GPU takes at most (device IDs per GPU).",
)  # fmt: skip
@click.option(
    "--device-memory-scaling", "memory_scaling", type=click.FloatRange(0, 100, min_open=True),
    default=None,
    help="Memory slices on a GPU may sum to this x its memory (default 1; > 1: virtual "
    "device memory).",
)  # fmt: skip
@click.option(
    "--device-cores-scaling", "cores_scaling", type=click.FloatRange(0, 100, min_open=True),
    default=None, help="Compute shares on a GPU may sum to 100 x this percent (default 1).",
)  # fmt: skip
@click.option(
    "--node-label", "node_label_args", multiple=True, metavar="NODE:KEY=VALUE",
    help="A label on a simulated node, e.g. node-2:vgpu.io/mode=mps (repeatable; docs/modes.md).",
)  # fmt: skip
def up(
    nats_url: str,
    nodes: int,
    simulate: str,
    allocator_port: int,
    extender_port: int,
    metrics_port: int,
    otlp_endpoint: str,
    log_level: str,
    log_format: str,
    state_file: Path | None,
    store_dir: Path | None,
    fresh: bool,
    mode: str,
    mig: bool,
    split_count: int,
    memory_scaling: float | None,
    cores_scaling: float | None,
    node_label_args: tuple[str, ...],
) -> None:
    """Run the whole system on this machine with simulated GPUs until Ctrl-C.

    A nats-server that dies is restarted (same port, same store) with backoff; Ctrl-C keeps
    the JetStream store, so the next `vgpu up` remembers every slice (--fresh forgets them)."""
    from services.cli.local_cluster import LocalCluster, LocalClusterSpec

    configure_logging(log_level, json_format=log_format == "json")
    setup_tracing("vgpu", otlp_endpoint)
    path = state_file or default_state_file()
    try:  # two systems on one state file would share (and corrupt) one JetStream store
        running = read_state(path)
    except StateError:
        pass  # none, or it is gone
    else:
        raise click.ClickException(
            f"`vgpu up` (pid {running.pid}) already runs with {path}: stop it first, "
            "or pass another --state-file"
        )
    store = "" if nats_url else str(store_dir or default_store_dir(path))
    from services.cli.local_cluster import parse_node_labels
    from services.cli.local_users import default_users_file

    try:
        node_labels = parse_node_labels(node_label_args, nodes)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--node-label") from exc

    spec = LocalClusterSpec(
        nodes=nodes, simulate=simulate, nats_url=nats_url, allocator_port=allocator_port,
        metrics_port=metrics_port, nats_store_dir=store, fresh=fresh, mode=mode,
        extender_port=extender_port, tls_dir=str(path.with_name(f"{path.stem}-tls")), mig=mig,
        users_file=str(default_users_file(path)), split_count=split_count,
        memory_scaling=memory_scaling or 0.0, cores_scaling=cores_scaling or 0.0,
        node_labels=node_labels,
    )  # fmt: skip

    async def run() -> None:
        cluster = LocalCluster(spec)
        try:
            await cluster.start()
            stop = _stop_on_signals()
            state = cluster.state()
            write_state(state, path)
            click.echo(f"NATS       {state.nats_url}")
            if state.nats_store_dir:
                click.echo(f"store      {state.nats_store_dir}  (kept at Ctrl-C; --fresh empties)")
            click.echo(
                f"extender   {state.extender_url}  (filter, prioritize, bind; "
                "client certificate required)"
            )
            click.echo(f"certs      CA {state.ca_file}")
            click.echo(f"           client {state.client_cert_file} {state.client_key_file}")
            click.echo(f"allocator  {state.allocator_url}/allocations")
            if cluster.allocator is not None and spec.admission_webhook:
                click.echo(f"webhook    {cluster.allocator.webhook_url}/mutate  (pod CREATE, "
                           "as deploy/k8s registers it)")  # fmt: skip
            click.echo(f"metrics    {state.metrics_url}/metrics")
            click.echo(f"dashboard  {state.metrics_url}/  (vgpu inspect for a table)")
            if state.admin_token:
                click.echo(f"users      {state.users_file}  (tokens; add tenants here)")
                click.echo(f"token      {state.admin_token}  (cluster-admin: "
                           "curl -H 'Authorization: Bearer <token>' ...)")  # fmt: skip
            for node, url in state.kubelets.items():
                agent_gpus = cluster.agents[node].gpus
                gpus = ", ".join(gpu.uuid for gpu in agent_gpus)
                modes = sorted({gpu.sharing_mode for gpu in agent_gpus} - {"vgpu"})
                shared = f"  mode {', '.join(modes)}" if modes and node in node_labels else ""
                click.echo(f"{node:<10} kubelet {url}  GPUs {gpus}{shared}")
            if mode != "vgpu":
                click.echo(f"mode       {mode} (docs/modes.md)")
            click.echo("ready (vgpu submit examples/half-gpu.yaml; Ctrl-C to stop)", err=False)
            sys.stdout.flush()
            await stop.wait()
        finally:
            path.unlink(missing_ok=True)
            await cluster.stop()

    try:
        asyncio.run(run())
    except (OSError, ValueError, RuntimeError) as exc:
        raise click.ClickException(str(exc)) from exc
    click.echo("stopped")


@main.command()
@click.option("--state-file", type=click.Path(path_type=Path), default=None)
def token(state_file: Path | None) -> None:
    """Print the cluster-admin bearer token of the running `vgpu up` (for curl)."""
    try:
        state = read_state(state_file or default_state_file())
    except StateError as exc:
        raise click.ClickException(str(exc)) from exc
    if not state.admin_token:
        raise click.ClickException("this `vgpu up` checks no tokens (its read APIs are open)")
    click.echo(state.admin_token)


@main.command()
@click.argument("manifest", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("--state-file", type=click.Path(path_type=Path), default=None)
@click.option("--json", "as_json", is_flag=True, help="Print the outcome as JSON.")
@click.option("--timeout", default=10.0, show_default=True, help="Seconds to wait for limits.")
def submit(manifest: Path, state_file: Path | None, as_json: bool, timeout: float) -> None:
    """Schedule and admit a Pod manifest on the system `vgpu up` runs."""
    from services.cli.bus_probe import HINT, bus_problem
    from services.cli.submit import ApiRefused, ManifestError, load_pod, render
    from services.cli.submit import submit as submit_pod

    try:
        pod = load_pod(manifest)  # the file's problems first: they need no running system
        state = read_state(state_file or default_state_file())
        # Without the bus nothing can be booked: say so, rather than blame the node agents.
        problem = bus_problem(state.nats_url)
        if problem:
            raise click.ClickException(f"{problem} ({HINT})")
        outcome = asyncio.run(submit_pod(pod, state, limits_timeout_s=timeout))
    except (StateError, ManifestError) as exc:
        raise click.ClickException(str(exc)) from exc
    except ApiRefused as exc:  # worded as kubectl words it
        raise click.ClickException(
            f'Error from server ({exc.reason}): error when creating "{manifest}": {exc}'
        ) from exc
    click.echo(msgspec.json.encode(outcome).decode() if as_json else render(outcome))
    if outcome.node is None or outcome.reason:
        sys.exit(1)


def _settings(settings_type: type[Any], section: str, config_file: str | None, **flags: Any) -> Any:
    try:
        return load_settings(settings_type, section=section, file=config_file, overrides=flags)
    except ConfigError as exc:
        raise click.ClickException(str(exc)) from exc


class _ServiceDied(Exception):
    pass


def _serve(service: Any, name: str, log_level: str, otlp_endpoint: str) -> None:
    """Run one service until SIGINT/SIGTERM (how the Kubernetes manifests run them), or until
    a loop it lives by dies: then exit 1 naming it, so that Kubernetes restarts the container
    (CrashLoopBackOff) instead of keeping a process that only looks alive."""
    configure_logging(log_level)
    setup_tracing(name, otlp_endpoint)

    async def run() -> None:
        await service.start()
        try:
            signalled = asyncio.ensure_future(_until_signalled())
            died = asyncio.ensure_future(service.wait_died())
            done, _ = await asyncio.wait({signalled, died}, return_when=asyncio.FIRST_COMPLETED)
            for waiter in (signalled, died):
                waiter.cancel()
            if died in done:
                raise _ServiceDied(f"{name} died: {died.result()}")
        finally:
            await service.stop()

    try:
        asyncio.run(run())
    except (OSError, RuntimeError, ValueError, _ServiceDied) as exc:  # refused at start: say why
        raise click.ClickException(str(exc)) from exc


@main.command()
@CONFIG_OPTION
@click.option("--nats-url", default=None)
@click.option("--http-host", default=None)
@click.option("--http-port", type=int, default=None)
@click.option(
    "--memory-unit", type=click.Choice(["GiB", "MiB"]), default=None,
    help="What aliyun.com/gpu-mem counts (gpushare's flag; default GiB).",
)  # fmt: skip
def allocator(config_file: str | None, **flags: Any) -> None:
    """Run the allocator (scheduler extender + claim service)."""
    from services.allocator.service import Allocator
    from services.allocator.settings import AllocatorSettings

    settings = _settings(AllocatorSettings, "allocator", config_file, **flags)
    _serve(Allocator(settings), "vgpu-allocator", settings.log_level, settings.otlp_endpoint)


@main.command("node-agent")
@CONFIG_OPTION
@click.option("--node-name", default=None, envvar="NODE_NAME")
@click.option("--nats-url", default=None)
@click.option("--simulate", default=None, help="Simulated GPUs, e.g. 4xA100-40GB.")
@click.option("--plugin-dir", default=None)
@click.option("--pod-resources-socket", default=None)
@click.option("--container-root", default=None)
@click.option("--state-dir", default=None, help="Agent-private state (never mounted in pods).")
@click.option(
    "--on-violation",
    type=click.Choice(["report", "kill"]),
    default=None,
    help="A container over its slice (NVML): report it, or also SIGKILL its processes.",
)
@click.option(
    "--cpu-milli",
    type=int,
    default=None,
    help="Allocatable CPU in millicores "
    "(default: 64000 for simulated nodes, unstated for real ones).",
)
@click.option(
    "--host-memory-mib",
    type=int,
    default=None,
    help="Allocatable memory in MiB (default: 262144 for simulated nodes).",
)
@click.option("--max-pods", type=int, default=None, help="Pods the node takes "
              "(default: 110 for simulated nodes).")  # fmt: skip
# The 4paradigm vGPU device plugin's flags, with its meaning (docs/nodeagent.md).
# AWS's virtual GPU plugin's --vgpu means the same: vGPUs (device IDs) per GPU.
@click.option(
    "--device-split-count", "--vgpu", "split_count", type=int, default=None,
    help="Tasks one GPU takes at most (device IDs per GPU; default 10). --vgpu: AWS's name.",
)  # fmt: skip
@click.option(
    "--device-memory-scaling", "memory_scaling", type=float, default=None,
    help="Memory slices on a GPU may sum to this x its memory (> 1 oversubscribes).",
)  # fmt: skip
@click.option(
    "--device-cores-scaling", "cores_scaling", type=float, default=None,
    help="Compute shares on a GPU may sum to 100 x this percent.",
)  # fmt: skip
@click.option(
    "--fail-on-init-error", "fail_on_init_error", type=click.BOOL, default=None,
    is_flag=False, flag_value=True,
    help="No NVML or no GPU: exit with the reason (true, the default) or stay up, "
    "registered with no devices (false).",
)  # fmt: skip
@click.option(
    "--config-file", "nvidia_config_file", type=click.Path(dir_okay=False), default=None,
    help="NVIDIA device-plugin config file (v1), as NVIDIA's plugin takes it "
    "(also CONFIG_FILE); vgpu's --config and flags override it.",
)  # fmt: skip
@click.option(
    "--sharing-mode", type=click.Choice(["vgpu", "time-slicing", "mps", "exclusive"]),
    default=None, help="How this node's GPUs are shared (docs/modes.md).",
)  # fmt: skip
@click.option(
    "--resource-config", default=None,
    help="FROM:TO:REPLICAS[,...] as the GPU-sharing fork, e.g. gpu:sharedgpu:4.",
)  # fmt: skip
def node_agent(config_file: str | None, nvidia_config_file: str | None, **flags: Any) -> None:
    """Run the node agent (device plugin, inventory and usage publisher)."""
    from services.nodeagent.service import NodeAgent
    from services.nodeagent.settings import load_node_agent_settings

    try:
        settings = load_node_agent_settings(
            config_file=config_file, nvidia_config_file=nvidia_config_file, flags=flags
        )
    except ConfigError as exc:
        raise click.ClickException(str(exc)) from exc
    try:
        agent = NodeAgent(settings)
    except ValueError as exc:
        raise click.ClickException(str(exc)) from exc
    _serve(agent, "vgpu-nodeagent", settings.log_level, settings.otlp_endpoint)


@main.command()
@CONFIG_OPTION
@click.option("--nats-url", default=None)
@click.option("--http-host", default=None)
@click.option("--http-port", type=int, default=None)
def metrics(config_file: str | None, **flags: Any) -> None:
    """Run the metrics service (Prometheus /metrics from NATS events)."""
    from services.metrics.service import MetricsService
    from services.metrics.settings import MetricsSettings

    settings = _settings(MetricsSettings, "metrics", config_file, **flags)
    _serve(MetricsService(settings), "vgpu-metrics", settings.log_level, settings.otlp_endpoint)


if __name__ == "__main__":
    main()
