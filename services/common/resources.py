"""Pod resource names vgpu reads, and their translation into ContainerRequests.

HAMi-compatible names. A container takes part in GPU sharing when it names any of them;
``nvidia.com/gpu`` defaults to 1 when only memory or cores are given, as HAMi does.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from services.common.schemas import ContainerRequest

GPU = "nvidia.com/gpu"
GPU_MEMORY = "nvidia.com/gpumem"
GPU_MEMORY_PERCENT = "nvidia.com/gpumem-percentage"
GPU_CORES = "nvidia.com/gpucores"

GPU_RESOURCES = (GPU, GPU_MEMORY, GPU_MEMORY_PERCENT, GPU_CORES)


class RequestError(ValueError):
    """A pod's GPU request is malformed or impossible; the message names the culprit."""


def _quantity(value: Any, where: str) -> int:
    """Extended resources are whole numbers; accept ints and integral strings only."""
    if isinstance(value, bool):
        raise RequestError(f"{where}: expected a whole number, got {value!r}")
    if isinstance(value, int):
        number = value
    elif isinstance(value, str) and value.strip().isdigit():
        number = int(value.strip())
    else:
        raise RequestError(f"{where}: expected a whole number, got {value!r}")
    return number


def _gpu_resources(container: Mapping[str, Any], where: str) -> dict[str, int]:
    resources = container.get("resources") or {}
    if not isinstance(resources, Mapping):
        raise RequestError(f"{where}.resources: expected an object")
    limits = resources.get("limits") or {}
    requests = resources.get("requests") or {}
    if not isinstance(limits, Mapping) or not isinstance(requests, Mapping):
        raise RequestError(f"{where}.resources: limits and requests must be objects")
    found: dict[str, int] = {}
    for name in GPU_RESOURCES:
        limit = limits.get(name)
        request = requests.get(name)
        if limit is None and request is None:
            continue
        value = _quantity(limit if limit is not None else request, f"{where} {name}")
        if limit is not None and request is not None and _quantity(request, where) != value:
            raise RequestError(f"{where} {name}: requests must equal limits for extended resources")
        found[name] = value
    return found


def _container_request(
    container: Mapping[str, Any], where: str, init: bool
) -> ContainerRequest | None:
    name = container.get("name")
    if not isinstance(name, str) or not name:
        raise RequestError(f"{where}: container has no name")
    where = f"{where} {name!r}"
    found = _gpu_resources(container, where)
    if not found:
        return None
    gpus = found.get(GPU, 1)
    memory = found.get(GPU_MEMORY, 0)
    percent = found.get(GPU_MEMORY_PERCENT, 0)
    cores = found.get(GPU_CORES, 0)
    if gpus < 1:
        if len(found) == 1:
            return None  # nvidia.com/gpu: 0 alone asks for nothing
        raise RequestError(f"{where}: {GPU} must be at least 1 when memory or cores are asked")
    if not 0 <= percent <= 100:
        raise RequestError(f"{where} {GPU_MEMORY_PERCENT}: must be 0-100, got {percent}")
    if not 0 <= cores <= 100:
        raise RequestError(f"{where} {GPU_CORES}: must be 0-100, got {cores}")
    if memory and percent:
        raise RequestError(f"{where}: give {GPU_MEMORY} or {GPU_MEMORY_PERCENT}, not both")
    if GPU_MEMORY not in found and GPU_MEMORY_PERCENT not in found and GPU_CORES not in found:
        cores = 100  # a bare nvidia.com/gpu asks for whole GPUs
    return ContainerRequest(
        container=name,
        gpus=gpus,
        memory_mib=memory,
        memory_percent=percent,
        cores=cores,
        init=init,
    )


def _containers(spec: Mapping[str, Any], key: str) -> Iterable[Mapping[str, Any]]:
    items = spec.get(key) or []
    if not isinstance(items, list) or not all(isinstance(c, Mapping) for c in items):
        raise RequestError(f"spec.{key}: expected a list of containers")
    return items


def container_requests(pod: Mapping[str, Any]) -> list[ContainerRequest]:
    """The GPU requests of every container and init container of a v1.Pod (JSON form)."""
    spec = pod.get("spec")
    if not isinstance(spec, Mapping):
        raise RequestError("pod has no spec")
    found: list[ContainerRequest] = []
    for key, init in (("initContainers", True), ("containers", False)):
        for container in _containers(spec, key):
            request = _container_request(container, f"spec.{key}", init)
            if request is not None:
                found.append(request)
    return found


def asks_for_gpu(pod: Mapping[str, Any]) -> bool:
    return bool(container_requests(pod))
