"""MIG geometry: the GPU-instance profiles of each MIG-capable model and where they may go.

Pure data and arithmetic, shared by the node agent (simulated NVML, static strategies), the
allocator (dynamic MIG placement) and anything else that must reason about MIG (DRA): no
service is imported here.

Every listed GPU has 7 compute slices and 8 memory slices. A GPU instance (GI) of a profile
sits at a start memory slice taken from the profile's allowed starts and covers
`memory_slices` slices from there; two GIs may not overlap, and no profile may exceed its
`max_count` on one GPU. Those are NVML's rules (nvmlDeviceGetGpuInstancePossiblePlacements,
NVML_ERROR_INSUFFICIENT_RESOURCES). Figures: NVIDIA's MIG user guide and go-nvml's A100 mock
(docs/modes.md, section MIG, names where each comes from).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import NamedTuple

MEMORY_SLICES = 8
COMPUTE_SLICES = 7
MIG_RESOURCE_PREFIX = "nvidia.com/mig-"
# Compute-instance sizes NVML offers inside a GI (go-nvlib keeps those with 2C <= G+1 or C=G).
_CI_SIZES = (1, 2, 3, 4, 7)


@dataclass(frozen=True)
class GiProfile:
    """One GPU-instance profile of one GPU model, as `nvidia-smi mig -lgip` lists it."""

    name: str  # e.g. "1g.5gb", "1g.5gb+me"
    profile_id: int  # NVML's GpuInstanceProfileInfo.id (what Create* takes)
    slices: int  # compute slices (the "1g" of 1g.5gb)
    memory_slices: int
    memory_mib: int
    max_count: int
    starts: tuple[int, ...]  # allowed start memory slices

    @property
    def media_extension(self) -> bool:
        return "+" in self.name

    def sm_count(self, gpu_sm_count: int) -> int:
        return gpu_sm_count * self.slices // COMPUTE_SLICES


def _table(names: tuple[str, ...], mib: tuple[int, ...]) -> tuple[GiProfile, ...]:
    """The seven profiles every listed part has, in NVML's order, with this part's names."""
    shape = (  # id, compute slices, memory slices, max, starts
        (19, 1, 1, 7, (0, 1, 2, 3, 4, 5, 6)),
        (20, 1, 1, 1, (0, 1, 2, 3, 4, 5, 6)),
        (15, 1, 2, 4, (0, 2, 4, 6)),
        (14, 2, 2, 3, (0, 2, 4)),
        (9, 3, 4, 2, (0, 4)),
        (5, 4, 4, 1, (0,)),
        (0, 7, 8, 1, (0,)),
    )
    return tuple(
        GiProfile(name, pid, slices, memory, size, count, starts)
        for name, size, (pid, slices, memory, count, starts) in zip(names, mib, shape, strict=True)
    )


# Keyed by the simulated model names (services/nodeagent/gpus/simulated.py MODELS), upper case.
PROFILES: dict[str, tuple[GiProfile, ...]] = {
    "A100-40GB": _table(
        ("1g.5gb", "1g.5gb+me", "1g.10gb", "2g.10gb", "3g.20gb", "4g.20gb", "7g.40gb"),
        (4864, 4864, 9856, 9856, 19968, 19968, 40192),
    ),
    "A100-80GB": _table(
        ("1g.10gb", "1g.10gb+me", "1g.20gb", "2g.20gb", "3g.40gb", "4g.40gb", "7g.80gb"),
        (9728, 9728, 19712, 19712, 39936, 39936, 80384),
    ),
    "H100-80GB": _table(
        ("1g.10gb", "1g.10gb+me", "1g.20gb", "2g.20gb", "3g.40gb", "4g.40gb", "7g.80gb"),
        (9984, 9984, 20096, 20096, 40448, 40448, 81152),
    ),
}


class Placement(NamedTuple):
    """Memory slices [start, start + size) held by one GI."""

    start: int
    size: int

    def overlaps(self, other: Placement) -> bool:
        return self.start < other.start + other.size and other.start < self.start + self.size


class PlacedGi(NamedTuple):
    """An existing GI: its profile name and where it sits."""

    profile: str
    placement: Placement


# NVML's product names (nvmlDeviceGetName) of the listed parts, beyond the simulated names:
# "NVIDIA A100-SXM4-40GB", "NVIDIA A100-PCIE-40GB", "NVIDIA A100 80GB PCIe",
# "NVIDIA H100 80GB HBM3". A part whose name states no memory is listed here by name.
_PRODUCT = re.compile(r"^(?:NVIDIA\s+)?(?P<family>A100|H100)\b(?P<rest>.*)$")
_MEMORY = re.compile(r"\b(?P<gb>\d+)\s*GB\b")
_UNSIZED = {"H100 PCIE": "H100-80GB"}


def table_model(model: str) -> str:
    """The key of PROFILES for a simulated model name or an NVML product name; "" when the
    model has no profile table here (a GPU without MIG, or a MIG part not listed, such as
    the 94 GB H100 NVL)."""
    key = model.strip().upper()
    if key in PROFILES:
        return key
    matched = _PRODUCT.match(key)
    if matched is None:
        return ""
    memory = _MEMORY.search(matched["rest"])
    if memory is None:
        bare = key.removeprefix("NVIDIA").strip()
        return _UNSIZED.get(bare, "")
    candidate = f"{matched['family']}-{memory['gb']}GB"
    return candidate if candidate in PROFILES else ""


def mig_capable(model: str) -> bool:
    return bool(table_model(model))


def profiles_for(model: str) -> tuple[GiProfile, ...]:
    """The model's GI profiles; empty for a GPU without MIG."""
    return PROFILES.get(table_model(model), ())


