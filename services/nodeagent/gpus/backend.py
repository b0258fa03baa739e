"""The seam between the node agent and the GPUs it serves (NVML, or simulated)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from services.common.schemas import GpuDevice, GpuUsage, MigDevice


@dataclass(frozen=True)
class GpuProcess:
    """A compute process on a GPU as the driver sees it (host PID namespace)."""

    pid: int
    uuid: str
    memory_used_mib: int
    sm_util_percent: float = -1.0  # its share of the GPU's SM time; -1 = not sampled


@dataclass(frozen=True)
class HealthEvent:
    """An XID critical error; uuid "" means the driver did not say which GPU (all of them)."""

    uuid: str
    xid: int


class GpuBackend(Protocol):
    def devices(self) -> list[GpuDevice]:
        """Every GPU of the node, in index order, with its current health. A GPU that
        disappeared stays listed, unhealthy."""
        ...

    def usage(self) -> list[GpuUsage]:
        """Current utilisation of every GPU."""
        ...

    def processes(self) -> list[GpuProcess]:
        """Compute processes on every GPU, with host PIDs."""
        ...

    def driver_version(self) -> str: ...

    def cuda_version(self) -> str: ...

    def wait_for_health_event(self, timeout_s: float) -> HealthEvent | None:
        """Block (in a worker thread) up to `timeout_s` for the next XID critical error."""
        ...

    def close(self) -> None: ...


@runtime_checkable
class LoadSink(Protocol):
    """Optional, for backends that make up GPU load (simulated GPUs): the agent tells them
    which container holds which slice, so the load they report follows what really runs.
    Real GPUs measure their load and do not have these methods; the agent checks with
    isinstance and skips the calls otherwise."""

    def attach(self, key: str, gpu_uuid: str, memory_limit_mib: int, cores: int) -> None:
        """Container directory `key` holds a slice of `gpu_uuid` (memory_limit_mib 0 = the
        whole card, cores 0 = no compute limit). ValueError for an unknown GPU."""
        ...

    def detach(self, key: str) -> None:
        """Container directory `key` is gone (no-op if it held nothing)."""
        ...


class MigError(ValueError):
    """A refused MIG call, with the message naming why; `code` is the NVML error it stands
    for: not_supported | invalid_argument | insufficient_resources | in_use | not_found |
    no_permission | nvml_error (any other NVML failure)."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


@runtime_checkable
class MigControl(Protocol):
    """Optional, for backends that can partition GPUs with MIG (NVML's MIG calls). Refusals
    raise MigError (a ValueError) naming NVML's reason. The agent checks with isinstance."""

    def set_mig_mode(self, gpu_uuid: str, enabled: bool) -> None: ...

    def create_gpu_instance(self, gpu_uuid: str, profile: str, start: int = -1) -> int:
        """A GPU instance of `profile` (e.g. "1g.5gb") at memory slice `start` (-1: the
        backend's choice); its GI ID."""
        ...

    def destroy_gpu_instance(self, gpu_uuid: str, gi_id: int) -> None: ...

    def create_compute_instance(self, gpu_uuid: str, gi_id: int, slices: int = 0) -> int:
        """A compute instance of `slices` compute slices (0: the whole GI); its CI ID."""
        ...

    def destroy_compute_instance(self, gpu_uuid: str, gi_id: int, ci_id: int) -> None: ...

    def mig_devices(self, gpu_uuid: str) -> list[MigDevice]: ...
