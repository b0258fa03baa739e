"""The parts of a v1.Pod (JSON) the kubelet simulator reads, checked with clear errors."""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from services.common.quantity import QuantityError, parse_quantity


class PodError(ValueError):
    """The pod JSON is malformed; the message names the field."""


@dataclass(frozen=True)
class ContainerSpec:
    name: str
    init: bool
    restartable: bool  # an init container with restartPolicy Always (a sidecar)
    extended: dict[str, int] = field(default_factory=dict)  # extended resource -> count
    # The container's own `env`, as the kubelet resolves it at start (downward API included).
    env: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class PodSpec:
    namespace: str
    name: str
    uid: str
    containers: tuple[ContainerSpec, ...]  # init containers first, as the kubelet admits

    @property
    def key(self) -> tuple[str, str]:
        return (self.namespace, self.name)


def _is_extended(resource: str) -> bool:
    """Extended resources are domain-qualified and outside kubernetes.io (kubelet rule)."""
    domain, sep, _ = resource.partition("/")
    return bool(sep) and domain != "kubernetes.io" and not domain.endswith(".kubernetes.io")


def _count(value: Any, where: str) -> int:
    """An extended resource: any Kubernetes quantity ("4", "4k", "1e3") that is a whole
    number, as the API server validates them."""
    try:
        amount = parse_quantity(value)
    except QuantityError as exc:
        raise PodError(f"{where}: {exc}") from None
    if amount.denominator != 1 or amount < 0:
        raise PodError(f"{where}: extended resources must be whole numbers, got {value!r}")
    return int(amount)


def _mapping(value: Any, where: str) -> Mapping[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise PodError(f"{where}: expected an object")
    return value


def _field_value(pod: Mapping[str, Any], path: str, where: str) -> str:
    """A downward-API fieldRef, as the kubelet resolves it for env (a missing label or
    annotation is the empty string); PodError for a path the API server would refuse."""
    metadata = _mapping(pod.get("metadata"), "metadata")
    spec = _mapping(pod.get("spec"), "spec")
    for kind in ("labels", "annotations"):
        prefix = f"metadata.{kind}['"
        if path.startswith(prefix) and path.endswith("']"):
            value = _mapping(metadata.get(kind), f"metadata.{kind}").get(path[len(prefix) : -2])
            return "" if value is None else str(value)
    simple = {
        "metadata.name": metadata.get("name"),
        "metadata.namespace": metadata.get("namespace") or "default",
        "metadata.uid": metadata.get("uid"),
        "spec.nodeName": spec.get("nodeName"),
        "spec.serviceAccountName": spec.get("serviceAccountName") or "default",
        # No pod network is simulated: the addresses are empty.
        "status.hostIP": "",
        "status.hostIPs": "",
        "status.podIP": "",
        "status.podIPs": "",
    }
    if path not in simple:
        raise PodError(f"{where}: unsupported fieldRef.fieldPath {path!r}")
    value = simple[path]
    return "" if value is None else str(value)


def _env(pod: Mapping[str, Any], raw: Any, where: str) -> dict[str, str]:
    """Literal values and downward-API fieldRefs; other sources (secrets, config maps) are
    not simulated and left out."""
    if raw is None:
        return {}
    if not isinstance(raw, list):
        raise PodError(f"{where}.env: expected a list")
    env: dict[str, str] = {}
    for position, item in enumerate(raw):
        entry = _mapping(item, f"{where}.env[{position}]")
        name = entry.get("name")
        if not isinstance(name, str) or not name:
            raise PodError(f"{where}.env[{position}]: name is missing")
        source = _mapping(entry.get("valueFrom"), f"{where}.env[{position}].valueFrom")
        field_ref = _mapping(source.get("fieldRef"), f"{where}.env[{position}].fieldRef")
        if field_ref:
            env[name] = _field_value(pod, str(field_ref.get("fieldPath")), f"{where}.env {name}")
        elif not source:
            env[name] = str(entry.get("value") or "")
    return env


def _container(raw: Any, where: str, init: bool, pod: Mapping[str, Any]) -> ContainerSpec:
    if not isinstance(raw, Mapping):
        raise PodError(f"{where}: expected a container object")
    name = raw.get("name")
    if not isinstance(name, str) or not name:
        raise PodError(f"{where}: container has no name")
    where = f"{where} ({name})"
    resources = _mapping(raw.get("resources"), f"{where}.resources")
    limits = _mapping(resources.get("limits"), f"{where}.resources.limits")
    requests = _mapping(resources.get("requests"), f"{where}.resources.requests")
    extended: dict[str, int] = {}
    for resource in [*limits, *(r for r in requests if r not in limits)]:
        if not _is_extended(resource):
            continue
        limit, request = limits.get(resource), requests.get(resource)
        count = _count(limit if limit is not None else request, f"{where} {resource}")
        if request is not None and _count(request, f"{where} {resource}") != count:
            raise PodError(f"{where} {resource}: requests must equal limits")
        extended[resource] = count
    restartable = init and raw.get("restartPolicy") == "Always"
    env = _env(pod, raw.get("env"), where)
    return ContainerSpec(name=name, init=init, restartable=restartable, extended=extended, env=env)


def parse_pod(pod: Any) -> PodSpec:
    if not isinstance(pod, Mapping):
        raise PodError("a pod must be a JSON object")
    metadata = _mapping(pod.get("metadata"), "metadata")
    name = metadata.get("name")
    if not isinstance(name, str) or not name:
        raise PodError("metadata.name is missing")
    namespace = metadata.get("namespace") or "default"
    if not isinstance(namespace, str):
        raise PodError("metadata.namespace must be a string")
    uid = metadata.get("uid") or str(uuid.uuid4())
    if not isinstance(uid, str):
        raise PodError("metadata.uid must be a string")
    spec = pod.get("spec")
    if not isinstance(spec, Mapping):
        raise PodError("spec is missing")
    containers: list[ContainerSpec] = []
    names: set[str] = set()
    for key, init in (("initContainers", True), ("containers", False)):
        items = spec.get(key) or []
        if not isinstance(items, list):
            raise PodError(f"spec.{key}: expected a list")
        for position, raw in enumerate(items):
            container = _container(raw, f"spec.{key}[{position}]", init, pod)
            if container.name in names:
                raise PodError(
                    f"spec.{key}[{position}]: duplicate container name {container.name!r}"
                )
            names.add(container.name)
            containers.append(container)
    if not any(not c.init for c in containers):
        raise PodError("spec.containers: a pod needs at least one container")
    return PodSpec(namespace=namespace, name=name, uid=uid, containers=tuple(containers))
