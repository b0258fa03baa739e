"""`vgpu run`'s target: which container of which pod placed by `vgpu up`, and what it was given.

The pod comes from the local API server (its spec: env, containers), the container's grant
from the node's kubelet simulator, which recorded each container's Allocate response (env,
mounts with their read-only flags, device nodes) as a kubelet hands it to the runtime.
Plain HTTP with urllib on purpose: `vgpu run` must stay single-threaded until it forks.
"""

from __future__ import annotations

import json
import re
import sys
import urllib.error
import urllib.request
from typing import Any

import msgspec

from services.cli.state import UpState
from services.simulators.kubelet_records import AdmitResult, AdmittedContainer

DEFAULT_CONTAINER_ANNOTATION = "kubectl.kubernetes.io/default-container"
_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")  # RFC 1123 label
_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
# The fieldRef paths `vgpu run` can fill in from the pod (the kubelet's downward API).
_FIELD_PATHS = {
    "metadata.name": ("metadata", "name"),
    "metadata.namespace": ("metadata", "namespace"),
    "metadata.uid": ("metadata", "uid"),
    "spec.nodeName": ("spec", "nodeName"),
    "spec.serviceAccountName": ("spec", "serviceAccountName"),
}


class TargetError(ValueError):
    """The target cannot be run; the message says what is wrong with it."""


class Target(msgspec.Struct, frozen=True):
    namespace: str
    pod: str
    container: str | None = None


class ResolvedTarget(msgspec.Struct, kw_only=True):
    namespace: str
    pod: str
    uid: str
    node: str
    container: AdmittedContainer
    env: dict[str, str]  # Allocate envs, then the pod spec's env (later wins, as in the kubelet)
    notices: list[str] = []  # said on stderr, e.g. which container was picked


def parse_target(text: str) -> Target:
    parts = text.split("/")
    if len(parts) not in (2, 3) or not all(parts):
        raise TargetError(f"malformed target {text!r}: expected NAMESPACE/POD[/CONTAINER]")
    namespace, pod = parts[0], parts[1]
    container = parts[2] if len(parts) == 3 else None
    if len(namespace) > 63 or not _LABEL.match(namespace):
        raise TargetError(f"malformed target {text!r}: {namespace!r} is not a namespace name")
    if len(pod) > 253 or not _SUBDOMAIN.match(pod):
        raise TargetError(f"malformed target {text!r}: {pod!r} is not a pod name")
    if container is not None and (len(container) > 63 or not _LABEL.match(container)):
        raise TargetError(f"malformed target {text!r}: {container!r} is not a container name")
    return Target(namespace, pod, container)


def _get_json(url: str, what: str) -> Any:
    try:
        with urllib.request.urlopen(url, timeout=10) as response:
            return json.loads(response.read())
    except urllib.error.HTTPError as exc:
        if exc.code == 404:
            return None
        raise TargetError(f"{what} answered {exc.code}: {exc.read()[:200]!r}") from exc
    except (urllib.error.URLError, OSError) as exc:
        raise TargetError(f"cannot reach {what} at {url}: {exc}") from exc


def _pod_env(
    pod: dict[str, Any], spec: dict[str, Any], notices: list[str], resolved: dict[str, str]
) -> dict[str, str]:
    """The pod spec's env; `resolved`: what the kubelet simulator resolved at admission (the
    downward API included), taken first, as the container was started with it."""
    env: dict[str, str] = {}
    for item in spec.get("env") or []:
        name = item.get("name")
        if not name:
            continue
        if name in resolved:
            env[name] = resolved[name]
            continue
        if "value" in item or "valueFrom" not in item:
            env[name] = str(item.get("value", ""))
            continue
        field = (item["valueFrom"].get("fieldRef") or {}).get("fieldPath", "")
        if field in _FIELD_PATHS:
            section, key = _FIELD_PATHS[field]
            env[name] = str(pod.get(section, {}).get(key, ""))
        else:
            notices.append(
                f"env {name} skipped: vgpu run fills only values and {sorted(_FIELD_PATHS)}"
            )
    return env


def _pick_container(
    target: Target, pod: dict[str, Any], admitted: AdmitResult, notices: list[str]
) -> AdmittedContainer:
    by_name = {container.name: container for container in admitted.containers}
    names = ", ".join(by_name) or "none"
    where = f"pod {target.namespace}/{target.pod}"
    if target.container is not None:
        if target.container not in by_name:
            raise TargetError(
                f'container "{target.container}" not found in {where}; its containers: {names}'
            )
        return by_name[target.container]
    apps = [container for container in admitted.containers if not container.init]
    if not apps:
        raise TargetError(f"{where} has no app container to run in; its containers: {names}")
    wanted = pod.get("metadata", {}).get("annotations", {}).get(DEFAULT_CONTAINER_ANNOTATION)
    chosen = by_name.get(wanted, apps[0]) if wanted else apps[0]
    if len(apps) > 1:
        others = ", ".join(container.name for container in apps)
        notices.append(f'Defaulted container "{chosen.name}" out of: {others}')
    return chosen


def resolve(target: Target, state: UpState) -> ResolvedTarget:
    where = f"pod {target.namespace}/{target.pod}"
    pod = _get_json(
        f"{state.api_url}/api/v1/namespaces/{target.namespace}/pods/{target.pod}", "the API server"
    )
    if pod is None:
        raise TargetError(f"{where} not found (vgpu up knows only the pods `vgpu submit` created)")
    node = pod.get("spec", {}).get("nodeName")
    if not node:
        raise TargetError(f"{where} is not placed on a node (`vgpu submit` printed why)")
    if node not in state.kubelets:
        raise TargetError(f"{where} is bound to {node}, which this `vgpu up` does not run")
    listed = _get_json(f"{state.kubelets[node]}/pods", f"the kubelet of {node}") or []
    uid = pod["metadata"].get("uid", "")
    admitted = next(
        (
            msgspec.convert(item, AdmitResult)
            for item in listed
            if (item.get("namespace"), item.get("name"), item.get("uid"))
            == (target.namespace, target.pod, uid)
        ),
        None,
    )
    if admitted is None or admitted.error:
        raise TargetError(f"{where} is bound to {node} but not running there (admission failed)")
    notices: list[str] = []
    container = _pick_container(target, pod, admitted, notices)
    specs = [*pod["spec"].get("initContainers", []), *pod["spec"].get("containers", [])]
    spec = next((s for s in specs if s.get("name") == container.name), {})
    env = {**container.envs, **_pod_env(pod, spec, notices, container.container_env)}
    return ResolvedTarget(
        namespace=target.namespace, pod=target.pod, uid=uid, node=node,
        container=container, env=env, notices=notices,
    )  # fmt: skip


def say_notices(resolved: ResolvedTarget) -> None:
    for notice in resolved.notices:
        print(notice, file=sys.stderr)
