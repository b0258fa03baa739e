"""No GPUs: what an agent serves where NVML cannot start and `fail_on_init_error` is false.

The agent then stays up as a device plugin with nothing to offer (the kubelet sees the
resource with zero devices) and publishes an inventory without GPUs, so the node is known
and nothing is placed on it: 4paradigm's and NVIDIA's plugins with --fail-on-init-error=false.
"""

from __future__ import annotations

import time

from services.common.schemas import GpuDevice, GpuUsage
from services.nodeagent.gpus.backend import GpuProcess, HealthEvent


class NoGpuBackend:
    def __init__(self, reason: str) -> None:
        self.reason = reason  # why there are no GPUs, for logs

    def devices(self) -> list[GpuDevice]:
        return []

    def usage(self) -> list[GpuUsage]:
        return []

    def processes(self) -> list[GpuProcess]:
        return []

    def driver_version(self) -> str:
        return ""

    def cuda_version(self) -> str:
        return ""

    def wait_for_health_event(self, timeout_s: float) -> HealthEvent | None:
        time.sleep(min(timeout_s, 1.0))  # called from a worker thread: nothing ever happens
        return None

    def close(self) -> None:
        pass
