"""MIG on real GPUs through NVML's MIG API (pynvml): listing a GPU's MIG devices, and making
and removing GPU instances (GIs) and compute instances (CIs), for NvmlGpuBackend.

What NVML says is the truth here, not vgpu's tables (services/common/mig.py): profile names,
IDs, memory and allowed placements are read from the GPU (nvmlDeviceGetGpuInstanceProfileInfo,
nvmlDeviceGetGpuInstancePossiblePlacements), so a MIG part vgpu has no table for still lists
its MIG devices for the static strategies. A profile's name is the driver's ("MIG 1g.5gb",
version-2 profile info); drivers without it get the name NVIDIA's tools derive: compute
slices, then memory in GB rounded up to eighths of the card, then the profile's extension.

Every refusal is a MigError naming the GPU, the call and NVML's reason, with `code` the NVML
error it stands for (dynamic_mig.py retries an `in_use` destroy later and forgets a
`not_found` one). NVML's MIG calls need root on the host: `no_permission` says so.
"""

from __future__ import annotations

import ctypes
import logging
import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, TypeVar

from services.common.schemas import MigDevice
from services.nodeagent.gpus.backend import MigError

log = logging.getLogger("vgpu.nodeagent")

MIB = 1024 * 1024
# gpuInstanceId / computeInstanceId of an event that names no MIG device.
NO_INSTANCE = 0xFFFFFFFF
# Room for every placement NVML can list for one profile (8 memory slices at most today).
_MAX_PLACEMENTS = 32
_T = TypeVar("_T")

# NVML error name -> MigError code, and what it means for a MIG call.
_CODES = {
    "NVML_ERROR_NOT_SUPPORTED": ("not_supported", "not supported (is MIG mode on?)"),
    "NVML_ERROR_INVALID_ARGUMENT": ("invalid_argument", "invalid argument"),
    "NVML_ERROR_INSUFFICIENT_RESOURCES": (
        "insufficient_resources",
        "insufficient resources (those memory slices are taken, or the profile is at its "
        "maximum count)",
    ),
    "NVML_ERROR_IN_USE": ("in_use", "in use (processes or instances remain on it)"),
    "NVML_ERROR_NOT_FOUND": ("not_found", "not found"),
    "NVML_ERROR_NO_PERMISSION": (
        "no_permission",
        "insufficient permissions (NVML's MIG calls need root on the host: run the node "
        "agent privileged)",
    ),
}
# GI profile constant name -> the suffix NVIDIA's tools give its profiles (media engines).
_SUFFIXES = {
    "NVML_GPU_INSTANCE_PROFILE_1_SLICE_REV1": "+me",
    "NVML_GPU_INSTANCE_PROFILE_2_SLICE_REV1": "+me",
    "NVML_GPU_INSTANCE_PROFILE_1_SLICE_ALL_ME": "+me.all",
    "NVML_GPU_INSTANCE_PROFILE_2_SLICE_ALL_ME": "+me.all",
    "NVML_GPU_INSTANCE_PROFILE_1_SLICE_NO_ME": "-me",
    "NVML_GPU_INSTANCE_PROFILE_2_SLICE_NO_ME": "-me",
    "NVML_GPU_INSTANCE_PROFILE_1_SLICE_GFX": "+gfx",
    "NVML_GPU_INSTANCE_PROFILE_2_SLICE_GFX": "+gfx",
    "NVML_GPU_INSTANCE_PROFILE_3_SLICE_GFX": "+gfx",
    "NVML_GPU_INSTANCE_PROFILE_4_SLICE_GFX": "+gfx",
}


@dataclass(frozen=True)
class NvmlGiProfile:
    """One GPU-instance profile as this GPU's NVML reports it."""

    profile_id: int  # what nvmlDeviceCreateGpuInstance takes (19 for 1g.5gb on A100)
    name: str
    slices: int  # compute slices
    memory_mib: int
    max_count: int


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def derived_name(slices: int, memory_mib: int, card_mib: int, suffix: str = "") -> str:
    """A profile's name from its figures: `<slices>g.<GB>gb<suffix>`, GB being the profile's
    share of the card rounded up to eighths, times the card's size in whole GB (rounded up):
    4864 MiB of a 40960 MiB A100 is 1/8 of 40 GB, "1g.5gb"."""
    if card_mib <= 0:
        return f"{slices}g.{math.ceil(memory_mib / 1024)}gb{suffix}"
    eighths = math.ceil(memory_mib * 8 / card_mib - 1e-9)
    gigabytes = round(eighths * math.ceil(card_mib / 1024) / 8)
    return f"{slices}g.{gigabytes}gb{suffix}"


