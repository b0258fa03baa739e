"""MIG on simulated GPUs: the state NVML keeps per GPU (mode, GPU instances, compute
instances) and the rules it enforces, with NVML's calls as methods.

NVML's order holds: MIG mode on before any GI; a GI at an allowed, free start and within its
profile's max count; compute instances inside a GI, within its compute slices; CIs destroyed
before their GI (else "in use"), every GI before MIG mode goes off. Each failure is a MigError
whose `code` is the NVML return code it stands for. MIG device UUIDs are `MIG-<uuid>`, new
for every compute instance created (as current drivers hand out).

The geometry a simulated node starts with is a spec (setting `simulate_mig`):
`<gpus>:<profiles>` entries separated by `;`, where <gpus> is `all` or GPU indices joined
by `+`, and <profiles> is a comma list of GI profiles, each optionally `<n>x<profile>`;
an empty list means MIG mode on with no instance. Example: `0:3g.20gb,2x2g.10gb;1+2:7x1g.5gb`.
"""

from __future__ import annotations

import re
import threading
import uuid
from dataclasses import dataclass, field

from services.common import mig
from services.common.schemas import MigDevice
from services.nodeagent.gpus.backend import MigError

__all__ = ["GpuInstanceView", "MigError", "SimulatedMig", "parse_geometry"]

_MIG_NAMESPACE = uuid.uuid5(uuid.NAMESPACE_URL, "https://vgpu.io/simulated-mig")
_COUNTED = re.compile(r"^(?:(?P<count>\d+)\s*[xX]\s*)?(?P<profile>\S+)$")


@dataclass
class _Gi:
    profile: mig.GiProfile
    start: int
    cis: dict[int, tuple[int, str]] = field(default_factory=dict)  # ci id -> (slices, uuid)


@dataclass(frozen=True)
class GpuInstanceView:
    """One GI as NVML would report it: for a pynvml-compatible module built on this state."""

    gi_id: int
    profile: mig.GiProfile
    start: int
    compute_instances: dict[int, tuple[int, str]]  # ci id -> (compute slices, MIG UUID)


@dataclass
class _GpuMig:
    model: str
    sm_count: int
    enabled: bool = False
    gis: dict[int, _Gi] = field(default_factory=dict)
    unhealthy: set[str] = field(default_factory=set)  # MIG UUIDs


def parse_geometry(spec: str, gpu_count: int) -> dict[int, list[str]]:
    """{GPU index: GI profile names} from a geometry spec; ValueError naming the bad part."""
    found: dict[int, list[str]] = {}
    for raw in spec.split(";"):
        entry = raw.strip()
        if not entry:
            continue
        target, sep, listed = entry.partition(":")
        if not sep:
            raise ValueError(
                f"bad MIG geometry entry {entry!r}: expected <gpus>:<profiles>, "
                "e.g. all:7x1g.5gb or 0+1:3g.20gb,2g.10gb"
            )
        target = target.strip()
        if target == "all":
            indices = list(range(gpu_count))
        else:
            try:
                indices = [int(part) for part in target.split("+")]
            except ValueError:
                raise ValueError(
                    f"bad MIG geometry entry {entry!r}: {target!r} is not 'all' or GPU indices "
                    "joined by '+'"
                ) from None
        profiles: list[str] = []
        for item in (p.strip() for p in listed.split(",")):
            if not item:
                continue
            matched = _COUNTED.match(item)
            if matched is None:
                raise ValueError(f"bad MIG geometry entry {entry!r}: bad profile {item!r}")
            profiles += [matched["profile"]] * int(matched["count"] or 1)
        for index in indices:
            if not 0 <= index < gpu_count:
                raise ValueError(
                    f"bad MIG geometry entry {entry!r}: no GPU {index} (the node has {gpu_count})"
                )
            found[index] = profiles
    return found


