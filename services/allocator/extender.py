"""HTTP edge: the scheduler extender verbs plus health, metrics and allocations. Thin.

Each verb runs in a SERVER span ``extender <verb>`` parented on the caller's ``traceparent``
header. A malformed body is answered 400 with the field at fault; a well-formed call that
cannot be satisfied is answered 200 with ``Error`` set, as kube-scheduler expects. Never 500:
a bug is logged with its stack and answered 200 in the verb's own shape (``Error`` for filter
and bind, all-zero scores for prioritize, which kube-scheduler would ignore anyway).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec
from aiohttp import web
from opentelemetry.trace import SpanKind, Status, StatusCode
from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, Counter, Histogram, generate_latest

from services.common.http_server import bounded_app
from services.common.kube_auth import AuthError, Gate, granted, refused
from services.common.quantity import QuantityError
from services.common.rate_log import RateLimitedLog
from services.common.resources import RequestError
from services.common.tracing import context_from_headers, current_traceparent, tracer

from . import wire
from .core import FilterOutcome, pod_ref
from .engine import BindError, PlacementEngine

log = logging.getLogger("vgpu.allocator")
_bad_requests = RateLimitedLog(log, 60.0)
_tracer = tracer("vgpu.allocator")

EXTENDER_CALLS = Counter(
    "vgpu_allocator_extender_requests_total",
    "Scheduler extender calls by verb and outcome",
    ["verb", "outcome"],
)
# Calls refused before any verb ran: TLS handshakes without a valid client certificate
# (no_client_cert, unknown_ca, expired, not_tls, ...) and verified clients not allowed.
EXTENDER_REFUSED = Counter(
    "vgpu_allocator_extender_refused_total",
    "Scheduler extender connections or calls refused for want of a valid client certificate",
    ["reason"],
)
# Binds refused, by reason: not_filtered, filter_expired, unknown_pod, uid_mismatch,
# other_scheduler, not_pending, already_bound, placement (no room), ...
BIND_REFUSED = Counter(
    "vgpu_allocator_bind_refused_total", "Scheduler extender binds refused by reason", ["reason"]
)
EXTENDER_LATENCY = Histogram(
    "vgpu_allocator_extender_request_seconds",
    "Time to answer a scheduler extender call",
    ["verb"],
    buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5),
)

# Each verb's answer says how long the allocator took in a Server-Timing header, so a caller
# (bench/allocator_extender.py) can tell the allocator's time from HTTP's and its own.
SERVER_TIMING_METRIC = "allocator"

# kube-scheduler sends whole v1.Node objects when nodeCacheCapable is false: allow big bodies
# (the setting max_body_bytes; 413 past it).
MAX_BODY_BYTES = 64 * 1024 * 1024
# Bodies larger than this are decoded in a worker thread (decoding only reads the bytes), and
# filters over more nodes than FILTER_SLICE are judged a slice at a time, giving the event
# loop back in between: the lease keeps renewing and /healthz keeps answering while a
# 100,000-node request is served (docs/operations.md, "A huge extender request").
THREAD_DECODE_BYTES = 256 * 1024
FILTER_SLICE = 2048

VerbResult = tuple[Any, str]  # (JSON-able answer, outcome label)
Verb = Callable[[bytes], Awaitable[VerbResult]]
HealthCheck = Callable[[], tuple[bool, dict[str, Any]]]
Filtered = Callable[[dict[str, Any], FilterOutcome], Awaitable[None]]
Fallback = Callable[[bytes, str], Any]  # (body, error) -> the verb's answer after a bug


def _json(payload: Any, status: int = 200) -> web.Response:
    return web.Response(
        body=msgspec.json.encode(payload), status=status, content_type="application/json"
    )


def _filter_fallback(body: bytes, error: str) -> Any:
    return {
        "Nodes": None,
        "NodeNames": None,
        "FailedNodes": {},
        "FailedAndUnresolvableNodes": {},
        "Error": error,
    }


def _prioritize_fallback(body: bytes, error: str) -> Any:
    try:
        names = wire.parse_extender_args(body).node_names
    except Exception:
        names = []
    return wire.host_priority_list(dict.fromkeys(names, 0))


def _bind_fallback(body: bytes, error: str) -> Any:
    return wire.binding_result(error)


def server_timing(seconds: float) -> str:
    """The Server-Timing header value (W3C; milliseconds) of a call that took `seconds`."""
    return f"{SERVER_TIMING_METRIC};dur={seconds * 1000:.3f}"


def _serve_verb(
    name: str, verb: Verb, fallback: Fallback
) -> Callable[[web.Request], Awaitable[web.Response]]:
    latency = EXTENDER_LATENCY.labels(verb=name)

    async def handle(request: web.Request) -> web.Response:
        """The verb's answer, with the time it took here in a Server-Timing header (what a
        client can set beside its own round trip: the rest is HTTP and the network)."""
        started = time.perf_counter()
        try:
            response = await answer(request)
        finally:
            elapsed = time.perf_counter() - started
            latency.observe(elapsed)
        response.headers["Server-Timing"] = server_timing(elapsed)
        return response

    async def answer(request: web.Request) -> web.Response:
        headers = {key.lower(): value for key, value in request.headers.items()}
        with _tracer.start_as_current_span(
            f"extender {name}", context=context_from_headers(headers), kind=SpanKind.SERVER
        ) as span:
            body = b""
            try:
                body = await request.read()
                answer, outcome = await verb(body)
            except (wire.BadRequest, QuantityError) as exc:
                # A quantity that is not one: the API server never stores such a pod, so the
                # body is not a v1.Pod it sent (kube-scheduler retries the pod later).
                where = "Pod " if isinstance(exc, QuantityError) else ""
                EXTENDER_CALLS.labels(verb=name, outcome="bad_request").inc()
                span.set_status(Status(StatusCode.ERROR, str(exc)))
                # Counted every time; logged once a minute per verb (a flood of bad bodies
                # must not become a flood of log lines).
                _bad_requests.warning(
                    name, "bad extender request", {"verb": name, "error": str(exc)[:500]}
                )
                return _json({"Error": f"bad {name} request: {where}{exc}"}, status=400)
            except web.HTTPException as exc:  # e.g. 413 for a body over MAX_BODY_BYTES
                EXTENDER_CALLS.labels(verb=name, outcome="bad_request").inc()
                span.set_status(Status(StatusCode.ERROR, exc.reason))
                raise
            except Exception:
                EXTENDER_CALLS.labels(verb=name, outcome="error").inc()
                log.exception("extender verb failed", extra={"verb": name})
                span.set_status(Status(StatusCode.ERROR, "internal error"))
                return _json(fallback(body, f"internal error in {name}; see allocator logs"))
            EXTENDER_CALLS.labels(verb=name, outcome=outcome).inc()
            span.set_attribute("vgpu.outcome", outcome)
            return await _answer(answer, len(body))

    return handle


async def _parse_args(body: bytes) -> wire.ExtenderArgs:
    if len(body) > THREAD_DECODE_BYTES:
        return await asyncio.to_thread(wire.parse_extender_args, body)
    return wire.parse_extender_args(body)


async def filter_in_slices(
    engine: PlacementEngine, pod: dict[str, Any], node_names: list[str]
) -> FilterOutcome:
    """engine.filter over every node, FILTER_SLICE nodes at a time, yielding in between.
    Each node is judged on its own, so the slices' outcomes together are the whole one."""
    if len(node_names) <= FILTER_SLICE:
        return engine.filter(pod, node_names)  # which drops repeated names itself
    names = list(dict.fromkeys(node_names))
    outcome = FilterOutcome()
    for start in range(0, len(names), FILTER_SLICE):
        part = engine.filter(pod, names[start : start + FILTER_SLICE], record=False)
        outcome.passed.extend(part.passed)
        outcome.failed.update(part.failed)
        outcome.unresolvable.update(part.unresolvable)
        await asyncio.sleep(0)  # let the lease, /healthz and other requests run
    # A bind may ask for any node the whole filter passed, not only the last slice's.
    engine.record_filtered(pod, outcome.passed)
    return outcome


