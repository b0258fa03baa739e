"""Mutating admission as the API server runs it for pod CREATE: AdmissionReview v1 over HTTPS.

For each configured webhook whose selectors match, the server POSTs an
``admission.k8s.io/v1`` AdmissionReview to the webhook's URL (trusting only its caBundle),
checks the answer (same apiVersion and kind, ``response.uid`` equal to the request's), applies
the base64 ``JSONPatch``, and refuses the pod when the webhook denies it. A call that fails
(connection refused, timeout, a malformed answer) follows the webhook's ``failurePolicy``:
``Fail`` refuses the pod (500, ``failed calling webhook``), ``Ignore`` admits it unchanged.
Messages are the API server's own, so users see what a cluster would tell them.
"""

from __future__ import annotations

import base64
import binascii
import json
import logging
import ssl
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import aiohttp
from prometheus_client import Counter

from services.common.tracing import context_from_headers, inject_headers, tracer
from services.simulators.json_patch import json_patch

log = logging.getLogger("vgpu.apiserver")
_tracer = tracer("vgpu.apiserver")

REVIEW_VERSION = "admission.k8s.io/v1"
CALLS = Counter(
    "vgpu_local_api_admission_calls_total",
    "Mutating webhook calls by the local API server, by webhook and outcome",
    ["webhook", "outcome"],
)

Requirement = tuple[str, str, tuple[str, ...]]  # (key, operator, values)


