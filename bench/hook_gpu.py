"""libvgpu-hook on a real GPU: the memory slice as frameworks and nvidia-smi see it, the
compute limiter alone and between two tenants, and a training step's overhead.

    .venv/bin/python -m bench.hook_gpu

Needs an NVIDIA GPU (nvidia-smi) with PyTorch (CuPy optional); elsewhere it says so and
writes nothing. On a GPU it prints the figures and writes them into docs/benchmarks.md
(section `hook-gpu`). About 3 minutes.
"""

from __future__ import annotations

import importlib.util
import platform
import subprocess
import tempfile
from pathlib import Path

from bench.report import write_section
from tests.gpu.hook_runs import (
    busy_median,
    container,
    env,
    figures,
    gpu_uuid,
    smi_samples,
    start_workload,
    workload,
)
from tests.hook.harness import build_hook

SLICE_MIB = 4096
ALONE_S = 8  # seconds of matrix products per alone run
SHARED_S = 15
TRAIN_S = 5
TRAIN_ROUNDS = 3  # interleaved, best of each: the GPU's clocks wander


def gpu_name() -> str:
    out = subprocess.run(
        ["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
        capture_output=True,
        text=True,
    )
    return out.stdout.strip().splitlines()[0] if out.returncode == 0 else "unknown GPU"


def memory_rows(root: Path, uuid: str) -> list[str]:
    rows = []
    for framework in ("torch", "cupy"):
        if importlib.util.find_spec(framework) is None:
            continue
        where = container(root, f"oom-{framework}", uuid, mib=SLICE_MIB, cores=100)
        out = workload(where, f"{framework}-oom", 256)
        rows.append(
            f"| {framework}: 256 MiB buffers until refused | {out['allocated_mib']} MiB taken, "
            f"then `{out['error']}`; the framework sees {out['total_mib']} MiB |"
        )
    smi = subprocess.run(
        ["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits"],
        env=env(container(root, "smi", uuid, mib=SLICE_MIB, cores=100)),
        capture_output=True,
        text=True,
    )
    shown = smi.stdout.strip() or smi.stderr.strip()
    rows.append(f"| `nvidia-smi --query-gpu=memory.total` in the container | {shown} MiB |")
    return rows


def alone(root: Path, uuid: str, cores: int | None) -> tuple[float, tuple[float, float, float]]:
    """Matrix products per second and nvidia-smi's medians; cores None: no hook at all."""
    where = None
    if cores is not None:
        where = container(root, f"alone{cores}", uuid, mib=SLICE_MIB, cores=cores)
    with smi_samples() as samples:
        out = workload(where, "torch-matmul", ALONE_S)
    return float(out["per_second"]), busy_median(samples)


def shared(root: Path, uuid: str) -> tuple[float, float, tuple[float, float, float]]:
    dirs = [container(root, f"shared{c}", uuid, mib=SLICE_MIB, cores=c) for c in (30, 70)]
    with smi_samples() as samples:
        procs = [start_workload(d, "torch-matmul", SHARED_S) for d in dirs]
        outs = [p.communicate(timeout=300)[0] for p in procs]
    a, b = (float(figures(o)["per_second"]) for o in outs)
    return a, b, busy_median(samples)


def training(root: Path, uuid: str) -> tuple[float, float]:
    limited = container(root, "train", uuid, mib=SLICE_MIB * 4, cores=100)
    plain, hooked = [], []
    for _ in range(TRAIN_ROUNDS):
        plain.append(float(workload(None, "torch-train", TRAIN_S)["per_second"]))
        hooked.append(float(workload(limited, "torch-train", TRAIN_S)["per_second"]))
    return max(plain), max(hooked)


def main() -> None:
    uuid = gpu_uuid()
    if uuid is None or importlib.util.find_spec("torch") is None:
        print("no NVIDIA GPU with PyTorch here: nothing measured, docs/benchmarks.md left as it is")
        return
    built = build_hook()
    if built.returncode != 0:
        raise SystemExit(built.stdout + built.stderr)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        memory = memory_rows(root, uuid)
        runs = {cores: alone(root, uuid, cores) for cores in (None, 100, 70, 30)}
        a, b, both = shared(root, uuid)
        plain_steps, hooked_steps = training(root, uuid)
    bare = runs[None][0]
    lines = [
        "## Hook: on a real GPU (memory slice, compute limiter, overhead)",
        "",
        f"`.venv/bin/python -m bench.hook_gpu` on {gpu_name()}, host "
        f"{platform.processor() or platform.machine()}. Slice {SLICE_MIB} MiB; the work is "
        "PyTorch fp16 4096x4096 matrix products, 10 per synchronise "
        f"({ALONE_S} s alone, {SHARED_S} s side by side); nvidia-smi sampled every 0.5 s, medians "
        "over the busy samples. No node agent runs, so the share is held even when the GPU "
        "is otherwise idle (policy `share` would lend it out then).",
        "",
        "| memory | result |",
        "|---|---|",
        *memory,
        "",
        "| compute | products/s | of the bare card's | nvidia-smi busy | SM clock MHz | power W |",
        "|---|---|---|---|---|---|",
    ]
    labels = {None: "no hook", 100: "hook, cores 100", 70: "hook, cores 70 alone"}
    labels[30] = "hook, cores 30 alone"
    for cores, label in labels.items():
        rate, (util, clock, power) = runs[cores]
        lines.append(
            f"| {label} | {rate:.0f} | {rate / bare:.1%} | {util:.0f}% "
            f"| {clock:.0f} | {power:.0f} |"
        )
    util, clock, power = both
    lines += [
        f"| cores 30 and cores 70 side by side | {a:.0f} and {b:.0f} (share of the two: "
        f"{a / (a + b):.3f} and {b / (a + b):.3f}) | {(a + b) / bare:.1%} together | {util:.0f}% "
        f"| {clock:.0f} | {power:.0f} |",
        "",
        f"Training step (2-layer MLP, batch 512, SGD; best of {TRAIN_ROUNDS} interleaved "
        f"{TRAIN_S} s runs): {plain_steps:.1f} steps/s without the hook, {hooked_steps:.1f} "
        f"with it (cores 100): {1 - hooked_steps / plain_steps:+.2%} lost.",
        "",
        "The limiter holds GPU time, the measure nvidia-smi shows and HAMi's `gpucores` means. "
        "Throughput is not proportional to it on a power-capped card: at full load the card "
        "runs at its power limit with a lower SM clock, while a tenant held to 30% runs at the "
        "boost clock, so each of its products is faster and its share of the bare card's "
        "throughput exceeds its share of time.",
    ]
    text = "\n".join(lines)
    print(text)
    write_section("hook-gpu", text)


if __name__ == "__main__":
    main()
