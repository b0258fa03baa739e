"""A pod's CPU and memory requests on its node, counted as kube-scheduler counts them.

kube-scheduler's NodeResourcesFit (component-helpers ``resource.PodRequests``): the sum of the
app containers' requests against the largest init container's, where sidecars (init
containers with ``restartPolicy: Always``) run beside everything after them and so add to
both; pod-level ``spec.resources.requests`` (when set) replace the containers' total for that
resource; then ``spec.overhead`` is added. A container that gives a limit but no request
requests its limit (the API server's defaulting, for pods that never went through it).
CPU is in millicores (MilliValue, rounded up); memory in bytes (Value, rounded up).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from services.common.quantity import QuantityError, milli_value, parse_quantity, value

MIB = 1024 * 1024


@dataclass(frozen=True)
class HostRequests:
    cpu_milli: int = 0
    memory_bytes: int = 0

    @property
    def memory_mib(self) -> int:
        """Rounded up: a pod never looks smaller than it is."""
        return -(-self.memory_bytes // MIB)

    def __add__(self, other: HostRequests) -> HostRequests:
        return HostRequests(
            self.cpu_milli + other.cpu_milli, self.memory_bytes + other.memory_bytes
        )

    def most(self, other: HostRequests) -> HostRequests:
        return HostRequests(
            max(self.cpu_milli, other.cpu_milli), max(self.memory_bytes, other.memory_bytes)
        )


NONE = HostRequests()


def _amounts(
    resources: Mapping[str, Any], where: str, with_limits: bool
) -> tuple[int | None, int | None]:
    """(cpu milli, memory bytes) a resources object requests; None where it says nothing."""
    requests = resources.get("requests") or {}
    limits = (resources.get("limits") or {}) if with_limits else {}
    if not isinstance(requests, Mapping) or not isinstance(limits, Mapping):
        raise QuantityError(f"{where}: requests and limits must be objects")
    found: list[int | None] = []
    for name, convert in (("cpu", milli_value), ("memory", value)):
        raw = requests.get(name, limits.get(name))
        if raw is None:
            found.append(None)
            continue
        key = "requests" if name in requests else "limits"
        field = f"{where}.{name}" if where.endswith("overhead") else f"{where}.{key}.{name}"
        try:
            amount = parse_quantity(raw)
        except QuantityError as exc:
            raise QuantityError(f"{field}: {exc}") from None
        if amount < 0:
            raise QuantityError(f"{field}: must not be negative, got {raw!r}")
        found.append(convert(amount))
    return found[0], found[1]


def _container(container: Any, where: str) -> HostRequests:
    if not isinstance(container, Mapping):
        return NONE
    resources = container.get("resources") or {}
    if not isinstance(resources, Mapping):
        raise QuantityError(f"{where}.resources: expected an object")
    cpu, memory = _amounts(resources, f"{where}.resources", True)
    return HostRequests(cpu or 0, memory or 0)


def pod_host_requests(pod: Mapping[str, Any]) -> HostRequests:
    """What the pod holds on its node; QuantityError naming the field when one is malformed."""
    spec = pod.get("spec")
    if not isinstance(spec, Mapping):
        return NONE
    containers = spec.get("containers") or []
    inits = spec.get("initContainers") or []
    if not isinstance(containers, list) or not isinstance(inits, list):
        raise QuantityError("spec.containers and spec.initContainers must be lists")
    total = NONE
    for index, container in enumerate(containers):
        total = total + _container(container, f"spec.containers[{index}]")
    sidecars = largest_init = NONE
    for index, container in enumerate(inits):
        needs = _container(container, f"spec.initContainers[{index}]")
        if isinstance(container, Mapping) and container.get("restartPolicy") == "Always":
            total = total + needs  # a sidecar runs beside the app containers
            sidecars = sidecars + needs
            largest_init = largest_init.most(sidecars)
        else:
            largest_init = largest_init.most(needs + sidecars)  # beside the sidecars so far
    total = total.most(largest_init)
    pod_level = spec.get("resources")
    if isinstance(pod_level, Mapping):
        cpu, memory = _amounts(pod_level, "spec.resources", False)
        total = HostRequests(
            total.cpu_milli if cpu is None else cpu,
            total.memory_bytes if memory is None else memory,
        )
    overhead = spec.get("overhead")
    if isinstance(overhead, Mapping) and overhead:
        cpu, memory = _amounts({"requests": overhead}, "spec.overhead", False)
        total = total + HostRequests(cpu or 0, memory or 0)
    return total
