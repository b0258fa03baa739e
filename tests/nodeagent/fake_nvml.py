"""A simulated NVML: a pynvml-compatible module object for machines without GPUs.

It raises pynvml's own NVMLError classes with NVML's error codes and returns the same shapes
(bytes for strings, ctypes-like attribute objects), so `NvmlGpuBackend` runs unchanged on it.
"""

from __future__ import annotations

import queue
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pynvml

MIB = 1024 * 1024


@dataclass
class FakeGpu:
    uuid: str
    name: str = "NVIDIA A100-SXM4-40GB"
    memory_mib: int = 40960
    compute_capability: tuple[int, int] = (8, 0)
    bus_id: str = "00000000:07:00.0"
    multiprocessors: int | None = 108  # None: nvmlDeviceGetAttributes NOT_SUPPORTED
    cuda_cores: int = 6912
    mig_enabled: bool = False
    nvlinks: list[str] = field(default_factory=list)  # remote bus ids of active links
    used_mib: int = 0
    sm_util: int = 0
    memory_util: int = 0
    processes: list[tuple[int, int | None]] = field(default_factory=list)  # (pid, used MiB)
    samples: list[tuple[int, int, int]] = field(default_factory=list)  # (pid, sm%, timestamp)
    lost: bool = False


class FakeNvml:
    """Use as the `nvml` argument of NvmlGpuBackend."""

    NVMLError = pynvml.NVMLError
    NVML_ERROR_TIMEOUT = pynvml.NVML_ERROR_TIMEOUT
    NVML_ERROR_NOT_SUPPORTED = pynvml.NVML_ERROR_NOT_SUPPORTED
    NVML_ERROR_GPU_IS_LOST = pynvml.NVML_ERROR_GPU_IS_LOST
    NVML_ERROR_NOT_FOUND = pynvml.NVML_ERROR_NOT_FOUND
    NVML_ERROR_INVALID_ARGUMENT = pynvml.NVML_ERROR_INVALID_ARGUMENT
    NVML_FEATURE_ENABLED = pynvml.NVML_FEATURE_ENABLED
    NVML_NVLINK_MAX_LINKS = 18
    NVML_DEVICE_MIG_ENABLE = pynvml.NVML_DEVICE_MIG_ENABLE
    nvmlEventTypeXidCriticalError = pynvml.nvmlEventTypeXidCriticalError

    def __init__(
        self,
        gpus: list[FakeGpu],
        *,
        driver: str = "550.54.15",
        cuda: int = 12040,
        init_error: int | None = None,
    ) -> None:
        self.gpus = gpus
        self.driver = driver
        self.cuda = cuda
        self.init_error = init_error
        self.initialised = False
        self.events: queue.Queue[tuple[FakeGpu | None, int]] = queue.Queue()
        self.registered: list[FakeGpu] = []

    # -- test controls ---------------------------------------------------------------------

    def xid(self, gpu: FakeGpu | None, xid: int) -> None:
        self.events.put((gpu, xid))

    # -- helpers ---------------------------------------------------------------------------

    def _check(self) -> None:
        if not self.initialised:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_UNINITIALIZED)

    def _gpu(self, handle: FakeGpu) -> FakeGpu:
        self._check()
        if handle.lost:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_GPU_IS_LOST)
        return handle

    # -- the pynvml surface the backend uses -------------------------------------------------

    def nvmlInit(self) -> None:
        if self.init_error is not None:
            raise pynvml.NVMLError(self.init_error)
        self.initialised = True

    def nvmlShutdown(self) -> None:
        self._check()
        self.initialised = False

    def nvmlSystemGetDriverVersion(self) -> bytes:
        self._check()
        return self.driver.encode()

    def nvmlSystemGetCudaDriverVersion(self) -> int:
        self._check()
        return self.cuda

    def nvmlDeviceGetCount(self) -> int:
        self._check()
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> FakeGpu:
        self._check()
        if not 0 <= index < len(self.gpus):
            raise pynvml.NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return self._gpu(self.gpus[index])

    def nvmlDeviceGetHandleByUUID(self, uuid: str | bytes) -> FakeGpu:
        self._check()
        wanted = uuid.decode() if isinstance(uuid, bytes) else uuid
        for gpu in self.gpus:
            if gpu.uuid == wanted:
                return self._gpu(gpu)
        raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_FOUND)

    def nvmlDeviceGetUUID(self, handle: FakeGpu) -> bytes:
        return self._gpu(handle).uuid.encode()

    def nvmlDeviceGetName(self, handle: FakeGpu) -> str:
        return self._gpu(handle).name

    def nvmlDeviceGetMemoryInfo(self, handle: FakeGpu) -> Any:
        gpu = self._gpu(handle)
        total = gpu.memory_mib * MIB
        used = gpu.used_mib * MIB
        return SimpleNamespace(total=total, used=used, free=total - used)

    def nvmlDeviceGetCudaComputeCapability(self, handle: FakeGpu) -> tuple[int, int]:
        return self._gpu(handle).compute_capability

    def nvmlDeviceGetPciInfo(self, handle: FakeGpu) -> Any:
        return SimpleNamespace(busId=self._gpu(handle).bus_id.encode())

    def nvmlDeviceGetMigMode(self, handle: FakeGpu) -> tuple[int, int]:
        mode = int(self._gpu(handle).mig_enabled)
        return (mode, mode)

    def nvmlDeviceGetAttributes(self, handle: FakeGpu) -> Any:
        gpu = self._gpu(handle)
        if gpu.multiprocessors is None:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return SimpleNamespace(multiprocessorCount=gpu.multiprocessors)

    def nvmlDeviceGetNumGpuCores(self, handle: FakeGpu) -> int:
        return self._gpu(handle).cuda_cores

    def nvmlDeviceGetNvLinkState(self, handle: FakeGpu, link: int) -> int:
        gpu = self._gpu(handle)
        if link >= len(gpu.nvlinks):
            raise pynvml.NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return pynvml.NVML_FEATURE_ENABLED

    def nvmlDeviceGetNvLinkRemotePciInfo(self, handle: FakeGpu, link: int) -> Any:
        return SimpleNamespace(busId=self._gpu(handle).nvlinks[link].encode())

    def nvmlDeviceGetUtilizationRates(self, handle: FakeGpu) -> Any:
        gpu = self._gpu(handle)
        return SimpleNamespace(gpu=gpu.sm_util, memory=gpu.memory_util)

    def nvmlDeviceGetComputeRunningProcesses(self, handle: FakeGpu) -> list[Any]:
        gpu = self._gpu(handle)
        return [
            SimpleNamespace(pid=pid, usedGpuMemory=None if used is None else used * MIB)
            for pid, used in gpu.processes
        ]

    def nvmlDeviceGetProcessUtilization(self, handle: FakeGpu, since: int) -> list[Any]:
        gpu = self._gpu(handle)
        fresh = [s for s in gpu.samples if s[2] > since]
        if not fresh:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_FOUND)
        return [SimpleNamespace(pid=p, smUtil=sm, memUtil=0, timeStamp=t) for p, sm, t in fresh]

    def nvmlEventSetCreate(self) -> object:
        self._check()
        return object()

    def nvmlDeviceRegisterEvents(self, handle: FakeGpu, types: int, event_set: object) -> None:
        assert types == pynvml.nvmlEventTypeXidCriticalError
        self.registered.append(self._gpu(handle))

    def nvmlEventSetWait_v2(self, event_set: object, timeout_ms: int) -> Any:
        self._check()
        try:
            gpu, xid = self.events.get(timeout=timeout_ms / 1000)
        except queue.Empty:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_TIMEOUT) from None
        return SimpleNamespace(
            device=gpu, eventType=pynvml.nvmlEventTypeXidCriticalError, eventData=xid
        )

    def nvmlEventSetFree(self, event_set: object) -> None:
        self._check()
