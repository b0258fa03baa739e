"""Real GPUs through NVML (the `pynvml` module of nvidia-ml-py), behind the GpuBackend seam.

The NVML module is a constructor argument: production passes `pynvml`, tests pass a
pynvml-compatible simulated module, so the very same code runs in both. Static facts (UUID,
model, memory, SMs, PCI, NUMA, compute capability, MIG, NVLink) are read once at open; health
and utilisation are read on every call. A GPU that stops answering (lost, or gone from the
device list) stays listed as unhealthy, so the kubelet sees it go Unhealthy rather than vanish.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec

from services.common.schemas import GpuDevice, GpuUsage
from services.nodeagent.gpus.backend import GpuProcess, HealthEvent

log = logging.getLogger("vgpu.nodeagent")

MIB = 1024 * 1024

# CUDA cores per SM by compute capability, for drivers whose NVML does not report the
# multiprocessor count of a full GPU (nvmlDeviceGetAttributes is MIG-only there).
CORES_PER_SM: dict[str, int] = {
    "6.0": 64, "6.1": 128, "7.0": 64, "7.2": 64, "7.5": 64, "8.0": 64, "8.6": 128,
    "8.7": 128, "8.9": 128, "9.0": 128, "10.0": 128, "10.3": 128, "12.0": 128,
}  # fmt: skip


class NvmlInitError(RuntimeError):
    """NVML cannot start (no driver, no library, no permission); the message says which."""


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def sysfs_pci_address(nvml_bus_id: str) -> str:
    """NVML's "00000000:3B:00.0" as sysfs names it: "0000:3b:00.0" (4-digit domain)."""
    domain, _, rest = nvml_bus_id.strip().partition(":")
    if not rest:
        return nvml_bus_id.lower()
    return f"{domain[-4:].rjust(4, '0')}:{rest}".lower()


def numa_node_of(sysfs_root: Path, nvml_bus_id: str) -> int:
    """/sys/bus/pci/devices/<bus>/numa_node; -1 when the platform does not say."""
    path = sysfs_root / "bus" / "pci" / "devices" / sysfs_pci_address(nvml_bus_id) / "numa_node"
    try:
        value = int(path.read_text().strip())
    except (OSError, ValueError):
        return -1
    return value if value >= 0 else -1


def cuda_version_text(version: int) -> str:
    """NVML's integer CUDA version (12040) as "12.4"."""
    if version <= 0:
        return ""
    return f"{version // 1000}.{version % 1000 // 10}"


@dataclass
class _Gpu:
    device: GpuDevice
    handle: Any
    lost: bool = False


