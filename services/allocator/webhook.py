"""The mutating admission webhook: AdmissionReview v1 over HTTPS, served by the allocator.

For a pod that asks for GPU slices (in vgpu's names or any peer syntax) it sets
``spec.schedulerName``, rewrites each container's GPU resources into vgpu's names with
HAMi's defaults filled in (``nvidia.com/gpu`` added, Volcano/Aliyun/Tencent/AWS names and KAI
annotations translated and removed), and gives every container that asks for no GPU
``NVIDIA_VISIBLE_DEVICES=void`` so an image's ``=all`` cannot expose every GPU. A container's
own ``NVIDIA_VISIBLE_DEVICES`` never survives: the kubelet appends the pod's env after the
device plugin's, so ``=all`` in a GPU container's env would widen its slice to every GPU of the
node (it is removed), and in any other container it becomes ``void``. A pod with a
malformed GPU request (or a quantity that is not one) is denied with the reason, naming the
field. A pod asking for no GPU gets ``spec.schedulerName`` (with ``schedule_cpu_pods``, the
default), so the GPU-aware host score places it too, and ``void`` for the containers that name
``NVIDIA_VISIBLE_DEVICES``; nothing else of it changes. Containers asking Aliyun gpushare's
``aliyun.com/gpu-mem`` also get gpushare's four ``ALIYUN_COM_GPU_MEM_*`` variables and the pod
its ``ALIYUN_COM_GPU_MEM_POD`` annotation (gpushare.py).
"""

from __future__ import annotations

import base64
import json
import logging
import ssl
from collections.abc import Iterator, Mapping
from typing import Any

from aiohttp import web
from prometheus_client import Counter

from services.common.http_server import bounded_app, serve
from services.common.quantity import QuantityError
from services.common.resources import (
    KAI_FRACTION,
    KAI_MEMORY,
    PEER_RESOURCES,
    RequestConfig,
    RequestError,
    container_requests,
    normalized_limits,
)
from services.common.utf8 import utf8_problem

from . import gpushare
from .core import PlacementCore

log = logging.getLogger("vgpu.allocator")

REVIEWS = Counter(
    "vgpu_allocator_admission_reviews_total", "Admission reviews by outcome", ["outcome"]
)
VISIBLE_DEVICES = "NVIDIA_VISIBLE_DEVICES"
API_VERSION = "admission.k8s.io/v1"


class BadReview(ValueError):
    pass


def _escape(token: str) -> str:
    return token.replace("~", "~0").replace("/", "~1")


def _without(resources: Mapping[str, Any], names: set[str]) -> dict[str, Any]:
    return {k: v for k, v in resources.items() if k not in names}


_VOID = {"name": VISIBLE_DEVICES, "value": "void"}


def _env_patch(
    path: str, container: Mapping[str, Any], gets_gpu: bool, always: bool
) -> dict[str, Any] | None:
    """The patch that keeps a container from choosing its GPUs, or None if none is needed:
    its own NVIDIA_VISIBLE_DEVICES removed, plus `void` unless the device plugin hands it GPUs.
    `always`: patch even a container that does not name the variable (a GPU pod's containers
    that ask for none: an image's own `=all` must not apply either)."""
    env = list(container.get("env") or [])
    kept = [e for e in env if e.get("name") != VISIBLE_DEVICES]
    named = kept != env
    if gets_gpu:
        return {"op": "add", "path": f"{path}/env", "value": kept} if named else None
    if not (named or always):
        return None
    return {"op": "add", "path": f"{path}/env", "value": [*kept, _VOID]}


def _containers(spec: Mapping[str, Any]) -> Iterator[tuple[str, bool, Mapping[str, Any]]]:
    for key, init in (("initContainers", True), ("containers", False)):
        for index, container in enumerate(spec.get(key) or []):
            yield f"/spec/{key}/{index}", init, container


