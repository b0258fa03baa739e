"""A simulated NVML: a pynvml-compatible module object for machines without GPUs.

It raises pynvml's own NVMLError classes with NVML's error codes and returns the same shapes
(bytes for strings, ctypes-like attribute objects), so `NvmlGpuBackend` runs unchanged on it.

MIG follows NVML's MIG API (mode with a pending state, GPU-instance and compute-instance
profiles by NVML's profile constants, possible placements, create/destroy, MIG device
handles by index, per-instance XIDs). Its state and rules are the simulated GPUs' own
(gpus/sim_mig.py on services/common/mig.py's tables), with their refusals raised as the
NVMLError NVML returns for each.
"""

from __future__ import annotations

import queue
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pynvml

from services.common import mig
from services.nodeagent.gpus.sim_mig import GpuInstanceView, MigError, SimulatedMig

MIB = 1024 * 1024
NO_INSTANCE = 0xFFFFFFFF
# NVML's GPU-instance profile constants -> the profile IDs of services/common/mig.py's tables.
GI_PROFILE_IDS = {
    pynvml.NVML_GPU_INSTANCE_PROFILE_1_SLICE: 19,
    pynvml.NVML_GPU_INSTANCE_PROFILE_1_SLICE_REV1: 20,
    pynvml.NVML_GPU_INSTANCE_PROFILE_1_SLICE_REV2: 15,
    pynvml.NVML_GPU_INSTANCE_PROFILE_2_SLICE: 14,
    pynvml.NVML_GPU_INSTANCE_PROFILE_3_SLICE: 9,
    pynvml.NVML_GPU_INSTANCE_PROFILE_4_SLICE: 5,
    pynvml.NVML_GPU_INSTANCE_PROFILE_7_SLICE: 0,
}
# NVML's compute-instance profile constants (also their IDs) -> compute slices.
CI_SLICES = {
    pynvml.NVML_COMPUTE_INSTANCE_PROFILE_1_SLICE: 1,
    pynvml.NVML_COMPUTE_INSTANCE_PROFILE_2_SLICE: 2,
    pynvml.NVML_COMPUTE_INSTANCE_PROFILE_3_SLICE: 3,
    pynvml.NVML_COMPUTE_INSTANCE_PROFILE_4_SLICE: 4,
    pynvml.NVML_COMPUTE_INSTANCE_PROFILE_7_SLICE: 7,
}
# The simulated MIG's refusal codes -> NVML's return codes.
NVML_CODES = {
    "not_supported": pynvml.NVML_ERROR_NOT_SUPPORTED,
    "invalid_argument": pynvml.NVML_ERROR_INVALID_ARGUMENT,
    "insufficient_resources": pynvml.NVML_ERROR_INSUFFICIENT_RESOURCES,
    "in_use": pynvml.NVML_ERROR_IN_USE,
    "not_found": pynvml.NVML_ERROR_NOT_FOUND,
}


@dataclass
class FakeGpu:
    uuid: str
    name: str = "NVIDIA A100-SXM4-40GB"
    memory_mib: int = 40960
    compute_capability: tuple[int, int] = (8, 0)
    bus_id: str = "00000000:07:00.0"
    multiprocessors: int | None = 108  # None: nvmlDeviceGetAttributes NOT_SUPPORTED
    cuda_cores: int = 6912
    mig_enabled: bool = False  # MIG mode at start (FakeNvml.mig holds it from then on)
    nvlinks: list[str] = field(default_factory=list)  # remote bus ids of active links
    used_mib: int = 0
    sm_util: int = 0
    memory_util: int = 0
    processes: list[tuple[int, int | None]] = field(default_factory=list)  # (pid, used MiB)
    samples: list[tuple[int, int, int]] = field(default_factory=list)  # (pid, sm%, timestamp)
    lost: bool = False
    mig_reset_required: bool = False  # nvmlDeviceSetMigMode leaves the change pending
    mig_root: bool = True  # False: MIG changes fail NO_PERMISSION (an unprivileged agent)
    profile_info_v2: bool = True  # False: an old driver without the V entry points
    mig_listing_error: int | None = None  # NVML error code that listing MIG devices fails with


