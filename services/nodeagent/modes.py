"""Which sharing mode each GPU of the node is in, and how many device IDs it gets.

The mode is the node's setting (`sharing_mode`), overridden per GPU by `gpu_sharing_modes`
("0=mps,GPU-1a2b...=exclusive": a GPU index or UUID, then the mode). Device IDs per GPU:
vgpu the split count, time-slicing and mps the replicas, exclusive one.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import msgspec

from services.common.schemas import GpuDevice
from services.common.sharing import EXCLUSIVE, MODES, MPS, TIME_SLICING, VGPU

__all__ = ["EXCLUSIVE", "MODES", "MPS", "TIME_SLICING", "VGPU", "ModePlan", "parse_gpu_modes"]
MAX_MPS_CLIENTS = 48  # the MPS control daemon's limit per GPU (compute capability >= 7.5)


class ModeError(ValueError):
    pass


def check_mode(mode: str, where: str) -> str:
    if mode not in MODES:
        raise ModeError(f"{where}: unknown sharing mode {mode!r} (one of {', '.join(MODES)})")
    return mode


def parse_gpu_modes(text: str) -> dict[str, str]:
    """`0=mps,GPU-...=exclusive` -> {"0": "mps", "GPU-...": "exclusive"}; ModeError quoting
    the bad part."""
    found: dict[str, str] = {}
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        gpu, sep, mode = (s.strip() for s in part.partition("="))
        if not sep or not gpu:
            raise ModeError(f"gpu_sharing_modes: {part!r} is not <gpu index or uuid>=<mode>")
        check_mode(mode, f"gpu_sharing_modes {part!r}")
        if gpu in found:
            raise ModeError(f"gpu_sharing_modes: GPU {gpu!r} is named twice")
        found[gpu] = mode
    return found


@dataclass(frozen=True)
class ModePlan:
    default: str = VGPU
    per_gpu: dict[str, str] = field(default_factory=dict)  # index or uuid -> mode
    split_count: int = 10
    replicas: int = 0  # time-slicing / mps; 0 = split_count
    one_replica_per_container: bool = False  # failRequestsGreaterThanOne (time-slicing / mps)

    def mode_of(self, gpu: GpuDevice) -> str:
        return self.per_gpu.get(gpu.uuid) or self.per_gpu.get(str(gpu.index)) or self.default

    def replicas_for(self, mode: str) -> int:
        if mode == EXCLUSIVE:
            return 1
        if mode == VGPU:
            return self.split_count
        return self.replicas or self.split_count

    def annotate(self, gpus: list[GpuDevice]) -> list[GpuDevice]:
        """The GPUs with their mode and device-ID count filled in; vgpu GPUs stay as they
        are (replicas 0: the split count, which the allocator has its own setting for)."""
        marked = []
        for gpu in gpus:
            mode = self.mode_of(gpu)
            if mode == VGPU:
                marked.append(gpu)
                continue
            marked.append(
                msgspec.structs.replace(
                    gpu,
                    sharing_mode=mode,
                    replicas=self.replicas_for(mode),
                    one_replica_per_container=(
                        self.one_replica_per_container and mode in (TIME_SLICING, MPS)
                    ),
                )
            )
        return marked

    def modes(self) -> set[str]:
        return {self.default, *self.per_gpu.values()}