def profile_named(model: str, name: str) -> GiProfile:
    """ValueError naming the model's profiles when `name` is not one of them."""
    profiles = profiles_for(model)
    if not profiles:
        capable = ", ".join(PROFILES)
        raise ValueError(f"{model} does not support MIG (MIG-capable models: {capable})")
    for profile in profiles:
        if profile.name == name:
            return profile
    known = ", ".join(p.name for p in profiles)
    raise ValueError(f"{model} has no MIG profile {name!r} (its profiles: {known})")


def resource_name(profile_name: str) -> str:
    """NVIDIA's mixed-strategy resource: `nvidia.com/mig-1g.5gb`, `+me` becoming `.me`."""
    return MIG_RESOURCE_PREFIX + profile_name.replace("+", ".")


def device_profile(gi: GiProfile, ci_slices: int) -> str:
    """What a MIG device (one compute instance) is called: the GI's name when the CI spans
    it, else `<C>c.<GI name>` (e.g. 1c.3g.20gb)."""
    return gi.name if ci_slices == gi.slices else f"{ci_slices}c.{gi.name}"


def compute_instance_sizes(gi: GiProfile) -> dict[int, int]:
    """Compute-instance sizes a GI of this profile offers, with how many fit: {C: count}."""
    return {
        size: gi.slices // size
        for size in _CI_SIZES
        if size == gi.slices or (size < gi.slices and 2 * size <= gi.slices + 1)
    }


def free_starts(profile: GiProfile, placed: Iterable[PlacedGi]) -> list[int]:
    """Allowed starts of `profile` that overlap no existing GI, or none once the profile is
    at its max count."""
    existing = list(placed)
    if sum(1 for gi in existing if gi.profile == profile.name) >= profile.max_count:
        return []
    return [
        start
        for start in profile.starts
        if not any(
            Placement(start, profile.memory_slices).overlaps(gi.placement) for gi in existing
        )
    ]


def check_placement(profile: GiProfile, start: int, placed: Iterable[PlacedGi]) -> None:
    """ValueError saying why a GI of `profile` cannot go at `start` next to `placed`."""
    existing = list(placed)
    if start not in profile.starts:
        raise ValueError(
            f"{profile.name} cannot start at memory slice {start} "
            f"(allowed starts: {', '.join(map(str, profile.starts))})"
        )
    count = sum(1 for gi in existing if gi.profile == profile.name)
    if count >= profile.max_count:
        raise ValueError(f"{profile.name}: the GPU already holds its maximum of {count}")
    wanted = Placement(start, profile.memory_slices)
    for gi in existing:
        if wanted.overlaps(gi.placement):
            raise ValueError(
                f"{profile.name} at slices {start}-{start + profile.memory_slices - 1} overlaps "
                f"the {gi.profile} at {gi.placement.start}-"
                f"{gi.placement.start + gi.placement.size - 1}"
            )


def _room(model: str, placed: list[PlacedGi]) -> int:
    """How many placements of every profile would still be possible: the more, the less a
    choice has fragmented the GPU."""
    return sum(len(free_starts(profile, placed)) for profile in profiles_for(model))


def choose_start(model: str, profile: GiProfile, placed: Iterable[PlacedGi]) -> int | None:
    """The free start of `profile` that leaves the most room for later GIs (ties: the
    highest start, as NVIDIA's driver fills small profiles from the top); None if none."""
    existing = list(placed)
    best: tuple[int, int] | None = None
    for start in free_starts(profile, existing):
        after = [*existing, PlacedGi(profile.name, Placement(start, profile.memory_slices))]
        score = (_room(model, after), start)
        if best is None or score > best:
            best = score
    return None if best is None else best[1]


def serving_profiles(model: str) -> list[GiProfile]:
    """Profiles that may serve a memory request on demand, smallest first: no media
    extensions (a +me GI is one of a kind), fewest compute slices on ties."""
    usable = [p for p in profiles_for(model) if not p.media_extension]
    return sorted(usable, key=lambda p: (p.memory_mib, p.slices, p.memory_slices))


def smallest_fitting(
    model: str, memory_mib: int, placed: Iterable[PlacedGi]
) -> tuple[GiProfile, int] | None:
    """The smallest profile of at least `memory_mib` that still has a free start, and that
    start (dynamic MIG); None when nothing fits."""
    existing = list(placed)
    for profile in serving_profiles(model):
        if profile.memory_mib < memory_mib:
            continue
        start = choose_start(model, profile, existing)
        if start is not None:
            return profile, start
    return None


def largest_profile(model: str) -> GiProfile | None:
    usable = serving_profiles(model)
    return usable[-1] if usable else None
