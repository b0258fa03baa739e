"""Dynamic MIG in placement: a memory request on a GPU marked for dynamic MIG is served by
the smallest MIG profile that holds it, at a start slice that respects the GPU's geometry.

A GPU's MIG geometry travels in the charges as a bit mask of occupied memory slices
(Charge.mig_mask): GIs never overlap, so the masks of different pods are disjoint and add
up like the other figures. For the profiles dynamic MIG uses (no media extensions), a
profile's max count is implied by its allowed starts, so the mask is all the geometry the
fit needs. The GPU's live instances (inventory) are occupied too: they include instances an
operator made and instances of released pods that the agent has not destroyed yet.

Compute is charged as the profile's share of the 7 compute slices (14 % per slice), memory
as the profile's memory, one task slot per instance.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable

from services.common import mig
from services.common.schemas import GpuSlice, MigDevice

CORES_PER_SLICE = 100 // mig.COMPUTE_SLICES  # 14: seven slices stay within 100 %


def mask_of(start: int, size: int) -> int:
    return ((1 << size) - 1) << start


def live_mask(devices: Iterable[MigDevice]) -> int:
    """Memory slices held by a GPU's existing GPU instances."""
    occupied = 0
    for device in devices:
        occupied |= mask_of(device.start, device.size)
    return occupied


def slice_mask(piece: GpuSlice) -> int:
    """The memory slices a placed slice's MIG instance holds (0 for a plain vgpu slice)."""
    if not piece.mig_profile:
        return 0
    return mask_of(piece.mig_start, _size_of(piece.mig_profile))


def _size_of(profile_name: str) -> int:
    for profiles in mig.PROFILES.values():
        for profile in profiles:
            if profile.name == profile_name:
                return profile.memory_slices
    raise ValueError(f"unknown MIG profile {profile_name!r}")


def placed_of(occupied: int) -> list[mig.PlacedGi]:
    """The occupied mask as one-slice placeholders (enough for overlap tests)."""
    return [
        mig.PlacedGi("", mig.Placement(bit, 1))
        for bit in range(mig.MEMORY_SLICES)
        if occupied >> bit & 1
    ]


def mig_cores(profile: mig.GiProfile) -> int:
    return profile.slices * CORES_PER_SLICE


@functools.lru_cache(maxsize=65536)
def fit(model: str, memory_mib: int, occupied: int) -> tuple[mig.GiProfile, int] | None:
    """The smallest profile of `model` holding `memory_mib` with a start free of `occupied`,
    and that start (the one leaving the most room); None when nothing fits. Memoised: the
    placer asks it for every dynamic GPU of every node a pod meets, and 8-bit masks repeat."""
    return mig.smallest_fitting(model, memory_mib, placed_of(occupied))


def mig_capacity(model: str) -> int:
    """MiB of the model's full-GPU profile (7g): what 100 % of a dynamic MIG GPU means."""
    largest = mig.largest_profile(model)
    return 0 if largest is None else largest.memory_mib
