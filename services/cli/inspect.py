"""`vgpu inspect` (also `kubectl vgpu inspect`): what every GPU holds, from the metrics API.

For users of `kubectl inspect gpushare`: one row per node and GPU with allocated/total memory
and compute and the pods on it, cluster totals, and the pods still waiting with their
reasons; `-d` adds one line per slice (asked, limit, used), `-o json` prints the picture as
the metrics service serves it. The URL comes from --metrics-url (or VGPU_METRICS_URL), else
from the state file a running `vgpu up` wrote.

The metrics service shows a caller only the namespaces whose pods it may list, so the
command sends a bearer token: --token (or VGPU_TOKEN); else, with the URL from `vgpu up`'s
state file, that file's admin token; else the token of the current kubeconfig context (as
kubectl would send it, exec plugins included), if there is one.
"""

from __future__ import annotations

import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click
import msgspec

from services.cli.bus_probe import HINT
from services.cli.state import StateError, default_state_file, read_state
from services.metrics.views import ClusterView, GpuView, NodeView, PendingView

PICTURE_PATH = "/api/v1/picture"
HEALTH_PATH = "/healthz"
URL_HELP = "The metrics service, e.g. http://127.0.0.1:9400 (default: the one `vgpu up` runs)."


class InspectError(click.ClickException):
    pass


def resolve_metrics_url(explicit: str | None, state_file: Path | None) -> str:
    return resolve_target(explicit, state_file, None, None)[0]


def resolve_target(explicit: str | None, state_file: Path | None, token: str | None,
                   kubeconfig: str | None) -> tuple[str, str]:  # fmt: skip
    """(metrics URL, bearer token or "")."""
    if explicit:
        return explicit.rstrip("/"), token or kubeconfig_token(kubeconfig)
    try:
        state = read_state(state_file or default_state_file())
    except StateError as exc:
        raise InspectError(f"{exc} (or pass --metrics-url / set VGPU_METRICS_URL)") from exc
    return state.metrics_url.rstrip("/"), token or state.admin_token


def kubeconfig_token(path: str | None) -> str:
    """The bearer token kubectl would send for the current context ("" if none)."""
    from kubernetes import client as k8s
    from kubernetes import config as k8s_config

    configuration = k8s.Configuration()
    try:
        k8s_config.load_kube_config(config_file=path, client_configuration=configuration)
    except Exception:  # no kubeconfig, or one without a usable context: no token (a 401 says)
        return ""
    keys = configuration.api_key or {}  # the key's name differs between client versions
    header = str(keys.get("BearerToken") or keys.get("authorization") or "")
    return header.removeprefix("Bearer ").strip()


def _open(target: str, token: str, timeout_s: float) -> bytes:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    request = urllib.request.Request(target, headers=headers)
    with urllib.request.urlopen(request, timeout=timeout_s) as response:
        return bytes(response.read())


def _refusal(exc: urllib.error.HTTPError) -> str:
    try:
        reason = msgspec.json.decode(exc.read()).get("error", "")
    except (msgspec.DecodeError, AttributeError, OSError):
        reason = ""
    hints = {401: " (pass --token, or a kubeconfig whose user has a token)",
             403: " (the token's user may not list pods there)"}  # fmt: skip
    return f": {reason}{hints.get(exc.code, '')}" if reason else hints.get(exc.code, "")