async def prioritize_in_slices(
    engine: PlacementEngine, pod: dict[str, Any], node_names: list[str]
) -> dict[str, int]:
    """engine.prioritize, its work bounded by the cluster rather than by the request: for a
    pod asking for GPUs, a node the allocator has no inventory of scores 0 without being
    looked at (it cannot take the pod), so only known nodes are scored, found a slice at a
    time. A pod without GPUs gets host scores relative across every node given, unknown
    ones included: scored in one piece, as before."""
    if len(node_names) <= FILTER_SLICE:
        return engine.prioritize(pod, node_names)  # which drops repeated names itself
    names = list(dict.fromkeys(node_names))
    try:
        asks_gpus = bool(engine.parse(pod).containers)
    except RequestError:
        return dict.fromkeys(names, 0)
    if not asks_gpus:
        return engine.prioritize(pod, names)
    known_node = engine.cluster.lookup()
    known: list[str] = []
    for start in range(0, len(names), FILTER_SLICE):
        known.extend(n for n in names[start : start + FILTER_SLICE] if known_node(n) is not None)
        await asyncio.sleep(0)
    placed = engine.ledger.get(pod_ref(pod).uid)
    if placed is not None and placed.node not in known and placed.node in names:
        known.append(placed.node)
    scores = dict.fromkeys(names, 0)
    scores.update(engine.prioritize(pod, known))
    return scores


async def _answer(answer: Any, request_bytes: int) -> web.Response:
    """The answer grows with the request: a big one is encoded in a worker thread (the
    answer is this request's alone, so nothing else touches it meanwhile)."""
    if request_bytes > THREAD_DECODE_BYTES:
        body = await asyncio.to_thread(msgspec.json.encode, answer)
    else:
        body = msgspec.json.encode(answer)
    return web.Response(body=body, content_type="application/json")


