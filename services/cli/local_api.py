"""A minimal stand-in for the API server's pod endpoints in local mode.

In a cluster, a pod exists in the API server before kube-scheduler asks the extender about it;
`vgpu submit` creates it here first, in the allocator's in-memory cluster backend. As a real
API server, it runs the mutating admission webhooks on pod CREATE first (AdmissionReview v1
over HTTPS to the allocator's webhook, services/simulators/admission.py), so peer syntaxes are
rewritten into vgpu's names before anything schedules the pod. A second pod of the same name
is refused 409 AlreadyExists, and `vgpu delete` removes one (DELETE), which frees its slices
and its kubelet's devices.
It also answers TokenReview and SubjectAccessReview from `vgpu up`'s users file
(local_users.py), so the allocator and the metrics service check tokens here as they do with
a real API server.
"""

from __future__ import annotations

from typing import Any

from aiohttp import web

from services.allocator.backend import AlreadyExists, BackendError, LocalClusterBackend
from services.common.http_server import serve
from services.simulators.admission import AdmissionRefused, MutatingAdmission
from services.simulators.kube_users import UsersFileSource, review_routes


def _error(status: int, message: str, reason: str = "", name: str = "") -> web.Response:
    body: dict[str, Any] = {"kind": "Status", "apiVersion": "v1", "status": "Failure",
                            "message": message, "code": status}  # fmt: skip
    if reason:  # as the API server's Status: kubectl prints "Error from server (<reason>)"
        body["reason"] = reason
    if name:
        body["details"] = {"name": name, "kind": "pods"}
    return web.json_response(body, status=status)


class LocalApiServer:
    def __init__(
        self,
        backend: LocalClusterBackend,
        host: str = "127.0.0.1",
        admission: MutatingAdmission | None = None,
        users: UsersFileSource | None = None,
    ) -> None:
        self._backend = backend
        # Set once the allocator's webhook serves (it starts after this server, which its
        # token checks need first).
        self.admission = admission
        self._users = users
        self._host = host
        self._runner: web.AppRunner | None = None
        self._port = 0

    @property
    def url(self) -> str:
        return f"http://{self._host}:{self._port}"

    async def start(self) -> None:
        app = web.Application()
        app.add_routes(
            [
                web.post("/api/v1/namespaces/{namespace}/pods", self._create),
                web.get("/api/v1/namespaces/{namespace}/pods/{name}", self._get),
                web.delete("/api/v1/namespaces/{namespace}/pods/{name}", self._delete),
                web.post("/api/v1/namespaces/{namespace}/pods/{name}/binding", self._bind),
            ]
        )
        if self._users is not None:
            app.add_routes(review_routes(self._users.current))
        self._runner, self._port = await serve(app, self._host)

    async def stop(self) -> None:
        runner, self._runner = self._runner, None
        if runner is not None:
            await runner.cleanup()

    async def _create(self, request: web.Request) -> web.Response:
        namespace = request.match_info["namespace"]
        try:
            pod: Any = await request.json()
        except ValueError as exc:
            return _error(400, f"request body is not JSON: {exc}")
        metadata = pod.get("metadata") if isinstance(pod, dict) else None
        if not isinstance(metadata, dict) or metadata.get("namespace", namespace) != namespace:
            return _error(400, f"the pod must be an object with metadata in namespace {namespace}")
        metadata["namespace"] = namespace
        if self.admission is not None:
            try:
                pod = await self.admission.admit(pod, namespace, headers=request.headers)
            except AdmissionRefused as exc:
                return _error(exc.code, exc.message, exc.reason)
        try:
            self._backend.create_pod(pod)
        except AlreadyExists as exc:
            return _error(409, str(exc), "AlreadyExists", str(metadata.get("name")))
        except BackendError as exc:
            return _error(400, str(exc))
        return web.json_response(pod, status=201)

    async def _delete(self, request: web.Request) -> web.Response:
        """DELETE a pod at once (grace period 0: the simulated containers hold no process)."""
        namespace, name = request.match_info["namespace"], request.match_info["name"]
        pod = self._backend.remove_pod(namespace, name)
        if pod is None:
            return _error(404, f'pods "{name}" not found', "NotFound", name)
        return web.json_response(pod)

    async def _get(self, request: web.Request) -> web.Response:
        namespace, name = request.match_info["namespace"], request.match_info["name"]
        pod = await self._backend.get_pod(namespace, name)
        if pod is None:
            return _error(404, f'pods "{name}" not found', "NotFound", name)
        return web.json_response(pod)

    async def _bind(self, request: web.Request) -> web.Response:
        """POST pods/<name>/binding, as kube-scheduler's DefaultBinder binds pods that the
        extender does not (those asking for no GPU)."""
        namespace, name = request.match_info["namespace"], request.match_info["name"]
        try:
            binding: Any = await request.json()
        except ValueError as exc:
            return _error(400, f"request body is not JSON: {exc}")
        target = binding.get("target") if isinstance(binding, dict) else None
        node = target.get("name") if isinstance(target, dict) else None
        if not isinstance(node, str) or not node:
            return _error(400, "a binding needs target.name (the node)")
        uid = (binding.get("metadata") or {}).get("uid") or ""
        try:
            await self._backend.bind(namespace, name, uid, node)
        except BackendError as exc:
            return _error(409, str(exc))
        return web.json_response({"kind": "Status", "status": "Success", "code": 201}, status=201)
