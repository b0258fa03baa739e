"""What a pod asks of the allocator: its containers' GPU requests plus its selection annotations.

Parsed once per call from the v1.Pod JSON; ``PodRequest.shape`` is a hashable key for caches,
so two pods asking the same thing in the same way share every cached decision.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from services.common.host_requests import pod_host_requests
from services.common.resources import (
    DEFAULT_CONFIG,
    RequestConfig,
    RequestError,
    container_requests,
)
from services.common.schemas import ContainerRequest, GpuDevice

# HAMi's selection annotations (peers.md), honoured as HAMi users write them.
USE_GPU_TYPE = "nvidia.com/use-gputype"
NOUSE_GPU_TYPE = "nvidia.com/nouse-gputype"
USE_GPU_UUID = "nvidia.com/use-gpuuuid"
NOUSE_GPU_UUID = "nvidia.com/nouse-gpuuuid"
NODE_POLICY = "hami.io/node-scheduler-policy"
GPU_POLICY = "hami.io/gpu-scheduler-policy"
NUMA_BIND = "nvidia.com/numa-bind"
# vgpu's own spelling of the two policy annotations; HAMi's win when both are given.
VGPU_NODE_POLICY = "vgpu.io/node-policy"
VGPU_GPU_POLICY = "vgpu.io/gpu-policy"

POLICY_ALIASES = {"topology-aware": "topology"}


@dataclass(frozen=True)
class Selection:
    """Which GPUs a pod accepts: model substrings and UUIDs to use or avoid."""

    use_types: tuple[str, ...] = ()
    nouse_types: tuple[str, ...] = ()
    use_uuids: frozenset[str] = frozenset()
    nouse_uuids: frozenset[str] = frozenset()

    @property
    def restricts(self) -> bool:
        return bool(self.use_types or self.nouse_types or self.use_uuids or self.nouse_uuids)

    def allows(self, gpu: GpuDevice) -> bool:
        return self.allows_model(gpu.model) and self.allows_uuid(gpu.uuid)

    def allows_model(self, model: str) -> bool:
        lowered = model.lower()
        if self.use_types and not any(t in lowered for t in self.use_types):
            return False
        return not any(t in lowered for t in self.nouse_types)

    def allows_uuid(self, uuid: str) -> bool:
        if self.use_uuids and uuid not in self.use_uuids:
            return False
        return uuid not in self.nouse_uuids

    def describe(self) -> str:
        parts = []
        if self.use_types:
            parts.append(f"{USE_GPU_TYPE}={','.join(self.use_types)}")
        if self.nouse_types:
            parts.append(f"{NOUSE_GPU_TYPE}={','.join(self.nouse_types)}")
        if self.use_uuids:
            parts.append(f"{USE_GPU_UUID}={','.join(sorted(self.use_uuids))}")
        if self.nouse_uuids:
            parts.append(f"{NOUSE_GPU_UUID}={','.join(sorted(self.nouse_uuids))}")
        return ", ".join(parts)


@dataclass(frozen=True)
class PodRequest:
    containers: tuple[ContainerRequest, ...]  # init containers first, as in the pod
    selection: Selection = field(default_factory=Selection)
    node_policy: str = ""  # "" = the allocator's default
    gpu_policy: str = ""
    numa_bind: bool = False
    # What the pod holds on its node, as kube-scheduler counts it (host_requests.py).
    cpu_milli: int = 0
    memory_mib: int = 0

    @functools.cached_property
    def shape(self) -> tuple[Any, ...]:
        """Everything GPU placement depends on, hashable (names included: reasons quote
        them). Host CPU and memory are left out: they are checked apart, uncached."""
        return (self.containers, self.selection, self.node_policy, self.gpu_policy, self.numa_bind)

    @property
    def app(self) -> tuple[ContainerRequest, ...]:
        return tuple(r for r in self.containers if not r.init)

    @property
    def init(self) -> tuple[ContainerRequest, ...]:
        return tuple(r for r in self.containers if r.init)


def _list(annotations: Mapping[str, Any], key: str, lower: bool) -> tuple[str, ...]:
    value = annotations.get(key)
    if value is None:
        return ()
    if not isinstance(value, str):
        raise RequestError(f"annotation {key}: expected a comma-separated string")
    items = [item.strip() for item in value.split(",") if item.strip()]
    return tuple(item.lower() for item in items) if lower else tuple(items)


def _policy(annotations: Mapping[str, Any], keys: tuple[str, ...], known: frozenset[str]) -> str:
    for key in keys:
        value = annotations.get(key)
        if value is None:
            continue
        if not isinstance(value, str):
            raise RequestError(f"annotation {key}: expected a string")
        name = POLICY_ALIASES.get(value.strip().lower(), value.strip().lower())
        if name not in known:
            raise RequestError(
                f"annotation {key}: unknown policy {value!r} (known: {', '.join(sorted(known))})"
            )
        return name
    return ""


def parse_pod(
    pod: Mapping[str, Any],
    known_policies: frozenset[str],
    config: RequestConfig = DEFAULT_CONFIG,
) -> PodRequest:
    """The pod's request; RequestError naming the culprit when anything is malformed."""
    requests = container_requests(pod, config)
    seen: set[str] = set()
    for request in requests:
        if request.container in seen:
            raise RequestError(f"container name {request.container!r} is used twice in the pod")
        seen.add(request.container)
    metadata = pod.get("metadata") or {}
    annotations = metadata.get("annotations") if isinstance(metadata, Mapping) else None
    if not isinstance(annotations, Mapping):
        annotations = {}
    selection = Selection(
        use_types=_list(annotations, USE_GPU_TYPE, lower=True),
        nouse_types=_list(annotations, NOUSE_GPU_TYPE, lower=True),
        use_uuids=frozenset(_list(annotations, USE_GPU_UUID, lower=False)),
        nouse_uuids=frozenset(_list(annotations, NOUSE_GPU_UUID, lower=False)),
    )
    numa = annotations.get(NUMA_BIND, "")
    if not isinstance(numa, str) or numa.strip().lower() not in ("", "true", "false"):
        raise RequestError(f'annotation {NUMA_BIND}: expected "true" or "false", got {numa!r}')
    host = pod_host_requests(pod)  # every pod: CPU-only pods are scored by it too
    return PodRequest(
        containers=tuple(requests),
        selection=selection,
        node_policy=_policy(annotations, (NODE_POLICY, VGPU_NODE_POLICY), known_policies),
        gpu_policy=_policy(annotations, (GPU_POLICY, VGPU_GPU_POLICY), known_policies),
        numa_bind=numa.strip().lower() == "true",
        cpu_milli=host.cpu_milli,
        memory_mib=host.memory_mib,
    )
