"""`kubectl inspect gpushare` (the `kubectl-inspect-gpushare` plugin) from vgpu's data.

Aliyun gpushare users type `kubectl inspect gpushare` to see GPU memory allocated per node and
GPU, and `-d` for the pods on each GPU. This prints gpushare's own tables, laid out as its
tool lays them out (Go's tabwriter, two spaces of padding), from the picture `vgpu inspect`
reads (the metrics service). gpushare counts whole GiB: a GPU's total is its memory rounded
down (as gpushare's device plugin counts it), what slices hold is rounded up per pod and GPU,
so a card is never shown with more room than it has.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import click

from services.cli.inspect import (
    bus_warning,
    fetch_picture,
    only_nodes,
    picture_source_options,
    resolve_target,
)
from services.metrics.views import ClusterView, GpuView, NodeView

GIB_MIB = 1024
PADDING = 2


def tabwrite(text: str, padding: int = PADDING) -> str:
    """Go's text/tabwriter (minwidth 0, padchar ' ', no flags): tab-terminated cells of
    consecutive lines form columns, each as wide as its widest cell plus `padding`; the last
    cell of a line (not tab-terminated) is not aligned."""
    lines = [line.split("\t") for line in text.split("\n")]
    out: list[str] = []
    widths: list[int] = []

    def emit(start: int, end: int) -> None:
        for cells in lines[start:end]:
            row = []
            for j, cell in enumerate(cells):
                row.append(cell.ljust(widths[j]) if j < len(widths) else cell)
            out.append("".join(row))

    def format_block(pos: int, line0: int, line1: int) -> int:
        column = len(widths)
        this = line0
        while this < line1:
            if column >= len(lines[this]) - 1:
                this += 1
                continue
            emit(pos, this)
            pos = this
            width = 0
            while this < line1 and column < len(lines[this]) - 1:
                width = max(width, len(lines[this][column]) + padding)
                this += 1
            widths.append(width)
            pos = format_block(pos, pos, this)
            widths.pop()
        emit(pos, line1)
        return line1

    format_block(0, 0, len(lines))
    return "\n".join(out)


def _total_gib(gpu: GpuView) -> int:
    return gpu.memory_mib // GIB_MIB


def _pods_gib(gpu: GpuView) -> dict[tuple[str, str], int]:
    """(namespace, pod) -> GiB its slices hold on this GPU, rounded up."""
    mib: dict[tuple[str, str], int] = defaultdict(int)
    for piece in gpu.slices:
        mib[(piece.namespace, piece.pod)] += piece.memory_mib
    return {pod: -(-held // GIB_MIB) for pod, held in sorted(mib.items())}


def _used_gib(gpu: GpuView) -> int:
    return sum(_pods_gib(gpu).values())


def _address(node: NodeView) -> str:
    return node.address or "unknown"


def _percent(used: int, total: int) -> int:
    return int(used / total * 100) if total > 0 else 0


def _gpu_nodes(view: ClusterView) -> list[NodeView]:
    """gpushare leaves out nodes without GPU memory."""
    return [node for node in view.nodes if sum(_total_gib(g) for g in node.gpus) > 0]


def summary(view: ClusterView) -> str:
    nodes = _gpu_nodes(view)
    columns = max((max((g.index for g in n.gpus), default=-1) + 1 for n in nodes), default=0)
    text = "NAME\tIPADDRESS\t"
    text += "".join(f"GPU{i}(Allocated/Total)\t" for i in range(columns))
    text += "GPU Memory(GiB)\n"
    used_cluster = total_cluster = 0
    line_length = 0
    for node in nodes:
        by_index = {gpu.index: gpu for gpu in node.gpus}
        row = f"{node.name}\t{_address(node)}\t"
        for index in range(columns):
            gpu = by_index.get(index)
            row += f"{_used_gib(gpu)}/{_total_gib(gpu)}\t" if gpu else "0/0\t"
        used = sum(_used_gib(g) for g in node.gpus)
        total = sum(_total_gib(g) for g in node.gpus)
        row += f"{used}/{total}\n"
        line_length = line_length or len(row) + 20
        text += row
        used_cluster += used
        total_cluster += total
    text += "-" * line_length + "\n"
    text += "Allocated/Total GPU Memory In Cluster:\n"
    text += f"{used_cluster}/{total_cluster} ({_percent(used_cluster, total_cluster)}%)\t\n"
    return tabwrite(text)


def details(view: ClusterView) -> str:
    text = ""
    used_cluster = total_cluster = 0
    line_length = 0
    for node in _gpu_nodes(view):
        gpus = sorted(node.gpus, key=lambda g: g.index)
        columns = max(g.index for g in gpus) + 1
        text += f"\nNAME:\t{node.name}\nIPADDRESS:\t{_address(node)}\n\n"
        text += "NAME\tNAMESPACE\t" + "".join(f"GPU{i}(Allocated)\t" for i in range(columns))
        text += "\n"
        rows = ""
        for gpu in gpus:
            for (namespace, pod), gib in _pods_gib(gpu).items():
                cells = [str(gib) if i == gpu.index else "0" for i in range(columns)]
                rows += f"{pod}\t{namespace}\t" + "".join(f"{c}\t" for c in cells) + "\n"
        line_length = line_length or len(rows) + 10
        text += rows
        used = sum(_used_gib(g) for g in gpus)
        total = sum(_total_gib(g) for g in gpus)
        text += f"Allocated :\t{used} ({_percent(used, total)}%)\t\n"
        text += f"Total :\t{total} \t\n"
        text += "-" * line_length + "\n"
        used_cluster += used
        total_cluster += total
    text += "\n\nAllocated/Total GPU Memory In Cluster:\t"
    text += f"{used_cluster}/{total_cluster} ({_percent(used_cluster, total_cluster)}%)\t\n"
    return tabwrite(text)


@click.command("kubectl-inspect-gpushare")
@click.argument("nodes", nargs=-1)
@click.option("-d", "--details", "show_details", is_flag=True,
              help="Per node: the pods on each GPU and their GiB.")  # fmt: skip
@picture_source_options
def main(nodes: tuple[str, ...], show_details: bool, metrics_url: str | None,
         state_file: Path | None, token: str | None, kubeconfig: str | None,
         timeout: float) -> None:  # fmt: skip
    """GPU memory allocated per node and GPU in GiB, as Aliyun gpushare's inspect shows it
    (for the namespaces whose pods the token's user may list, as `vgpu inspect`)."""
    url, bearer = resolve_target(metrics_url, state_file, token, kubeconfig)
    view = only_nodes(fetch_picture(url, timeout, bearer), nodes)
    warning = bus_warning(url, timeout)
    if warning:
        click.echo(f"warning: {warning}", err=True)
    click.echo(details(view) if show_details else summary(view), nl=False)