def mutate(
    pod: Mapping[str, Any],
    config: RequestConfig,
    scheduler_name: str,
    cpu_pods: bool = False,
    adopt: frozenset[str] = frozenset(),
) -> list[dict[str, Any]]:
    """The JSON patch for a pod; for a pod that asks for no GPU only its scheduler (with
    `cpu_pods`) and `void` where it names NVIDIA_VISIBLE_DEVICES, else []. RequestError or
    QuantityError when malformed."""
    requests = {(r.init, r.container): r for r in container_requests(pod, config)}
    spec = pod.get("spec") or {}
    patch: list[dict[str, Any]] = []
    if not requests:
        for path, _, container in _containers(spec):
            if env_patch := _env_patch(path, container, gets_gpu=False, always=False):
                patch.append(env_patch)
        if cpu_pods and spec.get("schedulerName") in (None, "", "default-scheduler"):
            patch.append({"op": "add", "path": "/spec/schedulerName", "value": scheduler_name})
        return patch
    ours = set(config.names.own()) | set(PEER_RESOURCES)
    aliyun = gpushare.asked_gib(pod, config)
    aliyun_total = gpushare.pod_gib(pod, config)
    for path, init, container in _containers(spec):
        request = requests.get((init, container.get("name")))
        env_patch = _env_patch(path, container, gets_gpu=request is not None, always=True)
        if request is not None and container.get("name") in aliyun:
            env = env_patch["value"] if env_patch else list(container.get("env") or [])
            env = gpushare.with_env(env, aliyun_total, aliyun[container["name"]])
            env_patch = {"op": "add", "path": f"{path}/env", "value": env}
        if env_patch:
            patch.append(env_patch)
        if request is None:
            continue
        resources = dict(container.get("resources") or {})
        limits = normalized_limits(request, config.names)
        resources["limits"] = {**_without(resources.get("limits") or {}, ours), **limits}
        if "requests" in resources:
            resources["requests"] = {**_without(resources["requests"] or {}, ours), **limits}
        patch.append({"op": "add", "path": f"{path}/resources", "value": resources})
    # A GPU pod naming a peer's scheduler that vgpu replaces (`adopt_schedulers`) moves too.
    if spec.get("schedulerName") in (None, "", "default-scheduler", *adopt):
        patch.append({"op": "add", "path": "/spec/schedulerName", "value": scheduler_name})
    annotations = (pod.get("metadata") or {}).get("annotations") or {}
    if aliyun:  # gpushare's pod total; it also tells the allocator to write the rest at bind
        if annotations:
            path = f"/metadata/annotations/{_escape(gpushare.POD)}"
            patch.append({"op": "add", "path": path, "value": str(aliyun_total)})
        else:
            patch.append({"op": "add", "path": "/metadata/annotations",
                          "value": {gpushare.POD: str(aliyun_total)}})  # fmt: skip
    for kai in (KAI_FRACTION, KAI_MEMORY):
        if kai in annotations:  # translated above: the extender must not apply it again
            patch.append({"op": "remove", "path": f"/metadata/annotations/{_escape(kai)}"})
    return patch


def review(
    body: bytes,
    config: RequestConfig,
    scheduler_name: str,
    cpu_pods: bool = False,
    adopt: frozenset[str] = frozenset(),
) -> dict[str, Any]:
    """An AdmissionReview answer for an AdmissionReview request; BadReview if malformed."""
    problem = utf8_problem(body, "AdmissionReview")
    if problem:
        raise BadReview(problem)
    try:
        document = json.loads(body)
    except ValueError as exc:
        raise BadReview(f"request body is not valid JSON: {exc}") from exc
    if not isinstance(document, dict) or document.get("kind") != "AdmissionReview":
        raise BadReview("expected an AdmissionReview object")
    if document.get("apiVersion") != API_VERSION:
        raise BadReview(f"apiVersion must be {API_VERSION}, got {document.get('apiVersion')!r}")
    request = document.get("request")
    if not isinstance(request, dict) or not isinstance(request.get("uid"), str):
        raise BadReview("AdmissionReview.request.uid: missing")
    answer: dict[str, Any] = {"uid": request["uid"], "allowed": True}
    pod = request.get("object")
    kind = (request.get("kind") or {}).get("kind")
    if kind == "Pod" and isinstance(pod, dict):
        try:
            patch = mutate(pod, config, scheduler_name, cpu_pods, adopt)
        except (RequestError, QuantityError) as exc:
            answer["allowed"] = False
            answer["status"] = {"code": 400, "message": f"invalid GPU request: {exc}"}
            REVIEWS.labels(outcome="denied").inc()
        else:
            if patch:
                answer["patchType"] = "JSONPatch"
                answer["patch"] = base64.b64encode(json.dumps(patch).encode()).decode()
            REVIEWS.labels(outcome="patched" if patch else "unchanged").inc()
    return {"apiVersion": API_VERSION, "kind": "AdmissionReview", "response": answer}


class WebhookServer:
    def __init__(self, settings: Any, core: PlacementCore) -> None:
        self._settings = settings
        self._config = core.request_config
        self._runner: web.AppRunner | None = None
        self._port = 0

    @property
    def url(self) -> str:
        host = self._settings.webhook_host
        return f"https://{'127.0.0.1' if host == '0.0.0.0' else host}:{self._port}"

    async def _mutate(self, request: web.Request) -> web.Response:
        try:
            answer = review(
                await request.read(),
                self._config,
                self._settings.scheduler_name,
                self._settings.schedule_cpu_pods,
                frozenset(self._settings.adopt_schedulers),
            )
        except BadReview as exc:
            REVIEWS.labels(outcome="bad_request").inc()
            return web.json_response({"error": str(exc)}, status=400)
        return web.json_response(answer)

    async def start(self) -> None:
        settings = self._settings
        if not settings.tls_cert_file or not settings.tls_key_file:
            raise RuntimeError("the admission webhook needs tls_cert_file and tls_key_file")
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        context.load_cert_chain(settings.tls_cert_file, settings.tls_key_file)
        app = bounded_app(
            "webhook", settings.webhook_max_body_bytes, setting="webhook_max_body_bytes"
        )
        app.router.add_post("/mutate", self._mutate)
        self._runner, self._port = await serve(
            app, settings.webhook_host, settings.webhook_port, ssl_context=context
        )
        log.info("admission webhook serving", extra={"url": self.url})

    async def stop(self) -> None:
        runner, self._runner = self._runner, None
        if runner is not None:
            await runner.cleanup()
