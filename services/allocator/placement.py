"""Where a pod's containers go on one node: first-fit on GPU memory. Pure, no I/O.

Each container needs ``gpus`` distinct healthy GPUs, each with enough free memory and free
compute share (100 per GPU). Containers of one pod reserve cumulatively, init containers
included (they are not yet allowed to hand their slices on to the app containers).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import msgspec

from services.common.resources import GPU, GPU_CORES, GPU_MEMORY, GPU_MEMORY_PERCENT
from services.common.schemas import ContainerRequest, GpuDevice, GpuSlice

FULL_COMPUTE = 100


@dataclass(frozen=True)
class Reserved:
    """What is already promised on one GPU."""

    memory_mib: int = 0
    cores: int = 0

    def plus(self, memory_mib: int, cores: int) -> Reserved:
        return Reserved(self.memory_mib + memory_mib, self.cores + cores)


class NoFit(Exception):
    """A container cannot be placed; the message names the container and its request."""

    def __init__(self, request: ContainerRequest, detail: str) -> None:
        self.request = request
        self.detail = detail
        super().__init__(f"container {request.container!r} ({describe_request(request)}) {detail}")


def describe_request(request: ContainerRequest) -> str:
    """The request as the pod spec states it, e.g. 'nvidia.com/gpu: 2, nvidia.com/gpumem: 8000'."""
    parts = [f"{GPU}: {request.gpus}"]
    if request.memory_mib:
        parts.append(f"{GPU_MEMORY}: {request.memory_mib}")
    if request.memory_percent:
        parts.append(f"{GPU_MEMORY_PERCENT}: {request.memory_percent}")
    whole_gpus = request.cores == FULL_COMPUTE and len(parts) == 1  # a bare nvidia.com/gpu
    if request.cores and not whole_gpus:
        parts.append(f"{GPU_CORES}: {request.cores}")
    return ", ".join(parts)


def memory_needed(request: ContainerRequest, gpu: GpuDevice) -> int:
    if request.memory_mib:
        return request.memory_mib
    if request.memory_percent:
        return gpu.memory_mib * request.memory_percent // 100
    return gpu.memory_mib  # neither given: the whole card's memory


def _need_text(request: ContainerRequest) -> str:
    if request.memory_mib:
        memory = f"{request.memory_mib} MiB"
    elif request.memory_percent:
        memory = f"{request.memory_percent}% of its memory"
    else:
        memory = "all of its memory"
    compute = f" and {request.cores}% compute" if request.cores else ""
    plural = "GPU" if request.gpus == 1 else "GPUs"
    return f"{request.gpus} {plural} each with {memory}{compute}"


def _has_room(request: ContainerRequest, gpu: GpuDevice, reserved: Reserved) -> bool:
    return (
        gpu.memory_mib - reserved.memory_mib >= memory_needed(request, gpu)
        and FULL_COMPUTE - reserved.cores >= request.cores
    )


def _slice(request: ContainerRequest, gpu: GpuDevice) -> GpuSlice:
    return GpuSlice(
        uuid=gpu.uuid, index=gpu.index, memory_mib=memory_needed(request, gpu), cores=request.cores
    )


def _no_room(request: ContainerRequest, gpus: Sequence[GpuDevice], roomy: int) -> NoFit:
    unhealthy = sum(not g.healthy for g in gpus)
    sick = f", {unhealthy} unhealthy" if unhealthy else ""
    return NoFit(
        request,
        f"needs {_need_text(request)} free; {roomy} of {len(gpus)} GPUs have that room{sick}",
    )


def _place_one(
    request: ContainerRequest, gpus: Sequence[GpuDevice], reserved: Mapping[str, Reserved]
) -> list[GpuSlice]:
    chosen = [
        gpu
        for gpu in gpus
        if gpu.healthy and _has_room(request, gpu, reserved.get(gpu.uuid, Reserved()))
    ]
    if len(chosen) < request.gpus:
        raise _no_room(request, gpus, len(chosen))
    return [_slice(request, gpu) for gpu in chosen[: request.gpus]]


def _reserve(reserved: dict[str, Reserved], slices: Iterable[GpuSlice]) -> None:
    for piece in slices:
        reserved[piece.uuid] = reserved.get(piece.uuid, Reserved()).plus(
            piece.memory_mib, piece.cores
        )


def place(
    requests: Sequence[ContainerRequest],
    gpus: Sequence[GpuDevice],
    reserved: Mapping[str, Reserved],
) -> dict[str, list[GpuSlice]]:
    """First-fit every container in order; raise NoFit for the first that does not fit."""
    ordered = sorted(gpus, key=lambda g: g.index)
    working = dict(reserved)
    placed: dict[str, list[GpuSlice]] = {}
    for request in requests:
        slices = _place_one(request, ordered, working)
        _reserve(working, slices)
        placed[request.container] = slices
    return placed


def place_on(
    request: ContainerRequest, gpus: Sequence[GpuDevice], reserved: Mapping[str, Reserved]
) -> list[GpuSlice]:
    """Slices for `request` on exactly `gpus` (in that order), or NoFit naming the full one."""
    if len(gpus) != request.gpus:
        raise NoFit(request, f"needs {request.gpus} GPU(s), not {len(gpus)}")
    for gpu in gpus:
        if not gpu.healthy:
            raise NoFit(request, f"cannot use GPU {gpu.uuid}: it is unhealthy")
        if not _has_room(request, gpu, reserved.get(gpu.uuid, Reserved())):
            raise NoFit(request, f"does not fit on GPU {gpu.uuid}: it lacks the room")
    return [_slice(request, gpu) for gpu in gpus]


def capacity_problem(
    requests: Sequence[ContainerRequest], gpus: Sequence[GpuDevice]
) -> NoFit | None:
    """Why the pod could not fit on this node even if it were empty and healthy, if so."""
    try:
        place(requests, [msgspec.structs.replace(g, healthy=True) for g in gpus], {})
    except NoFit as exc:
        return exc
    return None


def never_fits(
    requests: Sequence[ContainerRequest], cluster: Mapping[str, Sequence[GpuDevice]]
) -> str | None:
    """A reason when no known node could ever hold the pod; None when one could (or none known)."""
    if not cluster or not requests:
        return None
    for request in requests:
        if all(capacity_problem([request], gpus) for gpus in cluster.values()):
            largest = max((g.memory_mib for gpus in cluster.values() for g in gpus), default=0)
            most = max(len(gpus) for gpus in cluster.values())
            return (
                f"container {request.container!r} ({describe_request(request)}) can never fit: "
                f"no node in the cluster has {_need_text(request)} "
                f"(largest GPU: {largest} MiB, most GPUs on one node: {most})"
            )
    if all(capacity_problem(requests, gpus) for gpus in cluster.values()):
        names = ", ".join(repr(r.container) for r in requests)
        return (
            f"containers {names} can never fit together: no node in the cluster has room for "
            f"all of them at once"
        )
    return None
