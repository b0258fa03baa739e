"""GPU backends behind the GpuBackend seam, and the choice between them."""

from __future__ import annotations

from services.nodeagent.gpus.backend import GpuBackend, GpuProcess, HealthEvent
from services.nodeagent.gpus.nvml import NvmlGpuBackend, NvmlInitError
from services.nodeagent.gpus.simulated import SimulatedGpuBackend


def backend_for(
    node_name: str,
    simulate: str,
    sysfs_root: str = "/sys",
    simulate_driver_dir: str = "",
    simulate_mig: str = "",
) -> GpuBackend:
    """Simulated GPUs when `simulate` is set (showing the processes of the simulated CUDA
    driver whose state lives in `simulate_driver_dir`, if given, and starting with the MIG
    geometry `simulate_mig`), else NVML (NvmlInitError when it cannot start)."""
    if simulate:
        return SimulatedGpuBackend(
            node_name, simulate, driver_state_dir=simulate_driver_dir, mig_geometry=simulate_mig
        )
    try:
        import pynvml
    except ImportError as exc:  # a broken install, not a node without GPUs
        raise NvmlInitError(f"the pynvml module (nvidia-ml-py) is not installed: {exc}") from exc
    backend = NvmlGpuBackend(pynvml, sysfs_root)
    backend.open()
    return backend


__all__ = [
    "GpuBackend",
    "GpuProcess",
    "HealthEvent",
    "NvmlGpuBackend",
    "NvmlInitError",
    "SimulatedGpuBackend",
    "backend_for",
]
