"""The Kubernetes cluster backend, with the official ``kubernetes`` client.

- bind: POST ``pods/<name>/binding`` (a v1.Binding carrying the pod's UID as precondition);
- annotate: PATCH the pod (merge patch) with the decision, JSON keyed by container name;
- get_pod: GET the pod as plain JSON (camelCase, as the extender receives it);
- emit_event: POST a v1.Event (reason ``VgpuUnschedulable``) for scheduling failures;
- run_pod_watch: list every pod, hand the list to the rebuild, then watch from the list's
  resourceVersion (relisting on 410 Gone) and release a pod's slices when it is deleted or
  reaches Succeeded/Failed (the leader);
- run_cluster_watch: Nodes (allocatable CPU, memory, pods) and the pods bound to them, GPU or
  not, as kube-scheduler sees them (every replica; cluster_watch.py keeps the counts).

The client is synchronous (urllib3), so every call runs in a worker thread.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import datetime
import functools
import json
import logging
import threading
import time
from typing import Any

from kubernetes import client as k8s
from kubernetes import config as k8s_config
from kubernetes import watch as k8s_watch
from kubernetes.client.rest import ApiException

from .backend import BackendError, ListWatchHandler
from .reconcile import PodWatchHandler

__all__ = ["KubernetesBackend", "PodWatchHandler"]  # the handler's home is reconcile.py

log = logging.getLogger("vgpu.allocator")

WATCH_TIMEOUT_S = 5  # each watch request ends this often, so stopping never waits long
# Lists and watches block a thread each for up to WATCH_TIMEOUT_S: they get their own threads
# (nodes, bound pods, unbound pods, every pod), so binds and patches never queue behind them.
WATCH_THREADS = 4
# Binds, patches and reads run on asyncio's default threads (CPUs + 4, at most 32) beside the
# watch threads; urllib3's default of 10 pooled connections made bursts drop connections.
CONNECTION_POOL_SIZE = 40
# A bind, patch, read or event the API server never answers fails after this long instead of
# holding its thread (and the pod's bind) forever; kube-scheduler gave up after its own
# extender httpTimeout (5 s in deploy/k8s) long before.
REQUEST_TIMEOUT_S = 10.0
# kube-scheduler's pod informers: assigned pods that have not ended, and the pending ones.
BOUND_RUNNING_PODS = "spec.nodeName!=,status.phase!=Succeeded,status.phase!=Failed"
UNBOUND_PODS = "spec.nodeName=,status.phase!=Succeeded,status.phase!=Failed"


def _api_client(configuration: k8s.Configuration) -> k8s.ApiClient:
    configuration.connection_pool_maxsize = CONNECTION_POOL_SIZE  # read when the pool is made
    return k8s.ApiClient(configuration)


def _api_error(exc: ApiException) -> str:
    try:
        return str(json.loads(exc.body).get("message") or exc.reason)
    except (TypeError, ValueError):
        return str(exc.reason)


class KubernetesBackend:
    def __init__(
        self,
        api_client: k8s.ApiClient,
        component: str = "vgpu-allocator",
        request_timeout_s: float = REQUEST_TIMEOUT_S,
    ) -> None:
        self._api_client = api_client
        self.request_timeout_s = request_timeout_s
        self.core = k8s.CoreV1Api(api_client)
        self.component = component
        self._stopping = threading.Event()
        self._watch_pool = concurrent.futures.ThreadPoolExecutor(
            WATCH_THREADS, thread_name_prefix="kube-watch"
        )

    @classmethod
    def from_settings(cls, settings: Any) -> KubernetesBackend:
        configuration = k8s.Configuration()
        if settings.kube_api_url:
            configuration.host = settings.kube_api_url
        elif settings.kubeconfig:
            k8s_config.load_kube_config(
                config_file=settings.kubeconfig, client_configuration=configuration
            )
        else:
            k8s_config.load_incluster_config(client_configuration=configuration)
        return cls(_api_client(configuration))

    @classmethod
    def for_url(cls, url: str, request_timeout_s: float = REQUEST_TIMEOUT_S) -> KubernetesBackend:
        configuration = k8s.Configuration()
        configuration.host = url
        return cls(_api_client(configuration), request_timeout_s=request_timeout_s)

    async def close(self) -> None:
        self._stopping.set()
        self._watch_pool.shutdown(wait=False, cancel_futures=True)
        await asyncio.to_thread(self._api_client.close)

    # -- ClusterBackend -------------------------------------------------------------------

    async def bind(self, namespace: str, name: str, uid: str, node: str) -> None:
        body = {
            "apiVersion": "v1",
            "kind": "Binding",
            "metadata": {"name": name, "namespace": namespace, "uid": uid},
            "target": {"apiVersion": "v1", "kind": "Node", "name": node},
        }
        try:
            # The generated client cannot decode the Status this call answers with: read raw.
            await asyncio.to_thread(
                self.core.create_namespaced_pod_binding,
                name,
                namespace,
                body,
                _preload_content=False,
                _request_timeout=self.request_timeout_s,
            )
        except ApiException as exc:
            raise BackendError(f"binding refused ({exc.status}): {_api_error(exc)}") from exc

    async def annotate(self, namespace: str, name: str, annotations: dict[str, str]) -> None:
        patch = {"metadata": {"annotations": annotations}}
        try:
            await asyncio.to_thread(
                self.core.patch_namespaced_pod,
                name,
                namespace,
                patch,
                _preload_content=False,
                _request_timeout=self.request_timeout_s,
            )
        except ApiException as exc:
            raise BackendError(f"patch refused ({exc.status}): {_api_error(exc)}") from exc

    async def get_pod(self, namespace: str, name: str) -> dict[str, Any] | None:
        try:
            response = await asyncio.to_thread(
                self.core.read_namespaced_pod,
                name,
                namespace,
                _preload_content=False,
                _request_timeout=self.request_timeout_s,
            )
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise BackendError(f"cannot read pod ({exc.status}): {_api_error(exc)}") from exc
        return json.loads(response.data)

    async def emit_event(
        self, namespace: str, name: str, uid: str, reason: str, message: str
    ) -> None:
        now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        event = {
            "apiVersion": "v1",
            "kind": "Event",
            "metadata": {"generateName": f"{name}.", "namespace": namespace},
            "involvedObject": {
                "apiVersion": "v1", "kind": "Pod", "namespace": namespace, "name": name,
                "uid": uid,
            },
            "reason": reason,
            "message": message,
            "type": "Warning",
            "source": {"component": self.component},
            "reportingComponent": self.component,
            "firstTimestamp": now,
            "lastTimestamp": now,
            "count": 1,
        }  # fmt: skip
        try:
            await asyncio.to_thread(
                self.core.create_namespaced_event,
                namespace,
                event,
                _preload_content=False,
                _request_timeout=self.request_timeout_s,
            )
        except ApiException as exc:
            raise BackendError(f"event refused ({exc.status}): {_api_error(exc)}") from exc

    # -- list + watch ---------------------------------------------------------------------

    def _list(self, list_fn: Any, **filters: Any) -> tuple[list[dict[str, Any]], str]:
        response = list_fn(_preload_content=False, **filters)
        listed = json.loads(response.data)
        return listed.get("items") or [], str(listed["metadata"]["resourceVersion"])

    def _watch_once(
        self, list_fn: Any, resource_version: str, deliver: Any, **filters: Any
    ) -> tuple[str, bool]:
        """One watch request; (last resourceVersion, gone) — gone asks for a relist."""
        watcher = k8s_watch.Watch()
        try:
            for event in watcher.stream(
                list_fn,
                resource_version=resource_version,
                timeout_seconds=WATCH_TIMEOUT_S,
                allow_watch_bookmarks=True,
                deserialize=False,  # plain JSON: no model validation of other people's pods
                **filters,
            ):
                if self._stopping.is_set():
                    break
                raw = event.get("object") or {}
                if event.get("type") == "ERROR":
                    return resource_version, True
                version = (raw.get("metadata") or {}).get("resourceVersion")
                if version:
                    resource_version = str(version)
                if event.get("type") in ("ADDED", "MODIFIED", "DELETED"):
                    deliver(event["type"], raw)
        except ApiException as exc:
            return resource_version, exc.status == 410
        except KeyError:  # the client trips over an ERROR event when not deserializing: 410
            return resource_version, True
        finally:
            watcher.stop()
        return resource_version, False

    async def _follow(
        self, what: str, list_fn: Any, handler: ListWatchHandler, **filters: Any
    ) -> None:
        """List (handing the list over), then follow changes, relisting on 410 Gone."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[tuple[str, dict[str, Any]]] = asyncio.Queue()

        def deliver(kind: str, obj: dict[str, Any]) -> None:
            loop.call_soon_threadsafe(queue.put_nowait, (kind, obj))

        async def consume() -> None:
            while True:
                kind, obj = await queue.get()
                try:
                    await handler.on_change(kind, obj)
                except Exception:
                    log.exception("watch handler failed", extra={"resource": what})
                finally:
                    queue.task_done()

        consumer = asyncio.create_task(consume())
        try:
            while not self._stopping.is_set():
                started = time.time()
                try:
                    items, version = await loop.run_in_executor(
                        self._watch_pool, functools.partial(self._list, list_fn, **filters)
                    )
                except Exception as exc:
                    log.warning("cannot list", extra={"resource": what, "error": str(exc)})
                    await asyncio.sleep(1)
                    continue
                await queue.join()  # what the last watch said is older than this list
                await handler.on_list(items, started)
                gone = False
                while not gone and not self._stopping.is_set():
                    try:
                        version, gone = await loop.run_in_executor(
                            self._watch_pool,
                            functools.partial(
                                self._watch_once, list_fn, version, deliver, **filters
                            ),
                        )
                    except Exception as exc:  # the connection broke: list again, later
                        log.warning(
                            "watch interrupted", extra={"resource": what, "error": str(exc)}
                        )
                        await asyncio.sleep(1)
                        gone = True
        finally:
            consumer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await consumer

    async def run_pod_watch(self, handler: ListWatchHandler) -> None:
        """Every pod: rebuild at each list, release pods that end (the leader's job)."""
        await self._follow("pods", self.core.list_pod_for_all_namespaces, handler)

    async def run_cluster_watch(
        self,
        nodes: ListWatchHandler,
        pods: ListWatchHandler,
        unbound: ListWatchHandler | None = None,
    ) -> None:
        """What kube-scheduler sees: the Nodes (allocatable), the pods bound to them that
        have not ended (the same field selector as kube-scheduler's pod informer, so a pod
        that ends arrives as DELETED) and (`unbound`) the pending pods, which leave that
        selection, as DELETED, when they are bound or deleted. Every replica runs it."""
        watches = [
            self._follow("nodes", self.core.list_node, nodes),
            self._follow(
                "bound pods",
                self.core.list_pod_for_all_namespaces,
                pods,
                field_selector=BOUND_RUNNING_PODS,
            ),
        ]
        if unbound is not None:
            watches.append(
                self._follow(
                    "unbound pods",
                    self.core.list_pod_for_all_namespaces,
                    unbound,
                    field_selector=UNBOUND_PODS,
                )
            )
        await asyncio.gather(*watches)