class SimulatedMig:
    """The MIG state of a node's simulated GPUs, keyed by GPU UUID. Thread-safe: the agent
    reads devices in worker threads while Allocate creates instances."""

    def __init__(self) -> None:
        self._gpus: dict[str, _GpuMig] = {}
        self._lock = threading.Lock()
        self._serial = 0

    def add_gpu(self, gpu_uuid: str, model: str, sm_count: int) -> None:
        self._gpus[gpu_uuid] = _GpuMig(model=model, sm_count=sm_count)

    def _gpu(self, gpu_uuid: str) -> _GpuMig:
        state = self._gpus.get(gpu_uuid)
        if state is None:
            raise MigError("not_found", f"no simulated GPU with uuid {gpu_uuid!r}")
        return state

    def _enabled(self, gpu_uuid: str) -> _GpuMig:
        state = self._gpu(gpu_uuid)
        if not state.enabled:
            raise MigError("invalid_argument", f"MIG mode is off on {gpu_uuid}")
        return state

    def mig_mode(self, gpu_uuid: str) -> bool:
        return self._gpu(gpu_uuid).enabled

    def set_mig_mode(self, gpu_uuid: str, enabled: bool) -> None:
        with self._lock:
            state = self._gpu(gpu_uuid)
            if enabled and not mig.mig_capable(state.model):
                raise MigError("not_supported", f"{state.model} ({gpu_uuid}) does not support MIG")
            if not enabled and state.gis:
                raise MigError(
                    "in_use",
                    f"cannot turn MIG off on {gpu_uuid}: {len(state.gis)} GPU instance(s) remain",
                )
            state.enabled = enabled

    def profiles(self, gpu_uuid: str) -> tuple[mig.GiProfile, ...]:
        return mig.profiles_for(self._gpu(gpu_uuid).model)

    def placed(self, gpu_uuid: str) -> list[mig.PlacedGi]:
        with self._lock:
            return self._placed(self._gpu(gpu_uuid))

    @staticmethod
    def _placed(state: _GpuMig) -> list[mig.PlacedGi]:
        return [
            mig.PlacedGi(gi.profile.name, mig.Placement(gi.start, gi.profile.memory_slices))
            for gi in state.gis.values()
        ]

    def gpu_instances(self, gpu_uuid: str) -> list[GpuInstanceView]:
        """The GPU's GIs in ID order, with their compute instances (none with MIG off)."""
        with self._lock:
            state = self._gpu(gpu_uuid)
            return [
                GpuInstanceView(gi_id, gi.profile, gi.start, dict(gi.cis))
                for gi_id, gi in sorted(state.gis.items())
            ]

    def create_gpu_instance(self, gpu_uuid: str, profile_name: str, start: int = -1) -> int:
        """A GI of `profile_name` at `start` (-1: where it leaves the most room); its ID."""
        with self._lock:
            state = self._enabled(gpu_uuid)
            try:
                profile = mig.profile_named(state.model, profile_name)
            except ValueError as exc:
                raise MigError("invalid_argument", str(exc)) from None
            placed = self._placed(state)
            if start < 0:
                chosen = mig.choose_start(state.model, profile, placed)
                if chosen is None:
                    raise MigError(
                        "insufficient_resources",
                        f"no room for a {profile_name} on {gpu_uuid} "
                        f"(it holds {', '.join(g.profile for g in placed) or 'nothing'})",
                    )
                start = chosen
            try:
                mig.check_placement(profile, start, placed)
            except ValueError as exc:
                raise MigError("insufficient_resources", f"{gpu_uuid}: {exc}") from None
            gi_id = min(set(range(len(state.gis) + 1)) - set(state.gis))
            state.gis[gi_id] = _Gi(profile, start)
            return gi_id

    def destroy_gpu_instance(self, gpu_uuid: str, gi_id: int) -> None:
        with self._lock:
            state = self._enabled(gpu_uuid)
            gi = state.gis.get(gi_id)
            if gi is None:
                raise MigError("not_found", f"no GPU instance {gi_id} on {gpu_uuid}")
            if gi.cis:
                raise MigError(
                    "in_use",
                    f"GPU instance {gi_id} on {gpu_uuid} still has compute instances "
                    f"{sorted(gi.cis)}",
                )
            del state.gis[gi_id]

    def create_compute_instance(self, gpu_uuid: str, gi_id: int, slices: int = 0) -> int:
        """A CI of `slices` compute slices (0: the whole GI) in GI `gi_id`; its ID."""
        with self._lock:
            state = self._enabled(gpu_uuid)
            gi = state.gis.get(gi_id)
            if gi is None:
                raise MigError("not_found", f"no GPU instance {gi_id} on {gpu_uuid}")
            size = slices or gi.profile.slices
            sizes = mig.compute_instance_sizes(gi.profile)
            if size not in sizes:
                raise MigError(
                    "invalid_argument",
                    f"a {gi.profile.name} GPU instance has no {size}-slice compute instance "
                    f"(sizes: {', '.join(map(str, sizes))})",
                )
            used = sum(ci_slices for ci_slices, _ in gi.cis.values())
            if used + size > gi.profile.slices:
                raise MigError(
                    "insufficient_resources",
                    f"GPU instance {gi_id} on {gpu_uuid} has {gi.profile.slices - used} free "
                    f"compute slice(s), {size} asked",
                )
            ci_id = min(set(range(len(gi.cis) + 1)) - set(gi.cis))
            self._serial += 1
            mig_uuid = f"MIG-{uuid.uuid5(_MIG_NAMESPACE, f'{gpu_uuid}/{self._serial}')}"
            gi.cis[ci_id] = (size, mig_uuid)
            return ci_id

    def destroy_compute_instance(self, gpu_uuid: str, gi_id: int, ci_id: int) -> None:
        with self._lock:
            state = self._enabled(gpu_uuid)
            gi = state.gis.get(gi_id)
            if gi is None or ci_id not in gi.cis:
                raise MigError("not_found", f"no compute instance {gi_id}/{ci_id} on {gpu_uuid}")
            _, mig_uuid = gi.cis.pop(ci_id)
            state.unhealthy.discard(mig_uuid)

    def devices(self, gpu_uuid: str) -> list[MigDevice]:
        """The GPU's MIG devices (one per CI), GI then CI order; none with MIG off."""
        with self._lock:
            state = self._gpu(gpu_uuid)
            if not state.enabled:
                return []
            found = []
            for gi_id, gi in sorted(state.gis.items()):
                for ci_id, (slices, mig_uuid) in sorted(gi.cis.items()):
                    found.append(
                        MigDevice(
                            uuid=mig_uuid,
                            profile=mig.device_profile(gi.profile, slices),
                            gi_profile=gi.profile.name,
                            gi_id=gi_id,
                            ci_id=ci_id,
                            start=gi.start,
                            size=gi.profile.memory_slices,
                            memory_mib=gi.profile.memory_mib,
                            sm_count=state.sm_count * slices // mig.COMPUTE_SLICES,
                            healthy=mig_uuid not in state.unhealthy,
                        )
                    )
            return found

    def owner_of(self, mig_uuid: str) -> str | None:
        """The GPU UUID holding MIG device `mig_uuid`, if any."""
        with self._lock:
            for gpu_uuid, state in self._gpus.items():
                for gi in state.gis.values():
                    if any(u == mig_uuid for _, u in gi.cis.values()):
                        return gpu_uuid
        return None

    def set_healthy(self, mig_uuid: str, healthy: bool) -> None:
        gpu_uuid = self.owner_of(mig_uuid)
        if gpu_uuid is None:
            raise MigError("not_found", f"no MIG device {mig_uuid!r}")
        with self._lock:
            unhealthy = self._gpus[gpu_uuid].unhealthy
            if healthy:
                unhealthy.discard(mig_uuid)
            else:
                unhealthy.add(mig_uuid)

    def apply_geometry(self, gpu_uuid: str, profiles: list[str]) -> None:
        """MIG mode on and one full-size CI per listed GI, as mig-parted applies a config."""
        self.set_mig_mode(gpu_uuid, True)
        for name in profiles:
            gi_id = self.create_gpu_instance(gpu_uuid, name)
            self.create_compute_instance(gpu_uuid, gi_id)