@dataclass(eq=False)
class FakeMigDevice:
    """A MIG device handle (nvmlDeviceGetMigDeviceHandleByIndex)."""

    parent: FakeGpu
    gi_id: int
    ci_id: int
    uuid: str


@dataclass(eq=False)
class FakeGpuInstance:
    parent: FakeGpu
    gi_id: int


@dataclass(eq=False)
class FakeComputeInstance:
    gi: FakeGpuInstance
    ci_id: int


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

    def __getattr__(self, name: str) -> Any:
        # pynvml's constants and ctypes structures (NVML_ERROR_*, NVML_GPU_INSTANCE_PROFILE_*,
        # c_nvmlGpuInstancePlacement_t, ...), never its functions: an nvml* call the backend
        # makes must be one this double implements.
        if name.startswith(("NVML_", "c_nvml")):
            return getattr(pynvml, name)
        raise AttributeError(name)

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
        self.sessions = 0  # NVML counts nvmlInit calls; the last nvmlShutdown ends it
        self.events: queue.Queue[tuple[FakeGpu | None, int, int, int]] = queue.Queue()
        self.registered: list[FakeGpu] = []
        self.mig = SimulatedMig()
        self.pending_mig: dict[str, bool] = {}  # GPU UUID -> mode after the next reset
        self.busy: set[str] = set()  # MIG UUIDs with processes: their CI cannot be destroyed
        for gpu in gpus:
            self.mig.add_gpu(gpu.uuid, gpu.name, gpu.multiprocessors or gpu.cuda_cores // 64)
            if gpu.mig_enabled:
                self.mig.set_mig_mode(gpu.uuid, True)

    # -- test controls ---------------------------------------------------------------------

    def xid(
        self, gpu: FakeGpu | None, xid: int, gi_id: int = NO_INSTANCE, ci_id: int = NO_INSTANCE
    ) -> None:
        self.events.put((gpu, xid, gi_id, ci_id))

    def partition(self, gpu: FakeGpu, profiles: list[str]) -> None:
        """MIG mode on and one full compute instance per listed GI, as mig-parted does."""
        self.mig.apply_geometry(gpu.uuid, profiles)

    def reset(self, gpu: FakeGpu) -> None:
        """A GPU reset: a pending MIG mode takes effect."""
        if gpu.uuid in self.pending_mig:
            self.mig.set_mig_mode(gpu.uuid, self.pending_mig.pop(gpu.uuid))

    def gpu_instances(self, gpu: FakeGpu) -> list[GpuInstanceView]:
        return self.mig.gpu_instances(gpu.uuid)

    # -- helpers ---------------------------------------------------------------------------

    @property
    def initialised(self) -> bool:
        return self.sessions > 0

    def _check(self) -> None:
        if not self.initialised:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_UNINITIALIZED)

    def _gpu(self, handle: FakeGpu) -> FakeGpu:
        self._check()
        if not isinstance(handle, FakeGpu):
            raise pynvml.NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        if handle.lost:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_GPU_IS_LOST)
        return handle

    def _mig_on(self, handle: FakeGpu) -> FakeGpu:
        """The GPU, which must be in MIG mode (else NOT_SUPPORTED, as NVML answers)."""
        gpu = self._gpu(handle)
        if not self.mig.mig_mode(gpu.uuid):
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return gpu

    def _changing(self, handle: FakeGpu) -> FakeGpu:
        gpu = self._mig_on(handle)
        if not gpu.mig_root:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NO_PERMISSION)
        return gpu

    def _view(self, gi: FakeGpuInstance) -> GpuInstanceView:
        self._mig_on(gi.parent)
        for view in self.mig.gpu_instances(gi.parent.uuid):
            if view.gi_id == gi.gi_id:
                return view
        raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_FOUND)

    def _mig_device(self, handle: FakeMigDevice) -> FakeMigDevice:
        """A MIG device handle whose compute instance still exists."""
        self._gpu(handle.parent)
        if handle.uuid not in {d.uuid for d in self.mig.devices(handle.parent.uuid)}:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return handle

    def _profile(self, gpu: FakeGpu, profile_id: int) -> mig.GiProfile:
        for profile in mig.profiles_for(gpu.name):
            if profile.profile_id == profile_id:
                return profile
        raise pynvml.NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)

    @staticmethod
    def _nvml_error(refused: MigError) -> pynvml.NVMLError:
        return pynvml.NVMLError(NVML_CODES.get(refused.code, pynvml.NVML_ERROR_UNKNOWN))

    # -- the pynvml surface the backend uses -------------------------------------------------

    def nvmlInit(self) -> None:
        if self.init_error is not None:
            raise pynvml.NVMLError(self.init_error)
        self.sessions += 1

    def nvmlShutdown(self) -> None:
        self._check()
        self.sessions -= 1

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

    def nvmlDeviceGetUUID(self, handle: FakeGpu | FakeMigDevice) -> bytes:
        if isinstance(handle, FakeMigDevice):
            return self._mig_device(handle).uuid.encode()
        return self._gpu(handle).uuid.encode()

    def nvmlDeviceGetName(self, handle: FakeGpu) -> str:
        return self._gpu(handle).name

    def nvmlDeviceGetMemoryInfo(self, handle: FakeGpu | FakeMigDevice) -> Any:
        if isinstance(handle, FakeMigDevice):
            view = self._view(FakeGpuInstance(handle.parent, self._mig_device(handle).gi_id))
            total = view.profile.memory_mib * MIB
            return SimpleNamespace(total=total, used=0, free=total)
        gpu = self._gpu(handle)
        total = gpu.memory_mib * MIB
        used = gpu.used_mib * MIB
        return SimpleNamespace(total=total, used=used, free=total - used)

    def nvmlDeviceGetCudaComputeCapability(self, handle: FakeGpu) -> tuple[int, int]:
        return self._gpu(handle).compute_capability

    def nvmlDeviceGetPciInfo(self, handle: FakeGpu) -> Any:
        return SimpleNamespace(busId=self._gpu(handle).bus_id.encode())

    def nvmlDeviceGetMigMode(self, handle: FakeGpu) -> list[int]:
        gpu = self._gpu(handle)
        if not mig.mig_capable(gpu.name):
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
        current = self.mig.mig_mode(gpu.uuid)
        return [int(current), int(self.pending_mig.get(gpu.uuid, current))]

    def nvmlDeviceSetMigMode(self, handle: FakeGpu, mode: int) -> int:
        """The activation status: NVML_SUCCESS, or RESET_REQUIRED when the change waits."""
        gpu = self._gpu(handle)
        if not mig.mig_capable(gpu.name):
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
        if not gpu.mig_root:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NO_PERMISSION)
        enabled = mode == pynvml.NVML_DEVICE_MIG_ENABLE
        if not enabled and self.mig.gpu_instances(gpu.uuid):
            raise pynvml.NVMLError(pynvml.NVML_ERROR_IN_USE)
        if gpu.mig_reset_required:
            self.pending_mig[gpu.uuid] = enabled
            return pynvml.NVML_ERROR_RESET_REQUIRED
        self.mig.set_mig_mode(gpu.uuid, enabled)
        return pynvml.NVML_SUCCESS

    def nvmlDeviceGetGpuInstanceProfileInfo(
        self, handle: FakeGpu, profile: int, version: int = 2
    ) -> Any:
        gpu = self._mig_on(handle)
        if version == 2 and not gpu.profile_info_v2:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_FUNCTION_NOT_FOUND)
        if not 0 <= profile < pynvml.NVML_GPU_INSTANCE_PROFILE_COUNT:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        if profile not in GI_PROFILE_IDS:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
        found = self._profile(gpu, GI_PROFILE_IDS[profile])
        info = SimpleNamespace(
            id=found.profile_id,
            isP2pSupported=0,
            sliceCount=found.slices,
            instanceCount=found.max_count,
            multiprocessorCount=found.sm_count(gpu.multiprocessors or 0),
            memorySizeMB=found.memory_mib,
        )
        if version == 2:
            info.name = f"MIG {found.name}".encode()
        return info

    def nvmlDeviceGetGpuInstancePossiblePlacements(
        self, handle: FakeGpu, profile_id: int, placements: Any, count: Any
    ) -> int:
        found = self._profile(self._mig_on(handle), profile_id)
        capacity = count._obj  # a byref(c_uint), as pynvml's callers pass it
        if capacity.value < len(found.starts):
            raise pynvml.NVMLError(pynvml.NVML_ERROR_INSUFFICIENT_SIZE)
        for index, start in enumerate(found.starts):
            placements[index].start = start
            placements[index].size = found.memory_slices
        capacity.value = len(found.starts)
        return pynvml.NVML_SUCCESS

    def nvmlDeviceCreateGpuInstance(self, handle: FakeGpu, profile_id: int) -> FakeGpuInstance:
        gpu = self._changing(handle)
        profile = self._profile(gpu, profile_id)
        try:
            gi_id = self.mig.create_gpu_instance(gpu.uuid, profile.name)
        except MigError as refused:
            raise self._nvml_error(refused) from None
        return FakeGpuInstance(gpu, gi_id)

    def nvmlDeviceCreateGpuInstanceWithPlacement(
        self, handle: FakeGpu, profile_id: int, placement: Any
    ) -> FakeGpuInstance:
        gpu = self._changing(handle)
        profile = self._profile(gpu, profile_id)
        where = placement._obj  # pynvml passes the pointer through: callers give byref(...)
        if not isinstance(where, pynvml.c_nvmlGpuInstancePlacement_t):
            raise pynvml.NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        if where.start not in profile.starts or where.size != profile.memory_slices:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        try:
            gi_id = self.mig.create_gpu_instance(gpu.uuid, profile.name, where.start)
        except MigError as refused:
            raise self._nvml_error(refused) from None
        return FakeGpuInstance(gpu, gi_id)

    def nvmlDeviceGetGpuInstanceById(self, handle: FakeGpu, gi_id: int) -> FakeGpuInstance:
        gi = FakeGpuInstance(self._mig_on(handle), gi_id)
        self._view(gi)
        return gi

    def nvmlGpuInstanceGetInfo(self, gi: FakeGpuInstance) -> Any:
        view = self._view(gi)
        return SimpleNamespace(
            device=gi.parent,
            id=view.gi_id,
            profileId=view.profile.profile_id,
            placement=SimpleNamespace(start=view.start, size=view.profile.memory_slices),
        )

    def nvmlGpuInstanceDestroy(self, gi: FakeGpuInstance) -> int:
        self._changing(gi.parent)
        try:
            self.mig.destroy_gpu_instance(gi.parent.uuid, gi.gi_id)
        except MigError as refused:
            raise self._nvml_error(refused) from None
        return pynvml.NVML_SUCCESS

    def nvmlGpuInstanceGetComputeInstanceProfileInfo(
        self, gi: FakeGpuInstance, profile: int, engine: int, version: int = 2
    ) -> Any:
        view = self._view(gi)
        if version == 2 and not gi.parent.profile_info_v2:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_FUNCTION_NOT_FOUND)
        if engine != pynvml.NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        sizes = mig.compute_instance_sizes(view.profile)
        slices = CI_SLICES.get(profile)
        if slices not in sizes:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return SimpleNamespace(
            id=profile,
            sliceCount=slices,
            instanceCount=sizes[slices],
            multiprocessorCount=(gi.parent.multiprocessors or 0) * slices // mig.COMPUTE_SLICES,
        )

    def nvmlGpuInstanceCreateComputeInstance(
        self, gi: FakeGpuInstance, profile_id: int
    ) -> FakeComputeInstance:
        self._changing(gi.parent)
        self._view(gi)
        if profile_id not in CI_SLICES:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        try:
            ci_id = self.mig.create_compute_instance(
                gi.parent.uuid, gi.gi_id, CI_SLICES[profile_id]
            )
        except MigError as refused:
            raise self._nvml_error(refused) from None
        return FakeComputeInstance(gi, ci_id)

    def nvmlGpuInstanceGetComputeInstanceById(
        self, gi: FakeGpuInstance, ci_id: int
    ) -> FakeComputeInstance:
        if ci_id not in self._view(gi).compute_instances:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_FOUND)
        return FakeComputeInstance(gi, ci_id)

    def nvmlComputeInstanceGetInfo(self, ci: FakeComputeInstance) -> Any:
        view = self._view(ci.gi)
        if ci.ci_id not in view.compute_instances:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_FOUND)
        slices, _ = view.compute_instances[ci.ci_id]
        return SimpleNamespace(
            device=ci.gi.parent,
            gpuInstance=ci.gi,
            id=ci.ci_id,
            profileId=next(c for c, n in CI_SLICES.items() if n == slices),
        )

    def nvmlComputeInstanceDestroy(self, ci: FakeComputeInstance) -> int:
        self._changing(ci.gi.parent)
        view = self._view(ci.gi)
        held = view.compute_instances.get(ci.ci_id)
        if held is not None and held[1] in self.busy:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_IN_USE)  # processes still run on it
        try:
            self.mig.destroy_compute_instance(ci.gi.parent.uuid, ci.gi.gi_id, ci.ci_id)
        except MigError as refused:
            raise self._nvml_error(refused) from None
        return pynvml.NVML_SUCCESS

    def nvmlDeviceGetMaxMigDeviceCount(self, handle: FakeGpu) -> int:
        gpu = self._gpu(handle)
        if not mig.mig_capable(gpu.name):
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
        if gpu.mig_listing_error is not None:
            raise pynvml.NVMLError(gpu.mig_listing_error)
        return mig.COMPUTE_SLICES

    def nvmlDeviceGetMigDeviceHandleByIndex(self, handle: FakeGpu, index: int) -> FakeMigDevice:
        gpu = self._mig_on(handle)
        devices = self.mig.devices(gpu.uuid)
        if not 0 <= index < len(devices):
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_FOUND)
        device = devices[index]
        return FakeMigDevice(gpu, device.gi_id, device.ci_id, device.uuid)

    def nvmlDeviceGetGpuInstanceId(self, handle: FakeMigDevice) -> int:
        if not isinstance(handle, FakeMigDevice):
            raise pynvml.NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return self._mig_device(handle).gi_id

    def nvmlDeviceGetComputeInstanceId(self, handle: FakeMigDevice) -> int:
        if not isinstance(handle, FakeMigDevice):
            raise pynvml.NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return self._mig_device(handle).ci_id

    def nvmlDeviceGetAttributes(self, handle: FakeGpu | FakeMigDevice) -> Any:
        if isinstance(handle, FakeMigDevice):
            device = self._mig_device(handle)
            view = self._view(FakeGpuInstance(device.parent, device.gi_id))
            slices, _ = view.compute_instances[device.ci_id]
            return SimpleNamespace(
                multiprocessorCount=(device.parent.multiprocessors or 0)
                * slices
                // mig.COMPUTE_SLICES,
                gpuInstanceSliceCount=view.profile.slices,
                computeInstanceSliceCount=slices,
                memorySizeMB=view.profile.memory_mib,
            )
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
        if self.mig.mig_mode(gpu.uuid):
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)  # none for MIG-mode GPUs
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
            gpu, xid, gi_id, ci_id = self.events.get(timeout=timeout_ms / 1000)
        except queue.Empty:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_TIMEOUT) from None
        return SimpleNamespace(
            device=gpu,
            eventType=pynvml.nvmlEventTypeXidCriticalError,
            eventData=xid,
            gpuInstanceId=gi_id,
            computeInstanceId=ci_id,
        )

    def nvmlEventSetFree(self, event_set: object) -> None:
        self._check()
