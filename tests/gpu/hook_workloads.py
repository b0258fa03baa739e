"""Workloads run under libvgpu-hook on a real GPU by test_hook_gpu.py (one process each).

    python hook_workloads.py torch-oom <chunk_mib>
    python hook_workloads.py cupy-oom <chunk_mib>
    python hook_workloads.py torch-matmul <seconds>
    python hook_workloads.py torch-train <seconds>

Each prints one line of key=value figures.
"""

from __future__ import annotations

import sys
import time


def torch_oom(chunk_mib: int) -> None:
    import torch

    held, error = [], "none"
    try:
        while len(held) < 100000:
            held.append(torch.empty(chunk_mib << 20, dtype=torch.uint8, device="cuda"))
    except torch.cuda.OutOfMemoryError:
        error = "OutOfMemoryError"
    _free, total = torch.cuda.mem_get_info()
    print(f"allocated_mib={len(held) * chunk_mib} error={error} total_mib={total >> 20}")


def cupy_oom(chunk_mib: int) -> None:
    import cupy

    held, error = [], "none"
    try:
        while len(held) < 100000:
            held.append(cupy.empty(chunk_mib << 20, dtype=cupy.uint8))
    except cupy.cuda.memory.OutOfMemoryError:
        error = "OutOfMemoryError"
    _free, total = cupy.cuda.runtime.memGetInfo()
    print(f"allocated_mib={len(held) * chunk_mib} error={error} total_mib={total >> 20}")


def torch_matmul(seconds: float) -> None:
    import torch

    a = torch.randn(4096, 4096, device="cuda", dtype=torch.float16)
    b = torch.randn(4096, 4096, device="cuda", dtype=torch.float16)
    for _ in range(10):
        a @ b
    torch.cuda.synchronize()
    n, start = 0, time.monotonic()
    while time.monotonic() - start < seconds:
        for _ in range(10):
            a @ b
        torch.cuda.synchronize()
        n += 10
    print(f"per_second={n / (time.monotonic() - start):.1f}")


def torch_train(seconds: float) -> None:
    import torch

    model = torch.nn.Sequential(
        torch.nn.Linear(2048, 4096), torch.nn.ReLU(), torch.nn.Linear(4096, 2048)
    ).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.randn(512, 2048, device="cuda")

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        model(x).square().mean().backward()
        opt.step()

    for _ in range(20):
        step()
    torch.cuda.synchronize()
    n, start = 0, time.monotonic()
    while time.monotonic() - start < seconds:
        for _ in range(20):
            step()
        torch.cuda.synchronize()
        n += 20
    print(f"per_second={n / (time.monotonic() - start):.1f}")


if __name__ == "__main__":
    what, arg = sys.argv[1], sys.argv[2]
    {"torch-oom": lambda: torch_oom(int(arg)), "cupy-oom": lambda: cupy_oom(int(arg)),
     "torch-matmul": lambda: torch_matmul(float(arg)),
     "torch-train": lambda: torch_train(float(arg))}[what]()  # fmt: skip
