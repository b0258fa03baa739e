"""Virtual device memory on a real GPU (issue 19): with the card filled by a neighbour, an
allocation inside the slice succeeds as managed memory preferring the device, a kernel runs
over it, and the same allocation with memory scaling 1 fails as before. Prints the kernel's
throughput over device and spilled memory (bench/hook_virtual_memory.py writes them into
docs/benchmarks.md). Skips without a GPU.

    .venv/bin/python -m pytest -q -s tests/gpu/test_virtual_memory_gpu.py
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.gpu.spill_measure import gpu, measure
from tests.hook.harness import HOOK, build_hook

pytestmark = pytest.mark.skipif(gpu() is None, reason="no NVIDIA GPU here")

CUDA_ERROR_OUT_OF_MEMORY = 2


def test_a_full_card_spills_inside_the_slice_and_kernels_run_over_it(tmp_path: Path) -> None:
    built = build_hook()
    assert built.returncode == 0, built.stdout + built.stderr
    figures = measure(HOOK, tmp_path)
    print(
        f"\nkernel over device memory {figures.device_gbps:.1f} GB/s, over spilled memory "
        f"{figures.spilled_gbps:.1f} GB/s"
    )
    assert figures.spilled_managed  # the allocation succeeded, as managed memory
    assert figures.plain_result == CUDA_ERROR_OUT_OF_MEMORY  # scaling 1: unchanged
    assert figures.device_gbps > 0 and figures.spilled_gbps > 0
