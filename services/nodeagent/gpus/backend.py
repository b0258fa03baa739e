"""The seam between the node agent and the GPUs it serves (NVML later, simulated now)."""

from __future__ import annotations

from typing import Protocol

from services.common.schemas import GpuDevice, GpuUsage


class GpuBackend(Protocol):
    def devices(self) -> list[GpuDevice]:
        """Every GPU of the node, in index order, with its current health."""
        ...

    def usage(self) -> list[GpuUsage]:
        """Current utilisation of every GPU."""
        ...

    def driver_version(self) -> str: ...
