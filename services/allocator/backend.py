"""The cluster seam: bind pods, annotate them, tell people why a pod waits.

``LocalClusterBackend`` is a small in-memory API server for `vgpu up` and tests: it knows only
pods it was given with ``add_pod`` (``create_pod`` refuses a name in use: AlreadyExists) and
refuses to bind or annotate others, as the real one does. It lists and watches its pods as the
real one does (``run_pod_watch``, ``run_cluster_watch``), and with ``pods_file`` keeps them
across restarts (`vgpu up` keeps it beside its JetStream store).
``kube.KubernetesBackend`` speaks to a real API server with the ``kubernetes`` client.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import json
import os
import time
from pathlib import Path
from typing import Any, Protocol


class BackendError(RuntimeError):
    """The cluster refused or failed an operation; the message says which and why."""


class AlreadyExists(BackendError):
    """A pod of that namespace and name exists (the API server's 409 AlreadyExists)."""


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


def _bound(pod: dict[str, Any]) -> bool:
    return bool(pod["spec"].get("nodeName"))


class LocalClusterBackend:
    def __init__(self, pods_file: str | Path | None = None) -> None:
        self._pods: dict[tuple[str, str], dict[str, Any]] = {}
        self.events: list[dict[str, str]] = []  # what a real API server would keep as Events
        self._watchers: list[asyncio.Queue[tuple[str, dict[str, Any]]]] = []
        self._pods_file = Path(pods_file) if pods_file else None
        if self._pods_file is not None:
            self._load()

    # -- keeping pods across restarts ------------------------------------------------------

    def _load(self) -> None:
        assert self._pods_file is not None
        try:
            stored = json.loads(self._pods_file.read_text())
        except FileNotFoundError:
            return
        except (OSError, ValueError) as exc:
            raise BackendError(f"cannot read the local pods from {self._pods_file}: {exc}") from exc
        for pod in stored if isinstance(stored, list) else []:
            with contextlib.suppress(BackendError, KeyError, TypeError):
                self._pods[pod_key(pod)] = pod

    def _save(self) -> None:
        """Write every pod (small numbers: `vgpu up`), atomically (rename over the old)."""
        if self._pods_file is None:
            return
        partial = self._pods_file.with_name(self._pods_file.name + ".partial")
        partial.parent.mkdir(parents=True, exist_ok=True)
        partial.write_text(json.dumps(list(self._pods.values())))
        os.replace(partial, self._pods_file)

    # -- list + watch -----------------------------------------------------------------------

    def _changed(self, kind: str, pod: dict[str, Any]) -> None:
        self._save()
        for queue in self._watchers:
            queue.put_nowait((kind, copy.deepcopy(pod)))

    async def _follow(self, handler: ListWatchHandler, wanted: Any = lambda pod: True) -> None:
        """List the pods `wanted` selects, then deliver changes as a field-selected watch
        does: a pod that stops matching arrives as DELETED."""
        queue: asyncio.Queue[tuple[str, dict[str, Any]]] = asyncio.Queue()
        self._watchers.append(queue)
        matching: set[str] = set()
        try:
            listed = [copy.deepcopy(p) for p in self._pods.values() if wanted(p)]
            matching = {p["metadata"].get("uid") or "" for p in listed}
            await handler.on_list(listed, time.time())
            while True:
                kind, pod = await queue.get()
                uid = pod["metadata"].get("uid") or ""
                if kind != "DELETED" and wanted(pod):
                    kind = "MODIFIED" if uid in matching else "ADDED"
                    matching.add(uid)
                elif uid in matching:
                    kind = "DELETED"
                    matching.discard(uid)
                else:
                    continue
                await handler.on_change(kind, pod)
        finally:
            self._watchers.remove(queue)

    async def run_cluster_watch(
        self,
        nodes: ListWatchHandler,
        pods: ListWatchHandler,
        unbound: ListWatchHandler | None = None,
    ) -> None:
        """As KubernetesBackend's, from memory: no Node objects here (the agents' hints are
        the nodes' capacity), every pod bound through ``bind`` until it is removed, and
        (`unbound`) the pods no node has yet: the pending ones."""
        await nodes.on_list([], 0.0)
        watches = [self._follow(pods, _bound)]
        if unbound is not None:
            watches.append(self._follow(unbound, lambda pod: not _bound(pod)))
        await asyncio.gather(*watches)

    async def run_pod_watch(self, handler: ListWatchHandler) -> None:
        """Every pod, as KubernetesBackend's (the leader reconciles its bookings with it)."""
        await self._follow(handler)

    # -- pods -------------------------------------------------------------------------------

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
        replaced = self._pods.get(key)
        self._pods[key] = kept
        if replaced is not None and replaced["metadata"].get("uid") != kept["metadata"].get("uid"):
            self._changed("DELETED", replaced)  # another pod of that name: the old one is gone
        self._changed("ADDED", kept)

    def create_pod(self, pod: dict[str, Any]) -> None:
        """As POST pods: a name in use is refused (AlreadyExists), as the API server does."""
        key = pod_key(pod)
        if key in self._pods:
            raise AlreadyExists(f'pods "{key[1]}" already exists')
        self.add_pod(pod)

    def remove_pod(self, namespace: str, name: str) -> dict[str, Any] | None:
        """Delete a pod (its watchers see DELETED); the pod removed, or None if unknown."""
        pod = self._pods.pop((namespace, name), None)
        if pod is not None:
            self._changed("DELETED", pod)
        return pod

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
        pod = self._pod(namespace, name)
        pod["metadata"]["annotations"].update(annotations)
        self._changed("MODIFIED", pod)

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
