"""Node labels in the style of NVIDIA's GPU Feature Discovery, so users can select nodes.

`gpu_labels` is pure; a NodeLabeler applies the labels: `KubernetesNodeLabeler` patches the
Node object (a merge patch that also removes the labels this agent set earlier and no longer
wants), `MemoryNodeLabeler` keeps them for local clusters and tests.
"""

from __future__ import annotations

import asyncio
import logging
import re
from collections import Counter
from typing import Any, Protocol

from services.common.schemas import GpuDevice

log = logging.getLogger("vgpu.nodeagent")

PRODUCT = "nvidia.com/gpu.product"
COUNT = "nvidia.com/gpu.count"
MEMORY = "nvidia.com/gpu.memory"  # MiB, as GFD
REPLICAS = "nvidia.com/gpu.replicas"
SHARING = "nvidia.com/gpu.sharing-strategy"
COMPUTE_MAJOR = "nvidia.com/gpu.compute.major"
COMPUTE_MINOR = "nvidia.com/gpu.compute.minor"
MIG_CAPABLE = "nvidia.com/mig.capable"
DRIVER_MAJOR = "nvidia.com/cuda.driver-version.major"
DRIVER_MINOR = "nvidia.com/cuda.driver-version.minor"
DRIVER_REV = "nvidia.com/cuda.driver-version.revision"
DRIVER_FULL = "nvidia.com/cuda.driver-version.full"
CUDA_MAJOR = "nvidia.com/cuda.runtime-version.major"
CUDA_MINOR = "nvidia.com/cuda.runtime-version.minor"
CUDA_FULL = "nvidia.com/cuda.runtime-version.full"
MODELS = "vgpu.io/gpu.models"  # every model on the node, "A100-40GB.2_T4.1", for mixed nodes

_UNSAFE = re.compile(r"[^A-Za-z0-9_.-]+")


def label_value(text: str) -> str:
    """A Kubernetes label value: at most 63 of [A-Za-z0-9_.-], alphanumeric at both ends."""
    value = _UNSAFE.sub("-", text.strip())[:63]
    return value.strip("-_.")


def _version_parts(version: str) -> list[str]:
    return [part for part in re.split(r"[.-]", version) if part.isdigit()]


def gpu_labels(gpus: list[GpuDevice], driver: str, cuda: str, replicas: int = 1) -> dict[str, str]:
    """The labels for a node's GPUs; the product is GPU 0's, as GFD labels it."""
    if not gpus:
        return {}
    first = gpus[0]
    labels = {
        PRODUCT: label_value(first.model),
        COUNT: str(len(gpus)),
        MEMORY: str(first.memory_mib),
        REPLICAS: str(replicas),
        SHARING: "vgpu" if replicas > 1 else "none",
        MIG_CAPABLE: "true" if first.mig_mode else "false",
        MODELS: label_value(
            "_".join(f"{model}.{n}" for model, n in sorted(Counter(g.model for g in gpus).items()))
        ),
    }
    if first.compute_capability:
        major, _, minor = first.compute_capability.partition(".")
        labels[COMPUTE_MAJOR], labels[COMPUTE_MINOR] = major, minor or "0"
    parts = _version_parts(driver)
    if parts:
        labels[DRIVER_FULL] = label_value(".".join(parts))
        for key, part in zip((DRIVER_MAJOR, DRIVER_MINOR, DRIVER_REV), parts, strict=False):
            labels[key] = part
    parts = _version_parts(cuda)
    if parts:
        labels[CUDA_FULL] = ".".join(parts)
        for key, part in zip((CUDA_MAJOR, CUDA_MINOR), parts, strict=False):
            labels[key] = part
    return labels


class NodeLabeler(Protocol):
    async def apply(self, labels: dict[str, str]) -> None:
        """Make the node carry exactly `labels` among the labels this agent manages."""
        ...

    async def read(self) -> dict[str, str]:
        """Every label the node carries now (the operator's too, e.g. vgpu.io/mode)."""
        ...


class MemoryNodeLabeler:
    """A node's labels in memory: `node_labels` are the operator's (vgpu up --node-label),
    `labels` those the agent applied."""

    def __init__(self, node_labels: dict[str, str] | None = None) -> None:
        self.node_labels = dict(node_labels or {})
        self.labels: dict[str, str] = {}
        self.applied = 0

    async def apply(self, labels: dict[str, str]) -> None:
        self.labels = dict(labels)
        self.applied += 1

    async def read(self) -> dict[str, str]:
        return {**self.node_labels, **self.labels}


class KubernetesNodeLabeler:
    """Patches `metadata.labels` of the Node through the Kubernetes API (in-cluster config,
    else kubeconfig); needs RBAC `patch` on `nodes`."""

    def __init__(self, node_name: str, api: Any = None) -> None:
        self._node = node_name
        self._api = api
        self._previous: set[str] = set()

    def _core_api(self) -> Any:
        if self._api is None:
            from kubernetes import client, config

            try:
                config.load_incluster_config()
            except config.ConfigException:
                config.load_kube_config()
            self._api = client.CoreV1Api()
        return self._api

    async def apply(self, labels: dict[str, str]) -> None:
        # A merge patch: null removes a label we set before and no longer want.
        patch: dict[str, Any] = {key: None for key in self._previous - set(labels)}
        patch.update(labels)
        body = {"metadata": {"labels": patch}}
        await asyncio.to_thread(self._core_api().patch_node, self._node, body)
        self._previous = set(labels)
        log.info("node labelled", extra={"node": self._node, "labels": labels})

    async def read(self) -> dict[str, str]:
        """The Node's labels (needs RBAC `get` on `nodes`)."""
        node = await asyncio.to_thread(self._core_api().read_node, self._node)
        return dict(node.metadata.labels or {})


def labeler_for(kind: str, node_name: str) -> NodeLabeler | None:
    if kind == "none":
        return None
    if kind == "memory":
        return MemoryNodeLabeler()
    if kind == "kubernetes":
        return KubernetesNodeLabeler(node_name)
    raise ValueError(f"node_labeler must be none, memory or kubernetes, got {kind!r}")
