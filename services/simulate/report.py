"""Present replay results: a text table, JSON lines, and the allocation-vs-demand plot."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from services.simulate.replay import ReplayResult

COLUMNS = ("alloc_at_100", "alloc_at_110", "alloc_at_120", "alloc_at_130")


def _percent(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}%"


METHODS = {
    "vgpu": "method vgpu: GPU pods through vgpu's placement engine, CPU-only pods by the "
    "kube-scheduler stand-in",
    "paper": "method paper: the FGD paper's simulator (ATC'23), every pod by the policy",
    "through-scheduler": "method through-scheduler: kube-scheduler emulation -> vgpu's "
    "extender over HTTP -> API server",
}


def table(results: Sequence[ReplayResult], method: str | None = None) -> str:
    """One line per replay: allocation ratio at 100..130% demand, failures, latency; the
    first line says which method produced it."""
    methods = sorted({r.method for r in results} | ({method} if method else set()))
    lines = [f"# {METHODS.get(m, 'method ' + m)}" for m in methods]
    header = (
        f"{'policy':<14} {'seed':>4} {'@100%':>8} {'@110%':>8} {'@120%':>8} {'@130%':>8} "
        f"{'failed':>7} {'p50 ms':>7} {'p99 ms':>7}"
    )
    lines.append(header)
    for result in results:
        row = result.to_json()
        cells = " ".join(f"{_percent(row[c]):>8}" for c in COLUMNS)
        lines.append(
            f"{row['policy']:<14} {row['seed']:>4} {cells} {row['failed_pods']:>7} "
            f"{row['decision_ms_p50']:>7.3f} {row['decision_ms_p99']:>7.3f}"
        )
    return "\n".join(lines)


def json_lines(results: Sequence[ReplayResult]) -> str:
    return "\n".join(json.dumps(r.to_json()) for r in results)


class PlotUnavailable(RuntimeError):
    pass


def require_plotting() -> None:
    """Fail before a long replay, not after it, when matplotlib is missing."""
    try:
        import matplotlib  # noqa: F401
    except ImportError as exc:
        raise PlotUnavailable(
            "--plot needs matplotlib: pip install 'vgpu[plot]' (or matplotlib)"
        ) from exc


def plot(results: Sequence[ReplayResult], path: Path, title: str = "") -> None:
    """Allocation ratio against demand, one line per policy (mean over its seeds)."""
    require_plotting()
    import matplotlib

    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt

    by_policy: dict[str, list[ReplayResult]] = {}
    for result in results:
        by_policy.setdefault(result.policy, []).append(result)
    figure, axes = plt.subplots(figsize=(7, 4.5))
    for policy, runs in by_policy.items():
        length = min(len(r.curve) for r in runs)
        demand = [100 * runs[0].curve[i][0] for i in range(length)]
        ratio = [100 * sum(r.curve[i][1] for r in runs) / len(runs) for i in range(length)]
        axes.plot(demand, ratio, label=policy, linewidth=1.4)
    axes.set_xlabel("GPU demand (% of cluster GPU capacity)")
    axes.set_ylabel("GPU allocation ratio (%)")
    axes.set_xlim(left=50)
    axes.set_ylim(50, 100)
    axes.grid(True, alpha=0.3)
    axes.legend(loc="lower right", fontsize="small")
    if title:
        axes.set_title(title, fontsize="medium")
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
