"""An in-process Kubernetes API server for the REST subset vgpu uses, over real HTTP.

Pods: create, get, list and watch (cluster-wide and per namespace) with resourceVersion
semantics (every write bumps one counter; a list returns it; a watch from N replays the
changes after N, or answers 410 Gone when N is older than what it keeps), patch (JSON merge,
strategic merge treated as JSON merge, and JSON patch), delete, the ``binding`` subresource
(refusing a pod already bound or a UID mismatch with 409), ``status`` updates; Events create
and list; Nodes get, list and watch; TokenReview and SubjectAccessReview, answered from
`users` (kube_users.py). Errors are ``v1.Status`` objects, as the real server sends.

List and watch take a ``fieldSelector`` as the real server does for the fields it indexes
(pods: metadata.name, metadata.namespace, spec.nodeName, spec.schedulerName, status.phase;
nodes: metadata.name; ``=``, ``==`` and ``!=``, comma-separated, all must hold; any other
field is 400). A watch through a selector sees an object ADDED when it starts to match,
MODIFIED while it matches and DELETED (with its last matching content and the new
resourceVersion) when it stops matching, as the watch cache sends them.

Pod CREATE runs the mutating admission webhooks given (``admission``, see admission.py)
before the pod is stored, as the real server does: AdmissionReview v1 over HTTPS, the JSON
patch applied, failurePolicy honoured, a denial answered with the webhook's reason.

The real ``kubernetes`` Python client drives it in tests; ``vgpu up`` may use it later.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import datetime
import json
import uuid
from collections import deque
from typing import Any

import msgspec
from aiohttp import web

from services.common.http_server import serve
from services.simulators.admission import AdmissionRefused, MutatingAdmission
from services.simulators.json_patch import json_patch
from services.simulators.kube_users import Users, review_routes

KEEP_CHANGES = 1000  # changes kept for watches to resume from
ENCODED_LINES = 256  # recent watch lines kept encoded for the next watcher
SELECTABLE = {
    "pods": ("metadata.name", "metadata.namespace", "spec.nodeName", "spec.schedulerName",
             "status.phase"),
    "nodes": ("metadata.name",),
}  # fmt: skip

Selector = list[tuple[str, bool, str]]  # (field, equal?, value)


class SelectorError(ValueError):
    pass


def parse_field_selector(text: str, resource: str) -> Selector:
    """`a=b,c!=d` as the API server reads a fieldSelector (only the fields it indexes)."""
    terms: Selector = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        if "!=" in part:
            field, value = part.split("!=", 1)
            equal = False
        elif "==" in part:
            field, value = part.split("==", 1)
            equal = True
        elif "=" in part:
            field, value = part.split("=", 1)
            equal = True
        else:
            raise SelectorError(f"invalid selector: {text!r}; can't understand {part!r}")
        field = field.strip()
        if field not in SELECTABLE[resource]:
            raise SelectorError(f'"{field}" is not a known field selector: only '
                                f'"{", ".join(SELECTABLE[resource])}"')  # fmt: skip
        terms.append((field, equal, value.strip()))
    return terms


def _field(obj: dict[str, Any], path: str) -> str:
    value: Any = obj
    for key in path.split("."):
        value = value.get(key) if isinstance(value, dict) else None
    return "" if value is None else str(value)


def selects(selector: Selector, obj: dict[str, Any] | None) -> bool:
    if obj is None:
        return False
    return all((_field(obj, field) == value) == equal for field, equal, value in selector)


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def status_error(code: int, reason: str, message: str) -> web.Response:
    body = {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": message,
        "reason": reason,
        "code": code,
    }
    return web.json_response(body, status=code)


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386 JSON merge patch."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    result = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = merge_patch(result.get(key), value)
    return result


Change = tuple[int, str, str, dict[str, Any], dict[str, Any] | None]


class FakeApiServer:
    def __init__(
        self,
        host: str = "127.0.0.1",
        keep_changes: int = KEEP_CHANGES,
        port: int = 0,
        admission: MutatingAdmission | None = None,
    ) -> None:
        self._admission = admission
        self._host = host
        self._runner: web.AppRunner | None = None
        self._port = port  # 0: any free port
        self.resource_version = 0
        self.pods: dict[tuple[str, str], dict[str, Any]] = {}
        self.nodes: dict[str, dict[str, Any]] = {}
        self.events: list[dict[str, Any]] = []
        self.bindings: list[dict[str, Any]] = []
        # (resourceVersion, resource, event type, object, the object before the change)
        self._changes: deque[Change] = deque(maxlen=keep_changes)
        self._last: dict[tuple[str, str], dict[str, Any]] = {}  # the latest copy per object
        self._encoded_lines: dict[tuple[int, str], bytes] = {}  # (version, type) -> line
        self._changed = asyncio.Condition()
        # Who is who for TokenReview and SubjectAccessReview (none by default: every token
        # is refused); tests replace or edit it.
        self.users = Users()

    @property
    def url(self) -> str:
        return f"http://{self._host}:{self._port}"

    async def start(self) -> None:
        app = web.Application()
        pods = "/api/v1/namespaces/{namespace}/pods"
        app.add_routes(
            [
                web.get("/api/v1/pods", self._list_pods),
                web.get(pods, self._list_pods),
                web.post(pods, self._create_pod),
                web.get(pods + "/{name}", self._get_pod),
                web.patch(pods + "/{name}", self._patch_pod),
                web.delete(pods + "/{name}", self._delete_pod),
                web.post(pods + "/{name}/binding", self._bind_pod),
                web.patch(pods + "/{name}/status", self._patch_pod),
                web.post("/api/v1/namespaces/{namespace}/events", self._create_event),
                web.get("/api/v1/namespaces/{namespace}/events", self._list_events),
                web.get("/api/v1/nodes", self._list_nodes),
                web.get("/api/v1/watch/nodes", self._watch_nodes),
                web.get("/api/v1/watch/pods", self._watch_pods),
                web.get("/api/v1/nodes/{name}", self._get_node),
                *review_routes(lambda: self.users),
            ]
        )
        self._runner, self._port = await serve(app, self._host, self._port)

    async def stop(self) -> None:
        runner, self._runner = self._runner, None
        if runner is not None:
            async with self._changed:
                self._changed.notify_all()
            await runner.cleanup()

    # -- state changes (also for tests driving the "cluster" directly) --------------------

    def _append(self, resource: str, kind: str, obj: dict[str, Any]) -> None:
        self.resource_version += 1
        obj["metadata"]["resourceVersion"] = str(self.resource_version)
        metadata = obj["metadata"]
        key = (resource, f"{metadata.get('namespace', '')}/{metadata['name']}")
        before = self._last.pop(key, None)
        now = copy.deepcopy(obj)
        if kind != "DELETED":
            self._last[key] = now
        self._changes.append((self.resource_version, resource, kind, now, before))

    async def _notify(self) -> None:
        async with self._changed:
            self._changed.notify_all()

    def _notify_soon(self) -> None:
        with contextlib.suppress(RuntimeError):  # no running loop: watchers poll anyway
            asyncio.get_running_loop().create_task(self._notify())

    async def _record(self, kind: str, pod: dict[str, Any]) -> None:
        self._append("pods", kind, pod)
        await self._notify()

    async def create_pod(self, pod: dict[str, Any]) -> dict[str, Any]:
        pod = copy.deepcopy(pod)
        metadata = pod.setdefault("metadata", {})
        metadata.setdefault("namespace", "default")
        metadata.setdefault("uid", str(uuid.uuid4()))
        metadata.setdefault("creationTimestamp", _now())
        pod.setdefault("spec", {}).setdefault("containers", [])
        pod.setdefault("status", {"phase": "Pending"})
        self.pods[(metadata["namespace"], metadata["name"])] = pod
        await self._record("ADDED", pod)
        return pod

    async def set_phase(self, namespace: str, name: str, phase: str) -> None:
        pod = self.pods[(namespace, name)]
        pod.setdefault("status", {})["phase"] = phase
        await self._record("MODIFIED", pod)

    async def delete_pod(self, namespace: str, name: str) -> dict[str, Any] | None:
        pod = self.pods.pop((namespace, name), None)
        if pod is not None:
            await self._record("DELETED", pod)
        return pod

    def add_node(
        self,
        name: str,
        labels: dict[str, str] | None = None,
        allocatable: dict[str, str] | None = None,
    ) -> dict[str, Any]:
        """Create or replace a Node (status.allocatable and capacity as given)."""
        kind = "MODIFIED" if name in self.nodes else "ADDED"
        node = {
            "apiVersion": "v1",
            "kind": "Node",
            "metadata": {"name": name, "labels": labels or {}, "uid": str(uuid.uuid4()),
                         "creationTimestamp": _now()},
            "status": {"allocatable": dict(allocatable or {}),
                       "capacity": dict(allocatable or {})},
        }  # fmt: skip
        if kind == "MODIFIED":
            node["metadata"]["uid"] = self.nodes[name]["metadata"]["uid"]
        self.nodes[name] = node
        self._append("nodes", kind, node)
        self._notify_soon()
        return node

    async def set_allocatable(self, name: str, allocatable: dict[str, str]) -> None:
        node = self.nodes[name]
        node["status"]["allocatable"] = dict(allocatable)
        self._append("nodes", "MODIFIED", node)
        await self._notify()

    async def delete_node(self, name: str) -> None:
        node = self.nodes.pop(name, None)
        if node is not None:
            self._append("nodes", "DELETED", node)
            await self._notify()

    # -- handlers ---------------------------------------------------------------------------

    async def _body(self, request: web.Request) -> Any:
        try:
            return json.loads(await request.read())
        except ValueError as exc:
            raise web.HTTPBadRequest(text=f"body is not JSON: {exc}") from exc

    async def _create_pod(self, request: web.Request) -> web.Response:
        pod = await self._body(request)
        namespace = request.match_info["namespace"]
        if not isinstance(pod, dict) or not isinstance(pod.get("metadata"), dict):
            return status_error(400, "BadRequest", "a pod needs metadata")
        name = pod["metadata"].get("name")
        if not name:
            return status_error(422, "Invalid", "metadata.name: Required value")
        if (namespace, name) in self.pods:
            return status_error(409, "AlreadyExists", f'pods "{name}" already exists')
        pod["metadata"]["namespace"] = namespace
        if self._admission is not None:
            try:
                pod = await self._admission.admit(pod, namespace, headers=request.headers)
            except AdmissionRefused as exc:
                return status_error(exc.code, exc.reason, exc.message)
        return web.json_response(await self.create_pod(pod), status=201)

    def _find(self, request: web.Request) -> dict[str, Any]:
        namespace, name = request.match_info["namespace"], request.match_info["name"]
        pod = self.pods.get((namespace, name))
        if pod is None:
            raise web.HTTPNotFound(
                text=json.dumps(
                    {
                        "kind": "Status",
                        "apiVersion": "v1",
                        "status": "Failure",
                        "message": f'pods "{name}" not found',
                        "reason": "NotFound",
                        "code": 404,
                    }
                ),
                content_type="application/json",
            )
        return pod

    async def _get_pod(self, request: web.Request) -> web.Response:
        return web.json_response(self._find(request))

    async def _patch_pod(self, request: web.Request) -> web.Response:
        pod = self._find(request)
        patch = await self._body(request)
        content_type = request.content_type
        try:
            if content_type == "application/json-patch+json":
                patched = json_patch(pod, patch)
            elif content_type in (
                "application/merge-patch+json",
                "application/strategic-merge-patch+json",
            ):
                wanted = (patch.get("metadata") or {}).get("resourceVersion")
                if wanted and wanted != pod["metadata"]["resourceVersion"]:
                    return status_error(
                        409, "Conflict", "the object has been modified; please apply your "
                        "changes to the latest version and try again",
                    )  # fmt: skip
                patched = merge_patch(pod, patch)
            else:
                return status_error(415, "UnsupportedMediaType", f"cannot patch {content_type}")
        except (ValueError, KeyError, IndexError, TypeError) as exc:
            return status_error(422, "Invalid", f"the patch does not apply: {exc}")
        for kept in ("name", "namespace", "uid"):
            patched["metadata"][kept] = pod["metadata"][kept]
        pod.clear()
        pod.update(patched)
        await self._record("MODIFIED", pod)
        return web.json_response(pod)

    async def _delete_pod(self, request: web.Request) -> web.Response:
        pod = self._find(request)
        await self.delete_pod(pod["metadata"]["namespace"], pod["metadata"]["name"])
        return web.json_response(pod)

    async def _bind_pod(self, request: web.Request) -> web.Response:
        pod = self._find(request)
        binding = await self._body(request)
        target = (binding.get("target") or {}) if isinstance(binding, dict) else {}
        node = target.get("name")
        if not node or target.get("kind", "Node") != "Node":
            return status_error(400, "BadRequest", "a binding needs target.kind Node and a name")
        uid = (binding.get("metadata") or {}).get("uid")
        if uid and uid != pod["metadata"]["uid"]:
            return status_error(
                409, "Conflict", f"Precondition failed: UID in precondition: {uid}, UID in "
                f"object meta: {pod['metadata']['uid']}",
            )  # fmt: skip
        bound = pod["spec"].get("nodeName")
        if bound:
            return status_error(
                409,
                "Conflict",
                f'pod {pod["metadata"]["name"]} is already assigned to node "{bound}"',
            )
        pod["spec"]["nodeName"] = node
        self.bindings.append(binding)
        await self._record("MODIFIED", pod)
        return web.json_response(
            {"kind": "Status", "apiVersion": "v1", "status": "Success", "code": 201}, status=201
        )

    def _selector(self, request: web.Request, resource: str) -> Selector:
        try:
            return parse_field_selector(request.query.get("fieldSelector", ""), resource)
        except SelectorError as exc:
            raise web.HTTPBadRequest(
                text=json.dumps({"kind": "Status", "apiVersion": "v1", "status": "Failure",
                                 "message": str(exc), "reason": "BadRequest", "code": 400}),
                content_type="application/json",
            ) from exc  # fmt: skip

    async def _list_pods(self, request: web.Request) -> web.StreamResponse:
        namespace = request.match_info.get("namespace")
        selector = self._selector(request, "pods")
        if request.query.get("watch") in ("true", "1"):
            return await self._watch(request, "pods", namespace, selector)
        items = [
            p
            for (ns, _), p in self.pods.items()
            if (namespace is None or ns == namespace) and selects(selector, p)
        ]
        return web.json_response(
            {
                "kind": "PodList",
                "apiVersion": "v1",
                "metadata": {"resourceVersion": str(self.resource_version)},
                "items": items,
            }
        )

    async def _watch_pods(self, request: web.Request) -> web.StreamResponse:
        return await self._watch(request, "pods", None, self._selector(request, "pods"))

    async def _watch_nodes(self, request: web.Request) -> web.StreamResponse:
        return await self._watch(request, "nodes", None, self._selector(request, "nodes"))

    @staticmethod
    def _event(change: Change, namespace: str | None, selector: Selector) -> dict[str, Any] | None:
        """What a watcher through `selector` sees of one change (None: nothing)."""
        version, _, kind, now, before = change
        if namespace is not None and now["metadata"].get("namespace") != namespace:
            return None
        if not selector:
            return {"type": kind, "object": now}
        was = selects(selector, before)
        if kind == "DELETED":
            return {"type": kind, "object": now} if was else None
        if selects(selector, now):
            return {"type": "MODIFIED" if was else "ADDED", "object": now}
        if not was:
            return None
        gone = copy.deepcopy(before)
        assert gone is not None
        gone["metadata"]["resourceVersion"] = str(version)
        return {"type": "DELETED", "object": gone}

    def _encoded(self, change: Change, event: dict[str, Any]) -> bytes:
        """One watch line; the same change is sent to several watchers (the allocator has
        four), so a line that carries the change's own snapshot is encoded once."""
        if event["object"] is not change[3]:
            return msgspec.json.encode(event) + b"\n"
        key = (change[0], event["type"])
        line = self._encoded_lines.get(key)
        if line is None:
            line = self._encoded_lines[key] = msgspec.json.encode(event) + b"\n"
            if len(self._encoded_lines) > ENCODED_LINES:
                del self._encoded_lines[next(iter(self._encoded_lines))]  # the oldest
        return line

    async def _watch(
        self, request: web.Request, resource: str, namespace: str | None, selector: Selector
    ) -> web.StreamResponse:
        since = int(request.query.get("resourceVersion") or self.resource_version)
        timeout = float(request.query.get("timeoutSeconds") or 1800)
        response = web.StreamResponse(headers={"Content-Type": "application/json"})
        await response.prepare(request)
        oldest = self._changes[0][0] if self._changes else self.resource_version + 1
        if self._changes and since < oldest - 1:
            gone = {
                "type": "ERROR",
                "object": {
                    "kind": "Status", "apiVersion": "v1", "status": "Failure",
                    "message": f"too old resource version: {since} ({oldest - 1})",
                    "reason": "Expired", "code": 410,
                },
            }  # fmt: skip
            await response.write(json.dumps(gone).encode() + b"\n")
            return response
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        sent = since
        try:
            while self._runner is not None:
                fresh = []  # the new ones are at the end: read back to the last one sent
                for change in reversed(self._changes):
                    if change[0] <= sent:
                        break
                    fresh.append(change)
                for change in reversed(fresh):
                    sent = change[0]
                    if change[1] != resource:
                        continue
                    event = self._event(change, namespace, selector)
                    if event is not None:
                        await response.write(self._encoded(change, event))
                left = deadline - loop.time()
                if left <= 0:
                    break
                async with self._changed:
                    with contextlib.suppress(TimeoutError):
                        async with asyncio.timeout(min(left, 1.0)):
                            await self._changed.wait()
        except (ConnectionResetError, asyncio.CancelledError):
            return response
        return response

    async def _create_event(self, request: web.Request) -> web.Response:
        event = await self._body(request)
        if not isinstance(event, dict) or not isinstance(event.get("involvedObject"), dict):
            return status_error(422, "Invalid", "involvedObject: Required value")
        metadata = event.setdefault("metadata", {})
        metadata["namespace"] = request.match_info["namespace"]
        if not metadata.get("name"):
            metadata["name"] = metadata.get("generateName", "event.") + uuid.uuid4().hex[:10]
        self.resource_version += 1
        metadata["resourceVersion"] = str(self.resource_version)
        self.events.append(event)
        return web.json_response(event, status=201)

    async def _list_events(self, request: web.Request) -> web.Response:
        namespace = request.match_info["namespace"]
        items = [e for e in self.events if e["metadata"]["namespace"] == namespace]
        return web.json_response({"kind": "EventList", "apiVersion": "v1", "items": items})

    async def _list_nodes(self, request: web.Request) -> web.StreamResponse:
        selector = self._selector(request, "nodes")
        if request.query.get("watch") in ("true", "1"):
            return await self._watch(request, "nodes", None, selector)
        return web.json_response(
            {
                "kind": "NodeList",
                "apiVersion": "v1",
                "metadata": {"resourceVersion": str(self.resource_version)},
                "items": [n for n in self.nodes.values() if selects(selector, n)],
            }
        )

    async def _get_node(self, request: web.Request) -> web.Response:
        node = self.nodes.get(request.match_info["name"])
        if node is None:
            return status_error(404, "NotFound", f'nodes "{request.match_info["name"]}" not found')
        return web.json_response(node)
