"""GPU backends behind the GpuBackend seam, and the choice between them."""

from __future__ import annotations

from services.nodeagent.gpus.backend import GpuBackend
from services.nodeagent.gpus.simulated import SimulatedGpuBackend


def backend_for(node_name: str, simulate: str) -> GpuBackend:
    if simulate:
        return SimulatedGpuBackend(node_name, simulate)
    raise ValueError(
        "no GPU backend: set `simulate` (e.g. '4xA100-40GB' or '2xA100-40GB,1xT4'); "
        "the NVML backend for real GPUs is not part of this version"
    )


__all__ = ["GpuBackend", "SimulatedGpuBackend", "backend_for"]