def driver_name(raw: Any) -> str:
    """The driver's profile name without its "MIG " prefix; "" when it gave none."""
    text = _text(raw or b"").strip()
    return text[4:].strip() if text.upper().startswith("MIG ") else text


class NvmlMig:
    """MIG listing and control of the GPUs of one NVML session (thread-safe as NVML is: the
    agent lists devices in worker threads while Allocate creates instances)."""

    def __init__(self, nvml: Any) -> None:
        self._nvml = nvml
        self._profiles: dict[str, dict[int, NvmlGiProfile]] = {}  # GPU UUID -> by profile ID
        self._placements: dict[tuple[str, int], list[tuple[int, int]]] = {}

    # -- errors ----------------------------------------------------------------------------

    def _meaning(self, exc: Exception) -> tuple[str, str]:
        """(MigError code, what it means) of an NVMLError."""
        value = getattr(exc, "value", None)
        for name, meaning in _CODES.items():
            if value is not None and value == getattr(self._nvml, name, None):
                return meaning
        return "nvml_error", str(exc)

    def _code(self, exc: Exception) -> str:
        return self._meaning(exc)[0]

    @contextmanager
    def _refusal(self, gpu_uuid: str, what: str) -> Iterator[None]:
        """NVMLError inside becomes MigError("<what> on <GPU>: NVML says <its meaning>")."""
        try:
            yield
        except self._nvml.NVMLError as exc:
            code, meaning = self._meaning(exc)
            raise MigError(code, f"{what} on {gpu_uuid}: NVML says {meaning}") from None

    def _versioned(self, call: Callable[[int], _T]) -> _T:
        """`call(2)` (profile info with the driver's name), or `call(1)` on drivers without
        the version-2 entry point."""
        try:
            return call(2)
        except self._nvml.NVMLError as exc:
            missing = getattr(self._nvml, "NVML_ERROR_FUNCTION_NOT_FOUND", None)
            if getattr(exc, "value", None) != missing:
                raise
        return call(1)

    # -- MIG mode --------------------------------------------------------------------------

    def mode(self, handle: Any) -> tuple[bool, bool]:
        """(current, pending) MIG mode; (False, False) where NVML has no MIG."""
        nvml = self._nvml
        enable = getattr(nvml, "NVML_DEVICE_MIG_ENABLE", 1)
        try:
            current, pending = nvml.nvmlDeviceGetMigMode(handle)
        except nvml.NVMLError:
            return False, False
        return current == enable, pending == enable

    def set_mode(self, handle: Any, gpu_uuid: str, enabled: bool) -> bool:
        """Ask for MIG mode on or off; True when it is in effect now, False when it waits
        for a GPU reset (the driver could not reset the GPU itself: processes, or a VM)."""
        nvml = self._nvml
        mode = nvml.NVML_DEVICE_MIG_ENABLE if enabled else nvml.NVML_DEVICE_MIG_DISABLE
        with self._refusal(gpu_uuid, f"turning MIG mode {'on' if enabled else 'off'}"):
            status = nvml.nvmlDeviceSetMigMode(handle, mode)
        self._profiles.pop(gpu_uuid, None)
        if status == getattr(nvml, "NVML_SUCCESS", 0):
            return True
        log.warning(
            "MIG mode change waits for a GPU reset",
            extra={"gpu": gpu_uuid, "mig_mode": enabled, "reason": str(nvml.NVMLError(status))},
        )
        return False

    # -- profiles --------------------------------------------------------------------------

    def profiles(self, handle: Any, gpu_uuid: str) -> dict[int, NvmlGiProfile]:
        """The GPU's GI profiles by NVML profile ID (read once, while MIG mode is on)."""
        known = self._profiles.get(gpu_uuid)
        if known:
            return known
        nvml = self._nvml
        card_mib = int(nvml.nvmlDeviceGetMemoryInfo(handle).total) // MIB
        found: dict[int, NvmlGiProfile] = {}
        for constant in range(int(getattr(nvml, "NVML_GPU_INSTANCE_PROFILE_COUNT", 0))):
            try:
                info = self._versioned(
                    lambda version, c=constant: nvml.nvmlDeviceGetGpuInstanceProfileInfo(
                        handle, c, version
                    )
                )
            except nvml.NVMLError:
                continue  # a profile this GPU does not have
            slices, memory = int(info.sliceCount), int(info.memorySizeMB)
            name = driver_name(getattr(info, "name", b"")) or derived_name(
                slices, memory, card_mib, self._suffix(constant)
            )
            found[int(info.id)] = NvmlGiProfile(
                int(info.id), name, slices, memory, int(info.instanceCount)
            )
        if found:
            self._profiles[gpu_uuid] = found
        return found

    def _suffix(self, constant: int) -> str:
        for name, suffix in _SUFFIXES.items():
            if getattr(self._nvml, name, None) == constant:
                return suffix
        return ""

    def _profile_named(self, handle: Any, gpu_uuid: str, name: str) -> NvmlGiProfile:
        with self._refusal(gpu_uuid, "reading MIG profiles"):
            profiles = self.profiles(handle, gpu_uuid)
        for profile in profiles.values():
            if profile.name == name:
                return profile
        listed = ", ".join(p.name for p in profiles.values()) or "none: is MIG mode on?"
        raise MigError(
            "invalid_argument", f"{gpu_uuid} has no MIG profile {name!r} (NVML lists: {listed})"
        )

    def placements(self, handle: Any, gpu_uuid: str, profile_id: int) -> list[tuple[int, int]]:
        """Every (start, size) NVML allows the profile, free or not."""
        key = (gpu_uuid, profile_id)
        if key not in self._placements:
            nvml = self._nvml
            found = (nvml.c_nvmlGpuInstancePlacement_t * _MAX_PLACEMENTS)()
            count = ctypes.c_uint(_MAX_PLACEMENTS)
            with self._refusal(gpu_uuid, f"reading the placements of MIG profile {profile_id}"):
                nvml.nvmlDeviceGetGpuInstancePossiblePlacements(
                    handle, profile_id, found, ctypes.byref(count)
                )
            self._placements[key] = [(p.start, p.size) for p in found[: count.value]]
        return self._placements[key]

    # -- listing ---------------------------------------------------------------------------

    def devices(self, handle: Any, gpu_uuid: str) -> list[MigDevice]:
        """The GPU's MIG devices (one per CI), GI then CI order. MigError when NVML cannot
        list them."""
        nvml = self._nvml
        found: list[MigDevice] = []
        with self._refusal(gpu_uuid, "listing MIG devices"):
            profiles = self.profiles(handle, gpu_uuid)
            for index in range(int(nvml.nvmlDeviceGetMaxMigDeviceCount(handle))):
                try:
                    device = nvml.nvmlDeviceGetMigDeviceHandleByIndex(handle, index)
                except nvml.NVMLError as exc:
                    if self._code(exc) in ("not_found", "invalid_argument"):
                        continue  # no MIG device at this index
                    raise
                described = self._describe(handle, device, profiles)
                if described is not None:
                    found.append(described)
        return sorted(found, key=lambda d: (d.gi_id, d.ci_id))

    def _describe(
        self, handle: Any, device: Any, profiles: dict[int, NvmlGiProfile]
    ) -> MigDevice | None:
        nvml = self._nvml
        try:
            gi_id = int(nvml.nvmlDeviceGetGpuInstanceId(device))
            ci_id = int(nvml.nvmlDeviceGetComputeInstanceId(device))
            attributes = nvml.nvmlDeviceGetAttributes(device)
            gi = nvml.nvmlGpuInstanceGetInfo(nvml.nvmlDeviceGetGpuInstanceById(handle, gi_id))
            mig_uuid = _text(nvml.nvmlDeviceGetUUID(device))
        except nvml.NVMLError as exc:
            if self._code(exc) == "not_found":
                return None  # destroyed while we listed
            raise
        gi_slices = int(attributes.gpuInstanceSliceCount)
        ci_slices = int(attributes.computeInstanceSliceCount)
        profile = profiles.get(int(gi.profileId))
        gi_name = profile.name if profile else f"{gi_slices}g.{gi.profileId}"
        return MigDevice(
            uuid=mig_uuid,
            profile=gi_name if ci_slices == gi_slices else f"{ci_slices}c.{gi_name}",
            gi_profile=gi_name,
            gi_id=gi_id,
            ci_id=ci_id,
            start=int(gi.placement.start),
            size=int(gi.placement.size),
            memory_mib=profile.memory_mib if profile else int(attributes.memorySizeMB),
            sm_count=int(attributes.multiprocessorCount),
        )

    # -- making and removing instances -----------------------------------------------------

    def create_gpu_instance(self, handle: Any, gpu_uuid: str, profile_name: str, start: int) -> int:
        """A GI of `profile_name` at memory slice `start` (-1: NVML's choice); its GI ID."""
        nvml = self._nvml
        profile = self._profile_named(handle, gpu_uuid, profile_name)
        what = f"creating a {profile_name} GPU instance"
        if start < 0:
            with self._refusal(gpu_uuid, what):
                made = nvml.nvmlDeviceCreateGpuInstance(handle, profile.profile_id)
        else:
            allowed = dict(self.placements(handle, gpu_uuid, profile.profile_id))
            if start not in allowed:
                raise MigError(
                    "invalid_argument",
                    f"{what} on {gpu_uuid}: it cannot start at memory slice {start} (NVML "
                    f"allows {', '.join(map(str, sorted(allowed))) or 'none'})",
                )
            placement = nvml.c_nvmlGpuInstancePlacement_t(start, allowed[start])
            with self._refusal(gpu_uuid, f"{what} at memory slice {start}"):
                made = nvml.nvmlDeviceCreateGpuInstanceWithPlacement(
                    handle, profile.profile_id, ctypes.byref(placement)
                )
        with self._refusal(gpu_uuid, "reading the new GPU instance"):
            return int(nvml.nvmlGpuInstanceGetInfo(made).id)

    def destroy_gpu_instance(self, handle: Any, gpu_uuid: str, gi_id: int) -> None:
        nvml = self._nvml
        with self._refusal(gpu_uuid, f"destroying GPU instance {gi_id}"):
            nvml.nvmlGpuInstanceDestroy(nvml.nvmlDeviceGetGpuInstanceById(handle, gi_id))

    def create_compute_instance(self, handle: Any, gpu_uuid: str, gi_id: int, slices: int) -> int:
        """A CI of `slices` compute slices (0: all of the GI's) in GI `gi_id`; its CI ID."""
        nvml = self._nvml
        with self._refusal(gpu_uuid, f"creating a compute instance in GPU instance {gi_id}"):
            gi = nvml.nvmlDeviceGetGpuInstanceById(handle, gi_id)
            info = nvml.nvmlGpuInstanceGetInfo(gi)
            profile = self.profiles(handle, gpu_uuid).get(int(info.profileId))
            wanted = slices or (profile.slices if profile else 0)
            sizes: dict[int, int] = {}  # compute slices -> CI profile ID
            for constant in range(int(getattr(nvml, "NVML_COMPUTE_INSTANCE_PROFILE_COUNT", 0))):
                try:
                    ci_profile = self._versioned(
                        lambda version, c=constant: (
                            nvml.nvmlGpuInstanceGetComputeInstanceProfileInfo(
                                gi, c, nvml.NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED, version
                            )
                        )
                    )
                except nvml.NVMLError:
                    continue  # a size this GI does not offer
                sizes.setdefault(int(ci_profile.sliceCount), int(ci_profile.id))
            if wanted not in sizes:
                raise MigError(
                    "invalid_argument",
                    f"GPU instance {gi_id} on {gpu_uuid} has no {wanted}-slice compute "
                    f"instance (NVML offers {', '.join(map(str, sorted(sizes))) or 'none'})",
                )
            made = nvml.nvmlGpuInstanceCreateComputeInstance(gi, sizes[wanted])
            return int(nvml.nvmlComputeInstanceGetInfo(made).id)

    def destroy_compute_instance(self, handle: Any, gpu_uuid: str, gi_id: int, ci_id: int) -> None:
        nvml = self._nvml
        with self._refusal(gpu_uuid, f"destroying compute instance {gi_id}/{ci_id}"):
            gi = nvml.nvmlDeviceGetGpuInstanceById(handle, gi_id)
            nvml.nvmlComputeInstanceDestroy(nvml.nvmlGpuInstanceGetComputeInstanceById(gi, ci_id))