class AdmissionRefused(Exception):
    """The pod is refused; `code` and `reason` are the v1.Status the API server answers."""

    def __init__(self, code: int, reason: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.reason = reason
        self.message = message


class _CallFailed(Exception):
    pass


def _requirements(selector: Mapping[str, Any] | None, where: str) -> tuple[Requirement, ...]:
    """A LabelSelector (matchLabels, matchExpressions) as requirements; ValueError if bad."""
    if not selector:
        return ()
    found: list[Requirement] = [
        (key, "In", (str(value),)) for key, value in (selector.get("matchLabels") or {}).items()
    ]
    for expression in selector.get("matchExpressions") or []:
        operator = expression.get("operator")
        if operator not in ("In", "NotIn", "Exists", "DoesNotExist"):
            raise ValueError(f"{where}: unknown selector operator {operator!r}")
        values = tuple(str(v) for v in expression.get("values") or ())
        found.append((str(expression["key"]), operator, values))
    return tuple(found)


def selector_matches(requirements: Sequence[Requirement], labels: Mapping[str, str]) -> bool:
    for key, operator, values in requirements:
        present = key in labels
        if operator == "In" and not (present and labels[key] in values):
            return False
        if operator == "NotIn" and present and labels[key] in values:
            return False
        if operator == "Exists" and not present:
            return False
        if operator == "DoesNotExist" and present:
            return False
    return True


@dataclass(frozen=True)
class MutatingWebhook:
    """One entry of a MutatingWebhookConfiguration, pointed at a URL (its service's address)."""

    name: str
    url: str  # https://host:port/path
    ca_file: str  # the caBundle
    failure_policy: Literal["Fail", "Ignore"] = "Fail"
    timeout_s: float = 10.0  # timeoutSeconds; the API server's default is 10
    namespace_selector: tuple[Requirement, ...] = ()
    object_selector: tuple[Requirement, ...] = ()
    operations: frozenset[str] = field(default_factory=lambda: frozenset({"CREATE"}))

    @classmethod
    def from_configuration(
        cls, entry: Mapping[str, Any], base_url: str, ca_file: str
    ) -> MutatingWebhook:
        """From a `webhooks[]` entry of a MutatingWebhookConfiguration (its pod rules,
        selectors, failurePolicy, timeoutSeconds, clientConfig path), served at `base_url`."""
        name = entry["name"]
        policy = entry.get("failurePolicy", "Fail")
        if policy not in ("Fail", "Ignore"):
            raise ValueError(
                f"webhook {name}: failurePolicy must be Fail or Ignore, got {policy!r}"
            )
        operations: set[str] = set()
        for rule in entry.get("rules") or []:
            if "pods" in rule.get("resources", ()) or "*" in rule.get("resources", ()):
                operations.update(rule.get("operations") or ())
        path = (entry.get("clientConfig") or {}).get("service", {}).get("path", "")
        return cls(
            name=name,
            url=base_url.rstrip("/") + path,
            ca_file=ca_file,
            failure_policy=policy,
            timeout_s=float(entry.get("timeoutSeconds", 10)),
            namespace_selector=_requirements(entry.get("namespaceSelector"), name),
            object_selector=_requirements(entry.get("objectSelector"), name),
            operations=frozenset(operations),
        )

    def applies(self, operation: str, namespace: str, pod: Mapping[str, Any]) -> bool:
        if operation not in self.operations and "*" not in self.operations:
            return False
        # The local server keeps no Namespace objects: a namespace carries only the label
        # every namespace has, kubernetes.io/metadata.name.
        if not selector_matches(
            self.namespace_selector, {"kubernetes.io/metadata.name": namespace}
        ):
            return False
        labels = (pod.get("metadata") or {}).get("labels") or {}
        return selector_matches(self.object_selector, labels if isinstance(labels, dict) else {})


def review_request(pod: Mapping[str, Any], namespace: str, operation: str) -> dict[str, Any]:
    """The AdmissionReview the API server sends for a pod (v1, the object as created)."""
    pod_kind = {"group": "", "version": "v1", "kind": "Pod"}
    pods = {"group": "", "version": "v1", "resource": "pods"}
    return {
        "apiVersion": REVIEW_VERSION,
        "kind": "AdmissionReview",
        "request": {
            "uid": str(uuid.uuid4()),
            "kind": pod_kind,
            "resource": pods,
            "requestKind": pod_kind,
            "requestResource": pods,
            "name": (pod.get("metadata") or {}).get("name", ""),
            "namespace": namespace,
            "operation": operation,
            "userInfo": {"username": "vgpu-submit", "groups": ["system:authenticated"]},
            "object": pod,
            "oldObject": None,
            "dryRun": False,
            "options": {"apiVersion": "meta.k8s.io/v1", "kind": "CreateOptions"},
        },
    }


def _response(answer: Any, uid: str) -> dict[str, Any]:
    """The checked `response` of an AdmissionReview answer; _CallFailed when malformed."""
    if not isinstance(answer, dict) or answer.get("kind") != "AdmissionReview":
        raise _CallFailed("expected an AdmissionReview in the webhook's answer")
    if answer.get("apiVersion") != REVIEW_VERSION:
        raise _CallFailed(
            f"expected webhook response of {REVIEW_VERSION}, got {answer.get('apiVersion')!r}"
        )
    response = answer.get("response")
    if not isinstance(response, dict):
        raise _CallFailed("webhook response was absent")
    if response.get("uid") != uid:
        raise _CallFailed(f"expected response.uid={uid!r}, got {response.get('uid')!r}")
    if not isinstance(response.get("allowed"), bool):
        raise _CallFailed("webhook response has no boolean allowed")
    return response


def _patched(pod: dict[str, Any], response: Mapping[str, Any]) -> dict[str, Any]:
    patch = response.get("patch")
    if patch is None:
        return pod
    if response.get("patchType") != "JSONPatch":
        raise _CallFailed(f"unsupported patch type {response.get('patchType')!r}")
    try:
        operations = json.loads(base64.b64decode(patch, validate=True))
        patched = json_patch(pod, operations)
    except (binascii.Error, ValueError, KeyError, IndexError, TypeError) as exc:
        raise _CallFailed(f"the webhook's JSON patch does not apply: {exc}") from exc
    if not isinstance(patched, dict):
        raise _CallFailed("the webhook's JSON patch did not leave an object")
    return patched


class MutatingAdmission:
    """The mutating admission phase of pod creation, for the webhooks given in order."""

    def __init__(self, webhooks: Sequence[MutatingWebhook]) -> None:
        self.webhooks = tuple(webhooks)
        self._trust = {w.ca_file: ssl.create_default_context(cafile=w.ca_file) for w in webhooks}

    async def admit(
        self,
        pod: dict[str, Any],
        namespace: str,
        operation: str = "CREATE",
        headers: Mapping[str, str] | None = None,
    ) -> dict[str, Any]:
        """The pod as the webhooks leave it; AdmissionRefused when one refuses it. `headers`:
        the creating request's, whose trace context the calls continue (as the API server's
        tracing does)."""
        parent = context_from_headers(headers)
        for webhook in self.webhooks:
            if webhook.applies(operation, namespace, pod):
                name = f"admission webhook {webhook.name}"
                with _tracer.start_as_current_span(name, context=parent):
                    pod = await self._call(webhook, pod, namespace, operation)
        return pod

    async def _call(
        self, webhook: MutatingWebhook, pod: dict[str, Any], namespace: str, operation: str
    ) -> dict[str, Any]:
        review = review_request(pod, namespace, operation)
        uid = review["request"]["uid"]
        where = f"{namespace}/{(pod.get('metadata') or {}).get('name', '')}"
        try:
            answer = await self._post(webhook, review)
            response = _response(answer, uid)
            if not response["allowed"]:
                CALLS.labels(webhook=webhook.name, outcome="denied").inc()
                status = response.get("status") or {}
                code = status.get("code") or 400
                message = status.get("message") or "without explanation"
                log.info("webhook denied a pod", extra={"webhook": webhook.name, "pod": where,
                                                        "reason": message})  # fmt: skip
                raise AdmissionRefused(
                    max(int(code), 400),
                    status.get("reason") or "BadRequest",
                    f'admission webhook "{webhook.name}" denied the request: {message}',
                )
            patched = _patched(pod, response)
        except _CallFailed as exc:
            return self._failed(webhook, pod, where, str(exc))
        CALLS.labels(
            webhook=webhook.name, outcome="patched" if patched is not pod else "allowed"
        ).inc()
        return patched

    async def _post(self, webhook: MutatingWebhook, review: dict[str, Any]) -> Any:
        timeout = aiohttp.ClientTimeout(total=webhook.timeout_s)
        try:
            async with (
                aiohttp.ClientSession(timeout=timeout) as session,
                session.post(
                    webhook.url,
                    json=review,
                    headers=inject_headers(),
                    ssl=self._trust[webhook.ca_file],
                ) as answer,
            ):
                if answer.status != 200:
                    body = (await answer.text())[:300]
                    raise _CallFailed(f"the server responded with {answer.status}: {body}")
                return await answer.json(content_type=None)
        except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
            raise _CallFailed(
                f'failed to call webhook: Post "{webhook.url}": {exc or type(exc).__name__}'
            ) from exc

    def _failed(
        self, webhook: MutatingWebhook, pod: dict[str, Any], where: str, why: str
    ) -> dict[str, Any]:
        message = f'failed calling webhook "{webhook.name}": {why}'
        log.warning("webhook call failed", extra={"webhook": webhook.name, "pod": where,
                                                  "policy": webhook.failure_policy,
                                                  "reason": why})  # fmt: skip
        if webhook.failure_policy == "Ignore":
            CALLS.labels(webhook=webhook.name, outcome="failed_ignored").inc()
            return pod
        CALLS.labels(webhook=webhook.name, outcome="failed").inc()
        raise AdmissionRefused(500, "InternalError", f"Internal error occurred: {message}")
