"""Stranded capacity: free GPU memory that none of the waiting pods' shapes can use.

Pure arithmetic, no I/O. A shape is one container's per-GPU ask (memory, compute share) times
its GPU count. A GPU can serve a shape when its free memory and free compute both cover the
per-GPU ask and its node has at least as many such GPUs as the shape needs. Free memory on a
GPU that can serve no waiting shape is stranded. With nothing waiting, nothing is stranded
(free memory is then idle, not stranded), and pods that can never fit anywhere are left out:
they wait for a bigger GPU, not for fragmentation to clear.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from services.common.schemas import ContainerRequest


@dataclass(frozen=True)
class FreeGpu:
    node: str
    uuid: str
    memory_mib: int  # capacity
    free_memory_mib: int
    free_cores: int  # percent of SMs not promised to anyone


@dataclass(frozen=True)
class Shape:
    gpus: int
    memory_mib: int = 0  # per GPU; 0 with memory_percent 0 = the whole card
    memory_percent: int = 0
    cores: int = 0

    def memory_on(self, capacity_mib: int) -> int:
        if self.memory_mib:
            return self.memory_mib
        if self.memory_percent:
            return capacity_mib * self.memory_percent // 100
        return capacity_mib

    def fits(self, gpu: FreeGpu) -> bool:
        return gpu.free_memory_mib >= self.memory_on(gpu.memory_mib) and (
            gpu.free_cores >= self.cores
        )


def shapes_of(requests: Iterable[ContainerRequest]) -> set[Shape]:
    return {
        Shape(gpus=r.gpus, memory_mib=r.memory_mib, memory_percent=r.memory_percent,
              cores=r.cores)
        for r in requests
        if r.gpus > 0
    }  # fmt: skip


def stranded_memory(gpus: list[FreeGpu], shapes: set[Shape]) -> dict[str, int]:
    """Stranded MiB per GPU uuid (GPUs with none stranded are left out)."""
    if not shapes:
        return {}
    usable: set[str] = set()
    by_node: dict[str, list[FreeGpu]] = {}
    for gpu in gpus:
        by_node.setdefault(gpu.node, []).append(gpu)
    for shape in shapes:
        for on_node in by_node.values():
            fitting = [gpu.uuid for gpu in on_node if shape.fits(gpu)]
            if len(fitting) >= shape.gpus:
                usable.update(fitting)
    return {
        gpu.uuid: gpu.free_memory_mib
        for gpu in gpus
        if gpu.uuid not in usable and gpu.free_memory_mib > 0
    }
