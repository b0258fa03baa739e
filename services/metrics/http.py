"""The metrics service's HTTP edge: Prometheus, the JSON API, the live stream and the page.

Thin on purpose: every answer is a view from `views.py` encoded as JSON.

    GET /metrics                        Prometheus exposition
    GET /healthz                        {"ok", "nats_connected", "nodes", "pods"}
    GET /livez                          200 while the event loop answers (liveness probes)
    GET /api/v1/picture                 ClusterView (at most pending_shown pending pods;
                                        totals.pending_pods counts all)
    GET /api/v1/pods/{namespace}/{name} PodView (404 naming the pod if unknown)
    GET /api/v1/pending[?limit=N]       [PendingView], longest waiting first: `limit` of
                                        them (default the setting pending_shown), the
                                        count of all in the X-Total-Count header
    GET /api/v1/events                  text/event-stream: `snapshot`, `bus`, then `change`
                                        batches and a `bus` frame whenever NATS goes or
                                        comes back ({"connected", "nats_down_since", ...})
    GET /                               the dashboard (static files under /static/)
    POST /login, /logout                the dashboard's token cookie (with a gate only)

With a `Gate` (setting ``read_auth: kubernetes``) every route but the health ones, the login
and the static files asks for a bearer token (header, or the dashboard's cookie): ``/metrics``
needs ``get`` on the path ``/metrics``; the rest show only the namespaces whose pods the
caller may list (services/common/kube_auth.py, docs/security.md).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from importlib import resources
from pathlib import Path
from typing import Any

import msgspec
from aiohttp import web
from opentelemetry.trace import SpanKind
from prometheus_client import REGISTRY, CollectorRegistry, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from services.common.http_server import bounded_app
from services.common.kube_auth import AuthError, Gate, Scope, granted, refused
from services.common.tracing import context_from_headers, tracer
from services.metrics.login import login_routes
from services.metrics.stream import ChangeStream, frame
from services.metrics.views import (
    ClusterView,
    bounded,
    find_pod,
    namespaces_in,
    visible_view,
)

STATIC = Path(str(resources.files("services.metrics") / "static"))
KEEPALIVE_S = 15.0
MAX_PENDING_LIMIT = 100_000  # /api/v1/pending?limit=: whole lists for tools, still bounded
_tracer = tracer("vgpu.metrics")
_encoder = msgspec.json.Encoder()

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def _json(value: object, status: int = 200) -> web.Response:
    return web.Response(body=_encoder.encode(value), status=status,
                        content_type="application/json")  # fmt: skip


@web.middleware
async def _traced(request: web.Request, handler: Handler) -> web.StreamResponse:
    if not request.path.startswith("/api/"):
        return await handler(request)
    parent = context_from_headers(request.headers)
    resource = request.match_info.route.resource
    route = resource.canonical if resource is not None else request.path
    with _tracer.start_as_current_span(f"metrics {request.method} {route}", context=parent,
                                       kind=SpanKind.SERVER):  # fmt: skip
        return await handler(request)


class MetricsHttp:
    def __init__(
        self,
        view: Callable[[], ClusterView],
        stream: ChangeStream,
        registry: CollectorRegistry,
        nats_connected: Callable[[], bool],
        bus_details: Callable[[], dict[str, Any]] = dict,
        max_body_bytes: int = 64 * 1024,
        gate: Gate | None = None,
        pending_shown: int = 50,
    ) -> None:
        self._gate = gate
        self._pending_shown = pending_shown
        self._view = view
        self._stream = stream
        self._registry = registry
        self._nats_connected = nats_connected
        self._bus_details = bus_details  # where the bus is and since when it is down
        self._max_body_bytes = max_body_bytes

    def app(self) -> web.Application:
        app = bounded_app("metrics", self._max_body_bytes, middlewares=(_traced,))
        app.add_routes(
            [
                web.get("/metrics", self._metrics),
                web.get("/healthz", self._healthz),
                web.get("/livez", self._livez),
                web.get("/api/v1/picture", self._picture),
                web.get("/api/v1/pods/{namespace}/{name}", self._pod),
                web.get("/api/v1/pending", self._pending),
                web.get("/api/v1/events", self._events),
                web.get("/", self._index),
                web.static("/static", STATIC, append_version=False),
            ]
        )
        if self._gate is not None:
            app.add_routes(login_routes(self._gate))
        return app

    def bus_status(self) -> dict[str, Any]:
        """What the dashboard's badge shows: connected, or down since when (Unix time)."""
        return {"connected": self._nats_connected(), **self._bus_details()}

    async def _scope(self, request: web.Request) -> Scope | None:
        """The caller's scope (None: no gate, everything is shown); raises AuthError."""
        if self._gate is None:
            return None
        return await self._gate.read_scope(request, cookie=True)

    async def _visible(self, request: web.Request, pending_shown: int | None = None) -> ClusterView:
        """The picture as the caller may see it, with at most `pending_shown` pending pods
        (default: the setting); raises AuthError (403 if it sees nothing)."""
        view = self._view()
        scope = await self._scope(request)
        if scope is not None and not scope.cluster_wide:
            namespaces = await scope.namespaces(namespaces_in(view))
            if not namespaces:
                user = scope.caller.username
                raise AuthError(403, f'user "{user}" may list pods neither cluster-wide nor in '
                                     "any namespace that holds GPU pods")  # fmt: skip
            view = visible_view(view, namespaces)
        return bounded(view, pending_shown or self._pending_shown)

    def _refused(self, request: web.Request, error: AuthError) -> web.Response:
        return refused(self._gate, request, error)

    def _granted(self) -> None:
        if self._gate is not None:
            granted(self._gate)

    async def _livez(self, request: web.Request) -> web.Response:
        return _json({"ok": True})

    async def _metrics(self, request: web.Request) -> web.Response:
        if self._gate is not None:
            try:
                await self._gate.require_path(request)
            except AuthError as exc:
                return self._refused(request, exc)
            self._granted()
        # Our picture plus the process-wide counters (bus errors, rejected events).
        body = generate_latest(self._registry) + generate_latest(REGISTRY)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def _healthz(self, request: web.Request) -> web.Response:
        view = self._view()
        connected = self._nats_connected()
        return _json({"ok": connected, "nats_connected": connected, **self._bus_details(),
                      "nodes": view.totals.nodes, "pods": view.totals.pods},
                     status=200 if connected else 503)  # fmt: skip

    async def _picture(self, request: web.Request) -> web.Response:
        try:
            view = await self._visible(request)
        except AuthError as exc:
            return self._refused(request, exc)
        self._granted()
        return _json(view)

    async def _pod(self, request: web.Request) -> web.Response:
        namespace, name = request.match_info["namespace"], request.match_info["name"]
        try:
            scope = await self._scope(request)
            if scope is not None:
                await scope.require_namespace(namespace)
        except AuthError as exc:
            return self._refused(request, exc)
        self._granted()
        pod = find_pod(self._view(), namespace, name)
        if pod is None:
            return _json({"error": f"no GPU pod {namespace}/{name} is known"}, status=404)
        return _json(pod)

    async def _pending(self, request: web.Request) -> web.Response:
        text = request.query.get("limit", "")
        limit = int(text) if text.isascii() and text.isdigit() else 0
        if text and not 1 <= limit <= MAX_PENDING_LIMIT:
            return _json({"error": f"limit must be a whole number from 1 to "
                                   f"{MAX_PENDING_LIMIT}, got {text[:32]!r}"},
                         status=400)  # fmt: skip
        try:
            view = await self._visible(request, limit or None)
        except AuthError as exc:
            return self._refused(request, exc)
        self._granted()
        response = _json(view.pending)
        response.headers["X-Total-Count"] = str(view.totals.pending_pods)
        return response

    async def _index(self, request: web.Request) -> web.StreamResponse:
        if self._gate is not None:
            try:
                await self._gate.caller_of(request, cookie=True)
            except AuthError as exc:
                if exc.status != 401:
                    return self._refused(request, exc)
                raise web.HTTPSeeOther("/login") from exc
        return web.FileResponse(STATIC / "index.html",
                                headers={"Cache-Control": "no-cache"})  # fmt: skip

    async def _events(self, request: web.Request) -> web.StreamResponse:
        try:
            first = await self._visible(request)
        except AuthError as exc:
            return self._refused(request, exc)
        self._granted()
        response = web.StreamResponse(headers={
            "Content-Type": "text/event-stream", "Cache-Control": "no-cache",
            "X-Accel-Buffering": "no",
        })  # fmt: skip
        await response.prepare(request)
        # Subscribe before the snapshot: a change in between arrives twice, never not at all.
        client = self._stream.subscribe()
        try:
            await response.write(b"retry: 2000\n\n")
            await response.write(frame("snapshot", _encoder.encode(first)))
            await response.write(frame("bus", _encoder.encode(self.bus_status())))
            while True:
                try:
                    async with asyncio.timeout(KEEPALIVE_S):
                        item = await client.queue.get()
                except TimeoutError:
                    await response.write(b": keepalive\n\n")
                    continue
                if item is None:
                    break
                await response.write(await self._for_caller(request, item))
        except AuthError as exc:  # the token or the rights went away while it watched
            with contextlib.suppress(ConnectionError):
                await response.write(frame("denied", _encoder.encode({"error": exc.reason})))
            self._refused(request, exc)
        except (ConnectionResetError, ConnectionError):
            pass  # the browser went away
        finally:
            self._stream.unsubscribe(client)
        with contextlib.suppress(ConnectionError):
            await response.write_eof()
        return response

    async def _for_caller(self, request: web.Request, item: bytes) -> bytes:
        """A change batch as this client may see it. The token and rights are checked again
        on every batch (cached): a revoked token ends the stream within the cache's TTL.
        A namespaced caller gets a fresh filtered snapshot instead of the shared batch."""
        scope = await self._scope(request)
        if scope is None or scope.cluster_wide or not item.startswith(b"event: change"):
            return item  # the bus badge names no pod
        return frame("snapshot", _encoder.encode(await self._visible(request)))