def build_app(
    engine: PlacementEngine,
    health: HealthCheck,
    ready: HealthCheck | None = None,
    on_filtered: Filtered | None = None,
    *,
    verbs: bool = True,
    endpoints: bool = True,
    middlewares: tuple[Any, ...] = (),
    max_body_bytes: int = MAX_BODY_BYTES,
    gate: Gate | None = None,
) -> web.Application:
    """The scheduler verbs (``verbs``) and health, metrics and allocations (``endpoints``):
    one application, or two when the verbs are served apart over mutual TLS. /healthz,
    /readyz and /livez are open; with a `gate`, /metrics and /allocations need a bearer
    token and a SubjectAccessReview (services/common/kube_auth.py)."""

    async def filter_verb(body: bytes) -> VerbResult:
        args = await _parse_args(body)
        outcome = await filter_in_slices(engine, args.pod, args.node_names)
        if on_filtered is not None and not outcome.passed:
            await on_filtered(args.pod, outcome)
        log.debug(
            "filter",
            extra={
                "pod": _pod_name(args.pod),
                "passed": outcome.passed,
                "failed": outcome.failed,
                "unresolvable": outcome.unresolvable,
            },
        )
        return wire.filter_result(args, outcome), "fit" if outcome.passed else "no_fit"

    async def prioritize_verb(body: bytes) -> VerbResult:
        args = await _parse_args(body)
        scores = await prioritize_in_slices(engine, args.pod, args.node_names)
        return wire.host_priority_list(scores), "ok"

    async def bind_verb(body: bytes) -> VerbResult:
        args = wire.parse_binding_args(body)
        try:
            await engine.bind(
                args.pod_namespace,
                args.pod_name,
                args.pod_uid,
                args.node,
                traceparent=current_traceparent(),
            )
        except BindError as exc:
            BIND_REFUSED.labels(reason=exc.reason).inc()
            log.info(
                "bind refused",
                extra={
                    "pod": f"{args.pod_namespace}/{args.pod_name}",
                    "uid": args.pod_uid,
                    "node": args.node,
                    "reason": exc.reason,
                    "error": str(exc),
                },
            )
            return wire.binding_result(str(exc)), "refused"
        return wire.binding_result(), "bound"

    async def healthz(_: web.Request) -> web.Response:
        ok, details = health()
        return _json({"status": "ok" if ok else "degraded", **details}, 200 if ok else 503)

    async def readyz(_: web.Request) -> web.Response:
        ok, details = (ready or health)()
        return _json({"status": "ok" if ok else "not ready", **details}, 200 if ok else 503)

    async def livez(_: web.Request) -> web.Response:
        return _json({"status": "ok"})  # the event loop answers: what liveness asks

    async def metrics(request: web.Request) -> web.Response:
        if gate is not None:
            try:
                await gate.require_path(request)
            except AuthError as exc:
                return refused(gate, request, exc)
            granted(gate)
        return web.Response(
            body=generate_latest(REGISTRY), headers={"Content-Type": CONTENT_TYPE_LATEST}
        )

    async def allocations(request: web.Request) -> web.Response:
        """Every decision, or (with a gate) those of the namespaces the caller may list;
        ``?namespace=X`` narrows to one namespace (403 if the caller may not list it)."""
        everything = engine.allocations()
        wanted = request.query.get("namespace", "")
        if wanted:
            everything = [a for a in everything if a.namespace == wanted]
        if gate is None:
            return _json(everything)
        try:
            scope = await gate.read_scope(request)
            if wanted:
                await scope.require_namespace(wanted)
                visible = {wanted}
            else:
                visible = await scope.namespaces({a.namespace for a in everything})
                if not visible and not scope.cluster_wide:
                    raise AuthError(403, f'user "{scope.caller.username}" may list pods '
                                         "neither cluster-wide nor in any namespace that "
                                         "holds GPU pods")  # fmt: skip
        except AuthError as exc:
            return refused(gate, request, exc)
        granted(gate)
        return _json([a for a in everything if a.namespace in visible])

    app = bounded_app("extender", max_body_bytes, error_key="Error", middlewares=middlewares)
    if verbs:
        post = app.router.add_post
        post("/scheduler/filter", _serve_verb("filter", filter_verb, _filter_fallback))
        post(
            "/scheduler/prioritize",
            _serve_verb("prioritize", prioritize_verb, _prioritize_fallback),
        )
        post("/scheduler/bind", _serve_verb("bind", bind_verb, _bind_fallback))
    if endpoints:
        app.router.add_get("/healthz", healthz)
        app.router.add_get("/readyz", readyz)
        app.router.add_get("/livez", livez)
        app.router.add_get("/metrics", metrics)
        app.router.add_get("/allocations", allocations)
    return app


def _pod_name(pod: dict[str, Any]) -> str:
    metadata = pod.get("metadata") or {}
    return f"{metadata.get('namespace') or 'default'}/{metadata.get('name')}"
