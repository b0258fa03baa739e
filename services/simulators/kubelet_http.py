"""The kubelet simulator's small HTTP API, used by `vgpu submit` in local mode."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

import msgspec
from aiohttp import web
from opentelemetry import context as otel_context

from services.common.tracing import context_from_headers
from services.simulators.kubelet_pods import PodError
from services.simulators.kubelet_records import AdmitResult

if TYPE_CHECKING:
    from services.simulators.kubelet import KubeletSimulator

SIMULATOR_KEY: web.AppKey[KubeletSimulator] = web.AppKey("kubelet_simulator")


def _json(body: Any, status: int = 200) -> web.Response:
    return web.Response(
        body=msgspec.json.encode(body), status=status, content_type="application/json"
    )


def result_body(result: AdmitResult) -> dict[str, Any]:
    """A failed admission answers {"error": ...} plus the pod's identity, nothing else."""
    if result.error:
        return {
            "error": result.error,
            "namespace": result.namespace,
            "name": result.name,
            "uid": result.uid,
        }
    body = msgspec.to_builtins(result)
    body.pop("error", None)
    return body


async def post_pod(request: web.Request) -> web.Response:
    try:
        pod = json.loads(await request.text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        return _json({"error": f"malformed JSON: {exc}"}, 400)
    token = otel_context.attach(context_from_headers(dict(request.headers)))
    try:
        result = await request.app[SIMULATOR_KEY].admit(pod)
    except PodError as exc:
        return _json({"error": f"malformed pod: {exc}"}, 400)
    finally:
        otel_context.detach(token)
    return _json(result_body(result))


async def delete_pod(request: web.Request) -> web.Response:
    namespace, name = request.match_info["namespace"], request.match_info["name"]
    if not request.app[SIMULATOR_KEY].remove(namespace, name):
        return _json({"error": f"pod {namespace}/{name} is not admitted on this node"}, 404)
    return _json({"removed": f"{namespace}/{name}"})


async def list_pods(request: web.Request) -> web.Response:
    return _json([result_body(result) for result in request.app[SIMULATOR_KEY].pods()])


async def healthz(request: web.Request) -> web.Response:
    simulator = request.app[SIMULATOR_KEY]
    return _json({"status": "ok", "node": simulator.node_name, "resources": simulator.resources()})


def build_app(simulator: KubeletSimulator) -> web.Application:
    app = web.Application()
    app[SIMULATOR_KEY] = simulator
    app.router.add_post("/pods", post_pod)
    app.router.add_delete("/pods/{namespace}/{name}", delete_pod)
    app.router.add_get("/pods", list_pods)
    app.router.add_get("/healthz", healthz)
    return app