def fetch_picture(url: str, timeout_s: float, token: str = "") -> ClusterView:
    target = url + PICTURE_PATH
    try:
        body = _open(target, token, timeout_s)
    except urllib.error.HTTPError as exc:
        raise InspectError(f"the metrics service at {url} answered {exc.code} for "
                           f"{PICTURE_PATH}{_refusal(exc)}") from exc  # fmt: skip
    except (urllib.error.URLError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        raise InspectError(f"cannot reach the metrics service at {url}: {reason}") from exc
    try:
        return msgspec.json.decode(body, type=ClusterView)
    except msgspec.DecodeError as exc:
        raise InspectError(f"{target} did not return a vgpu picture: {exc}") from exc


def bus_warning(url: str, timeout_s: float) -> str | None:
    """What the metrics service says about the bus, when it is down (its picture is stale)."""
    try:
        with urllib.request.urlopen(url + HEALTH_PATH, timeout=timeout_s) as response:
            body = response.read()
    except urllib.error.HTTPError as exc:  # 503 while the bus is down: the body says why
        body = exc.read()
    except (urllib.error.URLError, OSError):
        return None  # fetching the picture reports an unreachable metrics service
    try:
        health = msgspec.json.decode(body)
    except msgspec.DecodeError:
        return None
    if not isinstance(health, dict) or health.get("nats_connected", True):
        return None
    nats = health.get("nats_url") or "its NATS server"
    since = health.get("nats_down_since")
    when = (
        time.strftime(" since %H:%M:%S", time.localtime(since))
        if isinstance(since, int | float)
        else ""
    )
    return (
        f"the bus (NATS at {nats}) is unreachable{when}: the metrics service hears nothing "
        f"new, so this picture may be out of date ({HINT})"
    )


def only_nodes(view: ClusterView, names: tuple[str, ...]) -> ClusterView:
    if not names:
        return view
    unknown = sorted(set(names) - {node.name for node in view.nodes})
    if unknown:
        raise InspectError(f"no such node in the picture: {', '.join(unknown)}")
    nodes = [node for node in view.nodes if node.name in names]
    pods = [pod for pod in view.pods if pod.node in names]
    return msgspec.structs.replace(view, nodes=nodes, pods=pods)


# -- rendering ------------------------------------------------------------------------------


def _percent(part: int, whole: int) -> str:
    return f"{round(100 * part / whole)}%" if whole else "-"


def _known(value: float | None, suffix: str = "") -> str:
    return "?" if value is None else f"{round(value)}{suffix}"


def _table(headers: list[str], rows: list[list[str]]) -> list[str]:
    widths = [max(len(row[i]) for row in [headers, *rows]) for i in range(len(headers))]
    return ["  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip()
            for row in [headers, *rows]]  # fmt: skip


def _state(node: NodeView) -> str:
    return "up" if node.state == "up" else f"silent {round(node.silent_s)}s"


def _pods_on(gpu: GpuView) -> str:
    names = list(dict.fromkeys(f"{s.namespace}/{s.pod}{' (!)' if s.violation else ''}"
                               for s in gpu.slices))  # fmt: skip
    return ",".join(names) if names else "-"


def _slice_lines(gpu: GpuView) -> list[list[str]]:
    rows = []
    for piece in gpu.slices:
        used = _known(piece.memory_used_mib)
        if piece.spilled_mib:
            used += f" ({piece.spilled_mib} spilled)"
        sm = _known(piece.sm_util_percent, "%")
        cores = f"{piece.cores}%" if piece.cores else "none"
        flag = f"VIOLATION: {piece.violation}" if piece.violation else ""
        rows.append(["", "", "", f"  {piece.namespace}/{piece.pod}/{piece.container}",
                     f"{piece.memory_mib} asked, {piece.memory_limit_mib} limit",
                     f"{cores} asked", used, sm, flag])  # fmt: skip
    return rows


def render_violations(view: ClusterView) -> list[str]:
    """Every slice the node agents flag (always shown: a broken slice is never a detail)."""
    rows = []
    for node in view.nodes:
        for gpu in node.gpus:
            for piece in gpu.slices:
                if piece.violation:
                    rows.append([
                        f"{piece.namespace}/{piece.pod}/{piece.container}", node.name,
                        str(gpu.index), piece.violation, _known(piece.measured_mib),
                        str(piece.memory_limit_mib) if piece.memory_limit_mib else "none",
                        _known(piece.memory_used_mib),
                    ])  # fmt: skip
    if not rows:
        return []
    headers = ["CONTAINER", "NODE", "GPU", "VIOLATION", "NVML MiB", "SLICE MiB", "HOOK MiB"]
    return ["", f"Slice violations ({len(rows)}):", *_table(headers, rows)]


def render_nodes(view: ClusterView, details: bool) -> list[str]:
    headers = ["NODE", "STATE", "GPU", "MODEL", "MEMORY MiB (ALLOC/TOTAL)",
               "COMPUTE (ALLOC/TOTAL)", "USED MiB", "SM", "PODS"]  # fmt: skip
    rows: list[list[str]] = []
    for node in view.nodes:
        if not node.gpus:
            rows.append([node.name, _state(node), "-", "-", "-", "-", "-", "-", "-"])
        for position, gpu in enumerate(node.gpus):
            unhealthy = "" if gpu.healthy else " (unhealthy)"
            if gpu.sharing_mode != "vgpu":  # docs/modes.md
                unhealthy += f" [{gpu.sharing_mode} x{gpu.replicas}]"
            rows.append([
                node.name if position == 0 else "",
                _state(node) if position == 0 else "",
                str(gpu.index), gpu.model + unhealthy,
                f"{gpu.memory_allocated_mib}/{gpu.memory_mib} "
                f"({_percent(gpu.memory_allocated_mib, gpu.memory_mib)})"
                + (f" oversubscribed x{gpu.memory_scaling:g}" if gpu.oversubscribed else ""),
                f"{gpu.cores_allocated}/{round(100 * gpu.cores_scaling)}%",
                _known(gpu.memory_used_mib), _known(gpu.sm_util_percent, "%"), _pods_on(gpu),
            ])  # fmt: skip
            if details:
                rows.extend(_slice_lines(gpu))
    if not rows:
        return ["No node has reported yet."]
    return _table(headers, rows)


def render_totals(view: ClusterView) -> list[str]:
    t = view.totals
    return [
        f"Allocated/Total GPU memory in cluster: {t.memory_allocated_mib}/{t.memory_mib} MiB "
        f"({_percent(t.memory_allocated_mib, t.memory_mib)})",
        f"Allocated/Total compute in cluster:    {t.cores_allocated}/{t.cores}% "
        f"({_percent(t.cores_allocated, t.cores)})",
        f"Nodes up: {t.nodes_up}/{t.nodes}  GPUs: {t.gpus} ({t.gpus_healthy} healthy)  "
        f"Slices: {t.slices}  Pods: {t.pods}  "
        f"Stranded memory: {t.stranded_memory_mib} MiB of {t.free_memory_mib} MiB free",
    ]


def _asks(pending: PendingView) -> str:
    parts = []
    for request in pending.requests:
        if request.gpus < 1:
            continue
        memory = (f"{request.memory_mib} MiB" if request.memory_mib
                  else f"{request.memory_percent}% memory" if request.memory_percent
                  else "whole GPU")  # fmt: skip
        cores = f", {request.cores}%" if request.cores else ""
        parts.append(f"{request.container}: {request.gpus}x {memory}{cores}")
    return "; ".join(parts) or "-"


def render_pending(view: ClusterView, details: bool) -> list[str]:
    if not view.pending:
        return ["No pod is waiting for GPUs."]
    rows = [[f"{p.namespace}/{p.name}", f"{round(p.waiting_s)}s", _asks(p), p.summary]
            for p in view.pending]  # fmt: skip
    total = max(view.totals.pending_pods, len(view.pending))
    shown = len(view.pending)
    count = f"showing {shown:,} of {total:,}, longest waiting first" if shown < total else total
    lines = [f"Pending pods ({count}):"]
    lines += _table(["POD", "WAITING", "ASKS", "REASON"], rows)
    if details:
        for pending in view.pending:
            lines.append(f"{pending.namespace}/{pending.name}:")
            for reason in pending.reasons:
                count = max(reason.node_count, len(reason.nodes))
                nodes = f": {', '.join(reason.nodes)}" if reason.nodes else ""
                lines.append(f"  {reason.message} ({count} node(s){nodes})")
    return lines


def render(view: ClusterView, details: bool = False) -> str:
    lines = render_nodes(view, details)
    lines += render_violations(view)
    lines += ["-" * 72, *render_totals(view), "", *render_pending(view, details)]
    return "\n".join(lines)


# -- the command ----------------------------------------------------------------------------


_PICTURE_SOURCE = (
    click.option("--metrics-url", envvar="VGPU_METRICS_URL", default=None, help=URL_HELP),
    click.option("--state-file", type=click.Path(path_type=Path), default=None),
    click.option(
        "--token",
        envvar="VGPU_TOKEN",
        default=None,
        help="Bearer token (default: `vgpu up`'s admin token, or the kubeconfig's).",
    ),
    click.option(
        "--kubeconfig",
        envvar="KUBECONFIG",
        default=None,
        help="Where the token comes from with --metrics-url (default ~/.kube/config).",
    ),
    click.option(
        "--timeout", default=5.0, show_default=True, help="Seconds to wait for an answer."
    ),
)


def picture_source_options(command: Callable[..., Any]) -> Callable[..., Any]:
    """Where a command reads the cluster's picture from, and as whom: the options every
    inspect command shares (--metrics-url, --state-file, --token, --kubeconfig, --timeout)."""
    for option in reversed(_PICTURE_SOURCE):
        command = option(command)
    return command


@click.command("inspect")
@click.option("-d", "--details", is_flag=True,
              help="One line per slice (asked, limit, used) and every pending reason.")  # fmt: skip
@click.option("-o", "--output", type=click.Choice(["table", "json"]), default="table",
              show_default=True)  # fmt: skip
@click.option("--node", "nodes", multiple=True, help="Only this node (repeatable).")
@picture_source_options
def inspect_command(details: bool, output: str, nodes: tuple[str, ...], metrics_url: str | None,
                    state_file: Path | None, token: str | None, kubeconfig: str | None,
                    timeout: float) -> None:  # fmt: skip
    """Show what every GPU holds: allocated and used memory and compute, pods, pending pods.

    You see the namespaces whose pods your token may list (all of them with cluster-wide
    rights)."""
    url, bearer = resolve_target(metrics_url, state_file, token, kubeconfig)
    view = only_nodes(fetch_picture(url, timeout, bearer), nodes)
    warning = bus_warning(url, timeout)
    if warning:
        click.echo(f"warning: {warning}", err=True)
    if output == "json":
        click.echo(msgspec.json.format(msgspec.json.encode(view), indent=2).decode())
    else:
        click.echo(render(view, details))


@click.group("kubectl-vgpu")
def kubectl_main() -> None:
    """vgpu as a kubectl plugin: `kubectl vgpu inspect`."""


kubectl_main.add_command(inspect_command)
