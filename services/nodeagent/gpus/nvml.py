"""Real GPUs through NVML (the `pynvml` module of nvidia-ml-py), behind the GpuBackend seam.

The NVML module is a constructor argument: production passes `pynvml`, tests pass a
pynvml-compatible simulated module, so the very same code runs in both. Static facts (UUID,
model, memory, SMs, PCI, NUMA, compute capability, NVLink) are read once at open; health
and utilisation are read on every call, and so are MIG mode and the MIG devices of a GPU in
MIG mode (nvml_mig.py), since instances come and go under the agent (dynamic MIG, mig-parted,
`nvidia-smi mig`). A GPU that stops answering (lost, or gone from the device list) stays
listed as unhealthy, so the kubelet sees it go Unhealthy rather than vanish.

It is a MigControl: dynamic MIG creates and destroys instances through NVML's MIG calls.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec

from services.common.schemas import GpuDevice, GpuUsage, MigDevice
from services.nodeagent.gpus.backend import GpuProcess, HealthEvent, MigError
from services.nodeagent.gpus.nvml_mig import NO_INSTANCE, NvmlMig

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
    # Its MIG devices when last listed: kept when a listing fails, so a passing NVML error
    # does not make the kubelet see them vanish.
    mig_devices: list[MigDevice] = field(default_factory=list)


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
        self._mig = NvmlMig(nvml)

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
            mig_mode=self._mig.mode(handle)[0],
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
            if gpu.lost:
                found.append(msgspec.structs.replace(gpu.device, healthy=False))
                continue
            mig_mode = self._mig.mode(gpu.handle)[0]
            found.append(
                msgspec.structs.replace(
                    gpu.device,
                    mig_mode=mig_mode,
                    mig_devices=self._list_mig(gpu) if mig_mode else [],
                )
            )
        return found

    def _list_mig(self, gpu: _Gpu) -> list[MigDevice]:
        """The GPU's MIG devices now, or as last listed when NVML cannot say (logged)."""
        try:
            gpu.mig_devices = self._mig.devices(gpu.handle, gpu.device.uuid)
        except MigError as exc:
            log.warning(
                "cannot list MIG devices; keeping the last listing",
                extra={"gpu": gpu.device.uuid, "reason": str(exc)},
            )
        return gpu.mig_devices

    # -- MigControl (NVML's MIG calls; MigError with NVML's reason when refused) -------------

    def _gpu_of(self, gpu_uuid: str) -> _Gpu:
        with self._lock:
            gpu = next((g for g in self._gpus if g.device.uuid == gpu_uuid), None)
        if gpu is None:
            raise MigError("not_found", f"no GPU with uuid {gpu_uuid!r} on this node")
        if gpu.lost:
            raise MigError("nvml_error", f"GPU {gpu_uuid} stopped answering")
        return gpu

    def set_mig_mode(self, gpu_uuid: str, enabled: bool) -> None:
        """MIG mode on or off; where the driver cannot reset the GPU itself the change waits
        for a reset (logged; devices() keeps showing the current mode until then)."""
        gpu = self._gpu_of(gpu_uuid)
        self._mig.set_mode(gpu.handle, gpu_uuid, enabled)
        # NVML may reset the GPU to apply the mode, and a reset may renew its handle.
        gpu.handle = self._optional(
            lambda: self._nvml.nvmlDeviceGetHandleByUUID(gpu_uuid), gpu.handle
        )

    def create_gpu_instance(self, gpu_uuid: str, profile: str, start: int = -1) -> int:
        return self._mig.create_gpu_instance(
            self._gpu_of(gpu_uuid).handle, gpu_uuid, profile, start
        )

    def destroy_gpu_instance(self, gpu_uuid: str, gi_id: int) -> None:
        self._mig.destroy_gpu_instance(self._gpu_of(gpu_uuid).handle, gpu_uuid, gi_id)

    def create_compute_instance(self, gpu_uuid: str, gi_id: int, slices: int = 0) -> int:
        return self._mig.create_compute_instance(
            self._gpu_of(gpu_uuid).handle, gpu_uuid, gi_id, slices
        )

    def destroy_compute_instance(self, gpu_uuid: str, gi_id: int, ci_id: int) -> None:
        self._mig.destroy_compute_instance(self._gpu_of(gpu_uuid).handle, gpu_uuid, gi_id, ci_id)

    def mig_devices(self, gpu_uuid: str) -> list[MigDevice]:
        """The GPU's MIG devices as NVML lists them now (none with MIG mode off)."""
        gpu = self._gpu_of(gpu_uuid)
        if not self._mig.mode(gpu.handle)[0]:
            return []
        gpu.mig_devices = self._mig.devices(gpu.handle, gpu_uuid)
        return list(gpu.mig_devices)

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
        return HealthEvent(uuid=self._uuid_of_event(data), xid=int(data.eventData))

    def _uuid_of_event(self, data: Any) -> str:
        """The MIG device an event names by its GI and CI IDs (a GPU in MIG mode), else the
        GPU, else "" (every GPU)."""
        uuid = self._uuid_of_handle(data.device)
        gi_id = int(getattr(data, "gpuInstanceId", NO_INSTANCE))
        ci_id = int(getattr(data, "computeInstanceId", NO_INSTANCE))
        if not uuid or gi_id == NO_INSTANCE or ci_id == NO_INSTANCE:
            return uuid
        with self._lock:
            gpu = next((g for g in self._gpus if g.device.uuid == uuid), None)
        for device in gpu.mig_devices if gpu is not None else []:
            if (device.gi_id, device.ci_id) == (gi_id, ci_id):
                return device.uuid
        return uuid  # an instance not listed yet: the whole GPU, to be safe

    def _uuid_of_handle(self, handle: Any) -> str:
        """The GPU an event names; "" (every GPU) when NVML gives no device, as NVIDIA does."""
        if handle is None:
            return ""
        try:
            return _text(self._nvml.nvmlDeviceGetUUID(handle))
        except self._nvml.NVMLError:
            return ""
