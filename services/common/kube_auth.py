"""Who may read what: bearer tokens checked with the Kubernetes API server.

The read APIs of vgpu (the allocator's ``/allocations``, the metrics service's ``/api/v1/*``,
its dashboard and both ``/metrics``) do what kube-rbac-proxy does in front of a service:

1. the caller's bearer token goes to the API server as a TokenReview
   (authentication.k8s.io/v1): who is this?
2. the user it names goes back as a SubjectAccessReview (authorization.k8s.io/v1): may this
   user ``list pods`` cluster-wide, or in namespace X? For ``/metrics`` the question is
   ``get`` on the non-resource path ``/metrics`` (a ClusterRole with ``nonResourceURLs``).

Answers are cached for a short, bounded time (and a bounded number of entries), so a
dashboard or a scrape costs the API server one review per TTL, not one per request. Errors
are never cached. An API server that cannot be asked means 503 with the reason: never open.

The services turn `AuthError` into HTTP answers (401 no or bad token, 403 no rights, 503 the
API server cannot answer). Nothing here imports a service.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Hashable, Iterable
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from aiohttp import web
from prometheus_client import Counter

from services.common.tracing import tracer

log = logging.getLogger("vgpu.auth")
_tracer = tracer("vgpu.auth")

AuthMode = Literal["none", "kubernetes"]
COOKIE = "vgpu_token"  # the dashboard's login cookie (a browser's EventSource sends no header)
MAX_TOKEN_BYTES = 16 * 1024  # a service-account JWT is ~1 KiB; refuse absurd headers early

DECISIONS = Counter(
    "vgpu_auth_requests_total",
    "Requests to authenticated endpoints by service and outcome "
    "(allowed, unauthenticated, forbidden, unavailable)",
    ["service", "outcome"],
)
REVIEWS = Counter(
    "vgpu_auth_reviews_total",
    "TokenReviews and SubjectAccessReviews by kind and source (api or cache)",
    ["kind", "source"],
)


class AuthError(Exception):
    """A refused request: `status` is the HTTP answer (401, 403 or 503), `reason` says why."""

    def __init__(self, status: int, reason: str) -> None:
        super().__init__(reason)
        self.status = status
        self.reason = reason

    def response(self) -> web.Response:
        headers = {"WWW-Authenticate": 'Bearer realm="vgpu"'} if self.status == 401 else {}
        body = json.dumps({"error": self.reason, "code": self.status})
        return web.Response(text=body, status=self.status, headers=headers,
                            content_type="application/json")  # fmt: skip


class ReviewUnavailable(Exception):
    """The API server could not answer a review (unreachable, timed out, refused us)."""


@dataclass(frozen=True)
class Caller:
    username: str
    uid: str = ""
    groups: tuple[str, ...] = ()
    extra: tuple[tuple[str, tuple[str, ...]], ...] = ()


@dataclass(frozen=True)
class ResourceCheck:
    """May the caller `verb` `resource` in `namespace` ("" = cluster-wide)?"""

    verb: str
    resource: str
    namespace: str = ""
    group: str = ""


@dataclass(frozen=True)
class PathCheck:
    """May the caller `verb` the non-resource URL `path` (e.g. get /metrics)?"""

    verb: str
    path: str


Check = ResourceCheck | PathCheck


class Reviews(Protocol):
    """The two questions asked of the API server."""

    async def token_review(self, token: str) -> Caller | None: ...  # None: not authenticated
    async def access_review(self, caller: Caller, check: Check) -> tuple[bool, str]: ...


def token_review_body(token: str, audiences: tuple[str, ...] = ()) -> dict[str, Any]:
    spec: dict[str, Any] = {"token": token}
    if audiences:
        spec["audiences"] = list(audiences)
    return {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenReview", "spec": spec}


def access_review_body(caller: Caller, check: Check) -> dict[str, Any]:
    spec: dict[str, Any] = {"user": caller.username, "groups": list(caller.groups)}
    if caller.uid:
        spec["uid"] = caller.uid
    if caller.extra:
        spec["extra"] = {key: list(values) for key, values in caller.extra}
    if isinstance(check, PathCheck):
        spec["nonResourceAttributes"] = {"path": check.path, "verb": check.verb}
    else:
        attributes = {"verb": check.verb, "group": check.group, "resource": check.resource}
        if check.namespace:
            attributes["namespace"] = check.namespace
        spec["resourceAttributes"] = attributes
    return {"apiVersion": "authorization.k8s.io/v1", "kind": "SubjectAccessReview", "spec": spec}


def caller_from_review(answer: dict[str, Any]) -> Caller | None:
    status = answer.get("status") or {}
    if not status.get("authenticated"):
        return None
    user = status.get("user") or {}
    extra = user.get("extra") or {}
    return Caller(
        username=str(user.get("username") or ""),
        uid=str(user.get("uid") or ""),
        groups=tuple(str(g) for g in user.get("groups") or ()),
        extra=tuple(sorted((str(k), tuple(str(v) for v in vs)) for k, vs in extra.items())),
    )


def decision_from_review(answer: dict[str, Any]) -> tuple[bool, str]:
    status = answer.get("status") or {}
    allowed = bool(status.get("allowed")) and not status.get("denied")
    return allowed, str(status.get("reason") or status.get("evaluationError") or "")


class KubeReviews:
    """Reviews through the official ``kubernetes`` client (sync, so in a worker thread)."""

    def __init__(self, api_client: Any, timeout_s: float = 5.0) -> None:
        from kubernetes import client as k8s

        self._api_client = api_client
        self._authn = k8s.AuthenticationV1Api(api_client)
        self._authz = k8s.AuthorizationV1Api(api_client)
        self._timeout_s = timeout_s
        self.where = str(api_client.configuration.host)

    @classmethod
    def connect(
        cls, api_url: str = "", kubeconfig: str = "", timeout_s: float = 5.0
    ) -> KubeReviews:
        """`api_url` (tests, `vgpu up`), else `kubeconfig`, else the in-cluster account."""
        from kubernetes import client as k8s
        from kubernetes import config as k8s_config

        configuration = k8s.Configuration()
        if api_url:
            configuration.host = api_url
        elif kubeconfig:
            k8s_config.load_kube_config(config_file=kubeconfig,
                                        client_configuration=configuration)  # fmt: skip
        else:
            k8s_config.load_incluster_config(client_configuration=configuration)
        configuration.retries = 1  # an unreachable API server is reported, not retried long
        return cls(k8s.ApiClient(configuration), timeout_s)

    async def close(self) -> None:
        await asyncio.to_thread(self._api_client.close)

    async def _create(self, create: Callable[..., Any], body: dict[str, Any]) -> dict[str, Any]:
        from kubernetes.client.rest import ApiException

        try:
            response = await asyncio.to_thread(
                create, body, _preload_content=False, _request_timeout=self._timeout_s
            )
            return dict(json.loads(response.data))
        except ApiException as exc:
            raise ReviewUnavailable(
                f"the API server at {self.where} refused the {body['kind']} ({exc.status} "
                f"{exc.reason}): does this service's account have system:auth-delegator?"
            ) from exc
        except Exception as exc:  # urllib3 connection errors, timeouts, bad JSON
            raise ReviewUnavailable(
                f"cannot ask the API server at {self.where} ({body['kind']}): {exc}"
            ) from exc

    async def token_review(self, token: str) -> Caller | None:
        return caller_from_review(
            await self._create(self._authn.create_token_review, token_review_body(token))
        )

    async def access_review(self, caller: Caller, check: Check) -> tuple[bool, str]:
        body = access_review_body(caller, check)
        return decision_from_review(
            await self._create(self._authz.create_subject_access_review, body)
        )


class TtlCache:
    """At most `size` entries, each kept `ttl_s` seconds; the oldest go first when full."""

    def __init__(self, ttl_s: float, size: int, clock: Callable[[], float]) -> None:
        self._ttl_s = ttl_s
        self._size = max(1, size)
        self._clock = clock
        self._entries: OrderedDict[Hashable, tuple[float, Any]] = OrderedDict()

    def get(self, key: Hashable) -> tuple[bool, Any]:
        entry = self._entries.get(key)
        if entry is None:
            return False, None
        if entry[0] <= self._clock():
            del self._entries[key]
            return False, None
        return True, entry[1]

    def put(self, key: Hashable, value: Any) -> None:
        self._entries[key] = (self._clock() + self._ttl_s, value)
        self._entries.move_to_end(key)
        while len(self._entries) > self._size:
            self._entries.popitem(last=False)

    def __len__(self) -> int:
        return len(self._entries)


class Scope:
    """What one authenticated caller may read: everything, or some namespaces."""

    def __init__(self, gate: Gate, caller: Caller, cluster_wide: bool) -> None:
        self._gate = gate
        self.caller = caller
        self.cluster_wide = cluster_wide

    async def namespaces(self, present: Iterable[str]) -> set[str]:
        """Of the namespaces `present` in an answer, those whose pods the caller may list."""
        wanted = set(present)
        if self.cluster_wide:
            return wanted
        checks = [ResourceCheck("list", "pods", namespace) for namespace in sorted(wanted)]
        allowed = await asyncio.gather(*(self._gate.allowed(self.caller, c) for c in checks))
        return {c.namespace for c, ok in zip(checks, allowed, strict=True) if ok}

    async def require_namespace(self, namespace: str) -> None:
        if not self.cluster_wide and not await self._gate.allowed(
            self.caller, ResourceCheck("list", "pods", namespace)
        ):
            raise AuthError(403, f'user "{self.caller.username}" may not list pods in '
                                 f'namespace "{namespace}"')  # fmt: skip


class Gate:
    """Bearer token -> caller -> decisions, each through a bounded TTL cache.

    The same token asked many times at once costs one review: callers wait on the first.
    """

    def __init__(self, reviews: Reviews, service: str, ttl_s: float = 10.0,
                 cache_size: int = 4096,
                 clock: Callable[[], float] = time.monotonic) -> None:  # fmt: skip
        self.reviews = reviews
        self.service = service
        self._callers = TtlCache(ttl_s, cache_size, clock)
        self._decisions = TtlCache(ttl_s, cache_size, clock)
        self._inflight: dict[Hashable, asyncio.Future[Any]] = {}

    async def _cached(self, cache: TtlCache, kind: str, key: Hashable,
                      ask: Callable[[], Awaitable[Any]]) -> Any:  # fmt: skip
        hit, value = cache.get(key)
        if hit:
            REVIEWS.labels(kind=kind, source="cache").inc()
            return value
        waiting = self._inflight.get(key)
        if waiting is not None:
            return await asyncio.shield(waiting)
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._inflight[key] = future
        try:
            with _tracer.start_as_current_span(f"auth {kind}"):
                value = await ask()
            REVIEWS.labels(kind=kind, source="api").inc()
            cache.put(key, value)
            future.set_result(value)
            return value
        except asyncio.CancelledError:
            future.cancel()
            raise
        except BaseException as exc:
            future.set_exception(exc)
            future.exception()  # retrieved: no "never retrieved" warning when none waits
            raise
        finally:
            self._inflight.pop(key, None)

    async def authenticate(self, token: str) -> Caller:
        key = ("token", hashlib.sha256(token.encode()).hexdigest())  # never keep the token
        try:
            caller = await self._cached(self._callers, "token_review", key,
                                        lambda: self.reviews.token_review(token))  # fmt: skip
        except ReviewUnavailable as exc:
            raise AuthError(503, f"cannot check the token: {exc}") from exc
        if caller is None:
            raise AuthError(401, "the bearer token is not valid (TokenReview refused it)")
        return caller  # type: ignore[no-any-return]

    async def allowed(self, caller: Caller, check: Check) -> bool:
        key = ("access", caller, check)
        try:
            ok, _ = await self._cached(
                self._decisions, "subject_access_review", key,
                lambda: self.reviews.access_review(caller, check),
            )  # fmt: skip
        except ReviewUnavailable as exc:
            raise AuthError(503, f"cannot check permissions: {exc}") from exc
        return bool(ok)

    async def caller_of(self, request: web.Request, cookie: bool = False) -> Caller:
        return await self.authenticate(bearer_token(request, cookie))

    async def read_scope(self, request: web.Request, cookie: bool = False) -> Scope:
        """The caller's view of pods: cluster-wide if it may list pods everywhere, else the
        namespaces it may list (each checked when an answer needs it)."""
        caller = await self.caller_of(request, cookie)
        cluster_wide = await self.allowed(caller, ResourceCheck("list", "pods"))
        return Scope(self, caller, cluster_wide)

    async def require_path(self, request: web.Request, verb: str = "get") -> Caller:
        """A non-resource URL (``/metrics``): allowed or 403."""
        caller = await self.caller_of(request)
        if not await self.allowed(caller, PathCheck(verb, request.path)):
            raise AuthError(403, f'user "{caller.username}" may not {verb} {request.path}')
        return caller


def bearer_token(request: web.Request, cookie: bool = False) -> str:
    """The request's bearer token (the Authorization header; the login cookie if allowed)."""
    header = request.headers.get("Authorization", "")
    token = ""
    if header:
        scheme, _, value = header.partition(" ")
        if scheme.lower() != "bearer" or not value.strip():
            raise AuthError(401, "the Authorization header must be 'Bearer <token>'")
        token = value.strip()
    elif cookie:
        token = request.cookies.get(COOKIE, "")
    if not token:
        raise AuthError(401, "a bearer token is required (Authorization: Bearer <token>)")
    if len(token) > MAX_TOKEN_BYTES:
        raise AuthError(401, f"the bearer token is longer than {MAX_TOKEN_BYTES} bytes")
    return token


