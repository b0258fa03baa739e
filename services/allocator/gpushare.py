"""Aliyun gpushare's container environment and pod annotations, for pods asking
``aliyun.com/gpu-mem``, in gpushare's units (GiB of GPU memory; nanoseconds for time).

gpushare's extender writes, at bind, the annotations ``ALIYUN_COM_GPU_MEM_IDX`` (GPU index),
``ALIYUN_COM_GPU_MEM_POD`` (GiB the pod's app containers ask), ``ALIYUN_COM_GPU_MEM_DEV``
(GiB of the whole GPU), ``ALIYUN_COM_GPU_MEM_ASSIGNED`` ("false" until the device plugin has
allocated) and ``ALIYUN_COM_GPU_MEM_ASSUME_TIME`` (bind time, Unix ns); its device plugin sets
the variables ``ALIYUN_COM_GPU_MEM_IDX``, ``_POD``, ``_CONTAINER`` (GiB this container asks)
and ``_DEV`` in each container at Allocate. vgpu's Allocate cannot tell which pod it serves
(that is by design: docs/nodeagent.md), so the admission webhook gives the containers the same
variables instead: the amounts known at admission as values, the GPU index and size by the
downward API from the annotations the allocator writes before the pod is bound, which the
kubelet resolves when it starts the container. The container sees what gpushare gave it.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

from services.common.resources import (
    DEFAULT_CONFIG,
    RequestConfig,
    pod_container_values,
)
from services.common.schemas import GpuSlice, PodAllocation

IDX = "ALIYUN_COM_GPU_MEM_IDX"
POD = "ALIYUN_COM_GPU_MEM_POD"
CONTAINER = "ALIYUN_COM_GPU_MEM_CONTAINER"
DEV = "ALIYUN_COM_GPU_MEM_DEV"
ASSIGNED = "ALIYUN_COM_GPU_MEM_ASSIGNED"
ASSUME_TIME = "ALIYUN_COM_GPU_MEM_ASSUME_TIME"
ENV_NAMES = (IDX, POD, CONTAINER, DEV)
GIB_MIB = 1024


def asked_gib(pod: Mapping[str, Any], config: RequestConfig = DEFAULT_CONFIG) -> dict[str, int]:
    """What each container asks in gpushare's syntax, in gpushare's unit (GiB unless its
    --memory-unit is MiB: `aliyun_unit_mib`), by container name (init ones included)."""
    return {
        name: (values.memory_mib or 0) // config.aliyun_unit_mib
        for _, _, name, values in pod_container_values(pod, config)
        if values is not None and values.syntax == "aliyun"
    }


def pod_gib(pod: Mapping[str, Any], config: RequestConfig = DEFAULT_CONFIG) -> int:
    """gpushare's pod total: the app containers' GiB (init containers not counted)."""
    app = {c.get("name") for c in (pod.get("spec") or {}).get("containers") or []}
    return sum(gib for name, gib in asked_gib(pod, config).items() if name in app)


def _from_annotation(name: str) -> dict[str, Any]:
    return {
        "name": name,
        "valueFrom": {"fieldRef": {"fieldPath": f"metadata.annotations['{name}']"}},
    }


def container_env(total_gib: int, container_gib: int) -> list[dict[str, Any]]:
    """The four variables of a container asking `container_gib` of a pod asking `total_gib`."""
    return [
        _from_annotation(IDX),
        {"name": POD, "value": str(total_gib)},
        {"name": CONTAINER, "value": str(container_gib)},
        _from_annotation(DEV),
    ]


def with_env(env: list[dict[str, Any]], total_gib: int, container_gib: int) -> list[dict[str, Any]]:
    """`env` with gpushare's variables set by vgpu (a container's own values are replaced)."""
    kept = [e for e in env if e.get("name") not in ENV_NAMES]
    return [*kept, *container_env(total_gib, container_gib)]


def bind_annotations(
    total_gib: int,
    gpu_index: int,
    gpu_memory_mib: int,
    now_ns: int | None = None,
    unit_mib: int = GIB_MIB,
) -> dict[str, str]:
    """What gpushare's extender writes on the pod at bind (amounts in gpushare's unit)."""
    return {
        IDX: str(gpu_index),
        POD: str(total_gib),
        DEV: str(gpu_memory_mib // unit_mib),
        ASSIGNED: "false",
        ASSUME_TIME: str(time.time_ns() if now_ns is None else now_ns),
    }


def assigned_annotations(now_ns: int | None = None) -> dict[str, str]:
    """What gpushare's device plugin writes once it has allocated the pod."""
    return {ASSIGNED: "true", ASSUME_TIME: str(time.time_ns() if now_ns is None else now_ns)}


def pod_total(pod: Mapping[str, Any], config: RequestConfig = DEFAULT_CONFIG) -> int | None:
    """The pod's GiB if it is a gpushare pod, else None: from its `aliyun.com/gpu-mem` names
    (no webhook ran) or from the POD annotation the webhook wrote when it translated them."""
    if asked_gib(pod, config):
        return pod_gib(pod, config)
    annotations = (pod.get("metadata") or {}).get("annotations") or {}
    value = annotations.get(POD) if isinstance(annotations, Mapping) else None
    if isinstance(value, str) and value.isdigit():
        return int(value)
    return None


def first_gpu(pod: Mapping[str, Any], allocation: PodAllocation) -> GpuSlice | None:
    """The GPU gpushare's IDX names: the first app container's (in pod order) first slice."""
    for container in (pod.get("spec") or {}).get("containers") or []:
        decided = allocation.containers.get(container.get("name"))
        if decided is not None and not decided.init and decided.slices:
            return decided.slices[0]
    return None
