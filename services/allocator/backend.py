"""The cluster seam: bind pods, annotate them, tell people why a pod waits.

``LocalClusterBackend`` is a small in-memory API server for `vgpu up` and tests: it knows only
pods it was given with ``add_pod`` and refuses to bind or annotate others, as the real one does.
``kube.KubernetesBackend`` speaks to a real API server with the ``kubernetes`` client.
"""

from __future__ import annotations

import asyncio
import copy
from typing import Any, Protocol


class BackendError(RuntimeError):
    """The cluster refused or failed an operation; the message says which and why."""


class ClusterBackend(Protocol):
    async def bind(self, namespace: str, name: str, uid: str, node: str) -> None: ...

    async def annotate(self, namespace: str, name: str, annotations: dict[str, str]) -> None: ...

    async def get_pod(self, namespace: str, name: str) -> dict[str, Any] | None: ...

    async def emit_event(
        self, namespace: str, name: str, uid: str, reason: str, message: str
    ) -> None: ...


def pod_key(pod: dict[str, Any]) -> tuple[str, str]:
    metadata = pod.get("metadata")
    if not isinstance(metadata, dict) or not isinstance(metadata.get("name"), str):
        raise BackendError("pod has no metadata.name")
    namespace = metadata.get("namespace") or "default"
    if not isinstance(namespace, str):
        raise BackendError("pod metadata.namespace must be a string")
    return namespace, metadata["name"]


class ListWatchHandler(Protocol):
    async def on_list(self, items: list[dict[str, Any]], listed_at: float) -> None: ...

    async def on_change(self, kind: str, obj: dict[str, Any]) -> None: ...


class LocalClusterBackend:
    def __init__(self) -> None:
        self._pods: dict[tuple[str, str], dict[str, Any]] = {}
        self.events: list[dict[str, str]] = []  # what a real API server would keep as Events
        self._watchers: list[asyncio.Queue[tuple[str, dict[str, Any]]]] = []

    def _changed(self, kind: str, pod: dict[str, Any]) -> None:
        for queue in self._watchers:
            queue.put_nowait((kind, copy.deepcopy(pod)))

    async def run_cluster_watch(self, nodes: ListWatchHandler, pods: ListWatchHandler) -> None:
        """As KubernetesBackend's, from memory: no Node objects here (the agents' hints are
        the nodes' capacity), and every pod bound through ``bind`` until it is removed."""
        queue: asyncio.Queue[tuple[str, dict[str, Any]]] = asyncio.Queue()
        self._watchers.append(queue)
        try:
            await nodes.on_list([], 0.0)
            bound = [copy.deepcopy(p) for p in self._pods.values() if p["spec"].get("nodeName")]
            await pods.on_list(bound, 0.0)
            while True:
                kind, pod = await queue.get()
                await pods.on_change(kind, pod)
        finally:
            self._watchers.remove(queue)

    def add_pod(self, pod: dict[str, Any]) -> None:
        """Make a pod known (a copy is kept); replaces a pod of the same namespace/name."""
        if not isinstance(pod, dict):
            raise BackendError("a pod must be a JSON object")
        key = pod_key(pod)
        kept = copy.deepcopy(pod)
        kept["spec"] = kept.get("spec") or {}
        kept["metadata"]["annotations"] = kept["metadata"].get("annotations") or {}
        if not isinstance(kept["spec"], dict):
            raise BackendError(f"pod {key[0]}/{key[1]}: spec must be an object")
        if not isinstance(kept["metadata"]["annotations"], dict):
            raise BackendError(f"pod {key[0]}/{key[1]}: metadata.annotations must be an object")
        self._pods[key] = kept

    def remove_pod(self, namespace: str, name: str) -> None:
        pod = self._pods.pop((namespace, name), None)
        if pod is not None:
            self._changed("DELETED", pod)

    def set_phase(self, namespace: str, name: str, phase: str) -> None:
        """The pod ran to an end (Succeeded, Failed) or changed phase, as its kubelet says."""
        pod = self._pod(namespace, name)
        pod.setdefault("status", {})["phase"] = phase
        self._changed("MODIFIED", pod)

    def _pod(self, namespace: str, name: str) -> dict[str, Any]:
        pod = self._pods.get((namespace, name))
        if pod is None:
            raise BackendError(f"pod {namespace}/{name} not found")
        return pod

    async def bind(self, namespace: str, name: str, uid: str, node: str) -> None:
        pod = self._pod(namespace, name)
        known_uid = pod["metadata"].get("uid") or ""
        if uid and known_uid and uid != known_uid:
            raise BackendError(f"pod {namespace}/{name} has uid {known_uid}, not {uid}")
        spec = pod["spec"]
        bound = spec.get("nodeName")
        if bound and bound != node:
            raise BackendError(f"pod {namespace}/{name} is already assigned to node {bound}")
        spec["nodeName"] = node
        self._changed("MODIFIED", pod)

    async def annotate(self, namespace: str, name: str, annotations: dict[str, str]) -> None:
        self._pod(namespace, name)["metadata"]["annotations"].update(annotations)

    async def get_pod(self, namespace: str, name: str) -> dict[str, Any] | None:
        pod = self._pods.get((namespace, name))
        return None if pod is None else copy.deepcopy(pod)

    def node_of(self, namespace: str, name: str) -> str | None:
        pod = self._pods.get((namespace, name))
        return None if pod is None else pod["spec"].get("nodeName")

    def annotations_of(self, namespace: str, name: str) -> dict[str, str]:
        pod = self._pods.get((namespace, name))
        return {} if pod is None else dict(pod["metadata"]["annotations"])

    async def emit_event(
        self, namespace: str, name: str, uid: str, reason: str, message: str
    ) -> None:
        self.events.append(
            {"namespace": namespace, "name": name, "uid": uid, "reason": reason, "message": message}
        )
        del self.events[:-1000]  # bounded, like the API server's event TTL