class NvmlGpuBackend:
    def __init__(self, nvml: Any, sysfs_root: str | Path = "/sys") -> None:
        self._nvml = nvml
        self._sysfs = Path(sysfs_root)
        self._gpus: list[_Gpu] = []
        self._driver = ""
        self._cuda = ""
        self._events: Any = None
        self._last_sample_ts: dict[str, int] = {}
        self._lock = threading.Lock()  # the health thread and the event loop both read _gpus
        self._open = False

    # -- lifecycle -------------------------------------------------------------------------

    def open(self) -> None:
        """Start NVML and read every GPU's facts; NvmlInitError with the reason on failure."""
        nvml = self._nvml
        try:
            nvml.nvmlInit()
        except Exception as exc:  # NVMLError, or OSError/NVMLError_LibraryNotFound
            raise NvmlInitError(
                f"cannot start NVML ({exc}): is the NVIDIA driver installed and is "
                "libnvidia-ml.so.1 visible to the agent (NVIDIA container runtime)?"
            ) from exc
        self._open = True
        try:
            self._driver = _text(nvml.nvmlSystemGetDriverVersion())
            self._cuda = cuda_version_text(self._optional(nvml.nvmlSystemGetCudaDriverVersion, 0))
            count = nvml.nvmlDeviceGetCount()
            handles = [nvml.nvmlDeviceGetHandleByIndex(index) for index in range(count)]
            devices = [self._describe(index, handle) for index, handle in enumerate(handles)]
            peers = self._nvlink_peers(handles, devices)
            self._gpus = [
                _Gpu(msgspec.structs.replace(device, nvlink_peers=peers[i]), handles[i])
                for i, device in enumerate(devices)
            ]
        except Exception as exc:
            self.close()
            raise NvmlInitError(f"NVML started but reading the GPUs failed: {exc}") from exc

    def close(self) -> None:
        if not self._open:
            return
        self._open = False
        if self._events is not None:
            self._optional(lambda: self._nvml.nvmlEventSetFree(self._events), None)
            self._events = None
        self._optional(self._nvml.nvmlShutdown, None)

    def _optional(self, call: Any, default: Any) -> Any:
        """`call()`, or `default` when NVML says the device or driver does not support it."""
        try:
            return call()
        except self._nvml.NVMLError:
            return default

    # -- static facts ----------------------------------------------------------------------

    def _describe(self, index: int, handle: Any) -> GpuDevice:
        nvml = self._nvml
        uuid = _text(nvml.nvmlDeviceGetUUID(handle))
        major, minor = self._optional(
            lambda: nvml.nvmlDeviceGetCudaComputeCapability(handle), (0, 0)
        )
        capability = f"{major}.{minor}" if major else ""
        bus_id = _text(self._optional(lambda: nvml.nvmlDeviceGetPciInfo(handle).busId, ""))
        mig = self._optional(lambda: nvml.nvmlDeviceGetMigMode(handle), (0, 0))
        return GpuDevice(
            uuid=uuid,
            index=index,
            model=_text(nvml.nvmlDeviceGetName(handle)),
            memory_mib=int(nvml.nvmlDeviceGetMemoryInfo(handle).total) // MIB,
            sm_count=self._sm_count(handle, capability),
            numa_node=numa_node_of(self._sysfs, bus_id) if bus_id else -1,
            healthy=True,
            pci_bus_id=bus_id,
            compute_capability=capability,
            mig_mode=bool(mig[0] == getattr(nvml, "NVML_DEVICE_MIG_ENABLE", 1)),
        )

    def _sm_count(self, handle: Any, capability: str) -> int:
        nvml = self._nvml
        attributes = self._optional(lambda: nvml.nvmlDeviceGetAttributes(handle), None)
        count = int(getattr(attributes, "multiprocessorCount", 0) or 0)
        if count > 0:
            return count
        cores = int(self._optional(lambda: nvml.nvmlDeviceGetNumGpuCores(handle), 0) or 0)
        per_sm = CORES_PER_SM.get(capability, 0)
        return cores // per_sm if cores and per_sm else 0

    def _nvlink_peers(self, handles: list[Any], devices: list[GpuDevice]) -> list[list[str]]:
        nvml = self._nvml
        by_bus = {sysfs_pci_address(d.pci_bus_id): d.uuid for d in devices if d.pci_bus_id}
        max_links = int(getattr(nvml, "NVML_NVLINK_MAX_LINKS", 18))
        enabled = getattr(nvml, "NVML_FEATURE_ENABLED", 1)
        found: list[list[str]] = []
        for handle, device in zip(handles, devices, strict=True):
            peers: list[str] = []
            for link in range(max_links):
                try:
                    if nvml.nvmlDeviceGetNvLinkState(handle, link) != enabled:
                        continue
                    remote = _text(nvml.nvmlDeviceGetNvLinkRemotePciInfo(handle, link).busId)
                except nvml.NVMLError:
                    break  # no NVLink, or past the device's last link
                peer = by_bus.get(sysfs_pci_address(remote))
                if peer and peer != device.uuid and peer not in peers:
                    peers.append(peer)  # an NVSwitch or the CPU is not a peer GPU
            found.append(peers)
        return found

    # -- GpuBackend ------------------------------------------------------------------------

    def devices(self) -> list[GpuDevice]:
        with self._lock:
            gpus = list(self._gpus)
        found = []
        for gpu in gpus:
            if not gpu.lost and not self._answers(gpu):
                gpu.lost = True
                log.error(
                    "GPU stopped answering; marking it unhealthy", extra={"gpu": gpu.device.uuid}
                )
            found.append(
                gpu.device if not gpu.lost else msgspec.structs.replace(gpu.device, healthy=False)
            )
        return found

    def _answers(self, gpu: _Gpu) -> bool:
        nvml = self._nvml
        try:
            handle = nvml.nvmlDeviceGetHandleByUUID(gpu.device.uuid)
            nvml.nvmlDeviceGetMemoryInfo(handle)
        except nvml.NVMLError:
            return False
        return True

    def usage(self) -> list[GpuUsage]:
        nvml = self._nvml
        found = []
        for gpu in self._live():
            try:
                memory = nvml.nvmlDeviceGetMemoryInfo(gpu.handle)
                rates = nvml.nvmlDeviceGetUtilizationRates(gpu.handle)
            except nvml.NVMLError:
                continue  # devices() will notice and mark it
            found.append(
                GpuUsage(
                    uuid=gpu.device.uuid,
                    memory_used_mib=int(memory.used) // MIB,
                    sm_util_percent=float(rates.gpu),
                    memory_util_percent=float(rates.memory),
                )
            )
        return found

    def processes(self) -> list[GpuProcess]:
        """Compute processes per GPU (host PIDs) with memory and, where sampled, SM share."""
        nvml = self._nvml
        found: list[GpuProcess] = []
        for gpu in self._live():
            uuid = gpu.device.uuid
            running = self._optional(
                lambda h=gpu.handle: nvml.nvmlDeviceGetComputeRunningProcesses(h), []
            )
            if not running:
                continue
            since = self._last_sample_ts.get(uuid, 0)
            samples = self._optional(
                lambda h=gpu.handle, t=since: nvml.nvmlDeviceGetProcessUtilization(h, t), []
            )
            sm_by_pid: dict[int, float] = {}
            for sample in samples or []:
                sm_by_pid[int(sample.pid)] = max(
                    sm_by_pid.get(int(sample.pid), 0.0), float(sample.smUtil)
                )
                self._last_sample_ts[uuid] = max(
                    self._last_sample_ts.get(uuid, 0), int(sample.timeStamp)
                )
            for process in running:
                used = process.usedGpuMemory
                found.append(
                    GpuProcess(
                        pid=int(process.pid),
                        uuid=uuid,
                        memory_used_mib=int(used) // MIB if used else 0,  # None: not reported
                        sm_util_percent=sm_by_pid.get(int(process.pid), -1.0),
                    )
                )
        return found

    def driver_version(self) -> str:
        return self._driver

    def cuda_version(self) -> str:
        return self._cuda

    def _live(self) -> list[_Gpu]:
        with self._lock:
            return [gpu for gpu in self._gpus if not gpu.lost]

    # -- health events -----------------------------------------------------------------------

    def wait_for_health_event(self, timeout_s: float) -> HealthEvent | None:
        """Block up to `timeout_s` for an XID critical error (call from a worker thread)."""
        nvml = self._nvml
        if self._events is None:
            self._events = nvml.nvmlEventSetCreate()
            for gpu in self._live():
                try:
                    nvml.nvmlDeviceRegisterEvents(
                        gpu.handle, nvml.nvmlEventTypeXidCriticalError, self._events
                    )
                except nvml.NVMLError as exc:  # e.g. NOT_SUPPORTED on some boards
                    log.warning(
                        "GPU cannot report XID events; health is by liveness only",
                        extra={"gpu": gpu.device.uuid, "error": str(exc)},
                    )
        try:
            data = nvml.nvmlEventSetWait_v2(self._events, int(timeout_s * 1000))
        except nvml.NVMLError as exc:
            if getattr(exc, "value", None) == nvml.NVML_ERROR_TIMEOUT:
                return None
            raise
        if data.eventType != nvml.nvmlEventTypeXidCriticalError:
            return None
        return HealthEvent(uuid=self._uuid_of_handle(data.device), xid=int(data.eventData))

    def _uuid_of_handle(self, handle: Any) -> str:
        """The GPU an event names; "" (every GPU) when NVML gives no device, as NVIDIA does."""
        if handle is None:
            return ""
        try:
            return _text(self._nvml.nvmlDeviceGetUUID(handle))
        except self._nvml.NVMLError:
            return ""
