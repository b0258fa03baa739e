"""What virtual device memory costs on a real GPU: a kernel that reads and writes every word of
a 4 GiB buffer, on the card and spilled to managed memory (a neighbour holding all but 1 GiB
of the card, the container's slice 8 GiB with memory scaling > 1).

    .venv/bin/python -m bench.hook_virtual_memory

Needs an NVIDIA GPU (nvidia-smi); elsewhere it says so and writes nothing. On a GPU it
prints the figures and writes them into docs/benchmarks.md (section `hook-virtual-memory`).
About a minute.
"""

from __future__ import annotations

import platform
import tempfile
from pathlib import Path

from bench.report import write_section
from tests.gpu.spill_measure import BUFFER_MIB, ITERATIONS, LEFT_FREE_MIB, SLICE_MIB, gpu, measure
from tests.hook.harness import HOOK, build_hook


def main() -> None:
    found = gpu()
    if found is None:
        print("no NVIDIA GPU here: nothing measured, docs/benchmarks.md left as it is")
        return
    built = build_hook()
    if built.returncode != 0:
        raise SystemExit(built.stdout + built.stderr)
    model = found[0]
    with tempfile.TemporaryDirectory() as root:
        figures = measure(HOOK, Path(root))
    ratio = figures.spilled_gbps / figures.device_gbps if figures.device_gbps else 0.0
    print(f"device {figures.device_gbps:.1f} GB/s, spilled {figures.spilled_gbps:.1f} GB/s "
          f"({ratio:.1%}); managed={figures.spilled_managed}, "
          f"scaling 1 result={figures.plain_result}")  # fmt: skip
    lines = [
        "## Hook: virtual device memory on a GPU (kernel throughput, device vs spilled)",
        "",
        f"`.venv/bin/python -m bench.hook_virtual_memory` on GPU {model} "
        f"({figures.model_total_mib} MiB), host {platform.processor() or platform.machine()}.",
        f"A kernel reads and writes every 32-bit word of a {BUFFER_MIB} MiB buffer "
        f"{ITERATIONS} times (2048 x 256 threads, grid-stride); GB/s = bytes read and written "
        "per second. Spilled: a process without the hook holds all but "
        f"{LEFT_FREE_MIB} MiB of the card, so the hooked process (slice {SLICE_MIB} MiB, "
        "`virtual_memory=1`) gets the buffer as managed memory preferring the device.",
        "",
        "| buffer | GB/s |",
        "|---|---|",
        f"| on the card (`cuMemAlloc_v2`) | {figures.device_gbps:.1f} |",
        f"| spilled (managed, pages between host and card) | {figures.spilled_gbps:.1f} |",
        f"| spilled / on the card | {ratio:.1%} |",
        "",
        f"Memory scaling 1 (no `virtual_memory`): the same allocation fails with CUDA error "
        f"{figures.plain_result} (out of memory), as before.",
    ]
    write_section("hook-virtual-memory", "\n".join(lines))


if __name__ == "__main__":
    main()
