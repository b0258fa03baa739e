"""What one slice costs on a GPU in each sharing mode, or why the mode cannot serve it.

vgpu: the slice as asked (memory, compute share). time-slicing: a replica of the whole GPU
with no limit, so only a bare GPU count fits and it costs one task slot only. mps: a client of
the GPU's MPS daemon, one GPU per container; a bare count is an equal share per replica (as
NVIDIA's MPS), else the slice as asked, enforced by the daemon. exclusive: the whole GPU.
"""

from __future__ import annotations

from collections.abc import Iterable

from services.common.resources import AWS_VGPU, GPU, GPU_CORES, GPU_MEMORY
from services.common.schemas import ContainerRequest
from services.common.sharing import EXCLUSIVE, MPS, TIME_SLICING, VGPU

from .cluster import FULL_COMPUTE, GpuState, NodeState

REFUSALS = {
    TIME_SLICING: (
        f"time-slicing GPUs hold no memory or compute limit: ask a bare {GPU} "
        f"(no {GPU_MEMORY} or {GPU_CORES})"
    ),
    EXCLUSIVE: f"exclusive GPUs are given whole: ask a bare {GPU} (no share of one)",
    MPS: f"an MPS client reaches one GPU's control daemon: ask {GPU}: 1 per container",
}


def bare_count(request: ContainerRequest) -> bool:
    """Only a GPU count was asked (vgpu reads that as whole GPUs)."""
    return not request.memory_mib and not request.memory_percent and request.cores == FULL_COMPUTE


def memory_needed(request: ContainerRequest, gpu: GpuState) -> int:
    """MiB of one vgpu slice: as asked, a share of the card (after the reserve), an equal
    share (schedulable memory / split count), or all of it."""
    if request.vgpus:  # AWS: N of the GPU's K vGPUs
        return gpu.base_memory_mib * min(request.vgpus, gpu.slots) // max(1, gpu.slots)
    if request.equal_share:
        return gpu.memory_mib // gpu.slots
    if request.memory_mib:
        return request.memory_mib
    if request.memory_percent:
        return gpu.base_memory_mib * request.memory_percent // 100
    return gpu.base_memory_mib


def vgpus_need(request: ContainerRequest, gpu: GpuState) -> tuple[int, int] | None:
    """AWS's N of the GPU's K vGPUs, K its split count (task slots) as its node agent states
    it: N x 100 / K percent of memory and compute; all K: the whole GPU; more: None."""
    count = gpu.slots
    if request.vgpus > count:
        return None
    if request.vgpus == count:
        return gpu.base_memory_mib, FULL_COMPUTE
    return gpu.base_memory_mib * request.vgpus // count, FULL_COMPUTE * request.vgpus // count


def slice_need(request: ContainerRequest, gpu: GpuState) -> tuple[int, int] | None:
    """(memory MiB, compute percent) one slice of `request` holds on `gpu` in its mode, or
    None when the mode cannot serve the request (`refusal` says why)."""
    mode = gpu.device.sharing_mode
    if request.vgpus:  # a share of this GPU: what vgpu slices and MPS clients hold
        need = vgpus_need(request, gpu)
        if need is None or mode not in (VGPU, MPS, EXCLUSIVE):
            return None
        if mode == EXCLUSIVE:
            return (gpu.base_memory_mib, gpu.compute) if request.vgpus == gpu.slots else None
        return need
    if mode == VGPU:
        return memory_needed(request, gpu), request.cores
    if gpu.device.one_replica_per_container and request.gpus > 1:
        return None
    if mode == TIME_SLICING:
        return (0, 0) if bare_count(request) else None
    if mode == EXCLUSIVE:
        whole = memory_needed(request, gpu) >= gpu.base_memory_mib
        if whole and request.cores in (0, FULL_COMPUTE):
            return gpu.base_memory_mib, gpu.compute
        return None
    if mode == MPS:
        if request.gpus != 1:
            return None
        if bare_count(request):
            replicas = max(1, gpu.slots)
            return gpu.base_memory_mib // replicas, max(1, FULL_COMPUTE // replicas)
        return memory_needed(request, gpu), request.cores
    return None  # a mode this allocator does not know: never place on it


def refusal(gpu: GpuState, request: ContainerRequest | None = None) -> str:
    mode = gpu.device.sharing_mode
    if request is not None and request.vgpus > gpu.slots:
        return (
            f"{AWS_VGPU}: {request.vgpus} is more than the {gpu.slots} vGPUs of one GPU (the "
            "node agent's --vgpu / split count)"
        )
    if gpu.device.one_replica_per_container and request is not None and request.gpus > 1:
        return f"{mode} GPUs here take one replica per container (failRequestsGreaterThanOne)"
    return REFUSALS.get(mode, f"GPU mode {mode!r} is unknown to this allocator")


def mode_refusals(request: ContainerRequest, nodes: Iterable[NodeState]) -> str:
    """ "; <mode> GPUs: <why>" for each sharing mode in `nodes` that refuses `request`."""
    refused: dict[str, str] = {}
    for node in nodes:
        for gpu in node.gpus:
            mode = gpu.sharing_mode
            if mode != VGPU and mode not in refused and slice_need(request, gpu) is None:
                refused[mode] = refusal(gpu, request)
    return "".join(f"; {mode} GPUs refuse it: {why}" for mode, why in sorted(refused.items()))