def refused(gate: Gate | None, request: web.Request, error: AuthError) -> web.Response:
    """Count and log a refusal (never the token), and answer it."""
    outcome = {401: "unauthenticated", 403: "forbidden"}.get(error.status, "unavailable")
    service = gate.service if gate is not None else "unknown"
    DECISIONS.labels(service=service, outcome=outcome).inc()
    level = logging.ERROR if error.status == 503 else logging.WARNING
    log.log(level, "request refused", extra={"service": service, "path": request.path,
            "status": error.status, "reason": error.reason,
            "remote": request.remote})  # fmt: skip
    return error.response()


def granted(gate: Gate) -> None:
    DECISIONS.labels(service=gate.service, outcome="allowed").inc()


def gate_from(mode: AuthMode, service: str, *, api_url: str = "", kubeconfig: str = "",
              ttl_s: float = 10.0, cache_size: int = 4096) -> Gate | None:  # fmt: skip
    """The gate a service's settings ask for (None: ``read_auth: none``, no checks)."""
    if mode == "none":
        return None
    reviews = KubeReviews.connect(api_url=api_url, kubeconfig=kubeconfig)
    log.info("read APIs check bearer tokens with the API server",
             extra={"service": service, "api_server": reviews.where,
                    "cache_ttl_s": ttl_s})  # fmt: skip
    return Gate(reviews, service, ttl_s=ttl_s, cache_size=cache_size)


async def close_gate(gate: Gate | None) -> None:
    close = getattr(gate.reviews, "close", None) if gate is not None else None
    if close is not None:
        await close()
