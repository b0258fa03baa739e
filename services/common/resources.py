"""Pod resource names vgpu reads, and their translation into ContainerRequests.

vgpu's own names are HAMi's by default (and configurable through ``RequestConfig``). A
container takes part in GPU sharing when it names any of them, or any peer syntax users bring
from other systems (Volcano, Aliyun gpushare, Tencent vcuda, AWS vgpu, KAI annotations):
those are translated into vgpu's own terms here, in one place, for the extender and the
admission webhook alike. Defaults are HAMi's: ``nvidia.com/gpu`` defaults to 1 when only
memory or cores are given, memory defaults to the whole card, cores to 0 (no compute limit).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any

from services.common.quantity import QuantityError, parse_quantity, whole_number
from services.common.schemas import ContainerRequest

GPU = "nvidia.com/gpu"
GPU_MEMORY = "nvidia.com/gpumem"
GPU_MEMORY_PERCENT = "nvidia.com/gpumem-percentage"
GPU_CORES = "nvidia.com/gpucores"
GPU_PRIORITY = "nvidia.com/priority"

GPU_RESOURCES = (GPU, GPU_MEMORY, GPU_MEMORY_PERCENT, GPU_CORES)

# Peer syntaxes (see docs/allocator.md, "Requests").
VOLCANO_NUMBER = "volcano.sh/vgpu-number"
VOLCANO_MEMORY = "volcano.sh/vgpu-memory"  # MiB per GPU
VOLCANO_MEMORY_PERCENT = "volcano.sh/vgpu-memory-percentage"
VOLCANO_CORES = "volcano.sh/vgpu-cores"
ALIYUN_MEMORY = "aliyun.com/gpu-mem"  # GiB on one GPU, no compute share
TENCENT_CORE = "tencent.com/vcuda-core"  # 100 = one whole GPU; below 100 a share of one
TENCENT_MEMORY = "tencent.com/vcuda-memory"  # units of 256 MiB
# gpu-manager's older spelling of the same two resources, read exactly alike.
DOCKER_CORE = "docker.com/vcuda-core"
DOCKER_MEMORY = "docker.com/vcuda-memory"
AWS_VGPU = "k8s.amazonaws.com/vgpu"  # N equal slices of one GPU
KAI_FRACTION = "gpu-fraction"  # pod annotation: share of one GPU, e.g. "0.5"
KAI_MEMORY = "gpu-memory"  # pod annotation: MiB on one GPU

PEER_RESOURCES = (
    VOLCANO_NUMBER,
    VOLCANO_MEMORY,
    VOLCANO_MEMORY_PERCENT,
    VOLCANO_CORES,
    ALIYUN_MEMORY,
    TENCENT_CORE,
    TENCENT_MEMORY,
    DOCKER_CORE,
    DOCKER_MEMORY,
    AWS_VGPU,
)
# What the filter-and-bind extender entry manages (deploy/k8s/base/scheduler/config.yaml):
# every name vgpu reads, so kube-scheduler sends every GPU pod to it.
MANAGED_RESOURCES = (*GPU_RESOURCES, GPU_PRIORITY, *PEER_RESOURCES)
TENCENT_UNIT_MIB = 256
ALIYUN_UNIT_MIB = 1024


class RequestError(ValueError):
    """A pod's GPU request is malformed or impossible; the message names the culprit.

    A quantity that is not one at all raises QuantityError instead (not a RequestError): the
    API server never stores such a pod, so the extender answers it as a malformed body (400).
    """


@dataclass(frozen=True)
class ResourceNames:
    """The resource names vgpu answers to (HAMi's by default; HAMi lets users rename them)."""

    gpu: str = GPU
    memory: str = GPU_MEMORY
    memory_percent: str = GPU_MEMORY_PERCENT
    cores: str = GPU_CORES
    priority: str = GPU_PRIORITY

    def own(self) -> tuple[str, ...]:
        return (self.gpu, self.memory, self.memory_percent, self.cores, self.priority)


@dataclass(frozen=True)
class RequestConfig:
    """How requests are read: names and HAMi's defaults (defaultMem, defaultCores)."""

    names: ResourceNames = field(default_factory=ResourceNames)
    default_memory_mib: int = 0  # 0: the whole card, as HAMi's defaultMem 0
    default_cores: int = 0  # 0: no compute limit, as HAMi's defaultCores 0
    # gpushare's --memory-unit: aliyun.com/gpu-mem counts GiB (its default) or MiB.
    aliyun_unit_mib: int = ALIYUN_UNIT_MIB
    translate_peers: bool = True
    # A bare GPU count asks for equal shares (S x M / K per GPU, 4paradigm), not whole GPUs.
    count_only_equal_share: bool = False


DEFAULT_CONFIG = RequestConfig()


@dataclass(frozen=True)
class GpuValues:
    """One container's GPU request in vgpu's terms, before defaults (None = not given)."""

    gpus: int | None = None
    memory_mib: int | None = None
    memory_percent: int | None = None
    cores: int | None = None
    priority: int | None = None
    vgpus: int | None = None  # AWS: vGPUs of one GPU, sized by that GPU's count at placement
    syntax: str = "vgpu"  # which syntax the pod used: vgpu, volcano, aliyun, tencent, aws, kai


def _quantity(value: Any, where: str) -> int:
    """A whole count read as Kubernetes reads a quantity ("4k", "1Ki", "500m", "1e3"):
    Quantity.Value(), rounded up; QuantityError naming `where` when malformed."""
    return whole_number(value, where)


def _resource_maps(
    container: Mapping[str, Any], where: str
) -> tuple[Mapping[str, Any], Mapping[str, Any]]:
    resources = container.get("resources") or {}
    if not isinstance(resources, Mapping):
        raise RequestError(f"{where}.resources: expected an object")
    limits = resources.get("limits") or {}
    requests = resources.get("requests") or {}
    if not isinstance(limits, Mapping) or not isinstance(requests, Mapping):
        raise RequestError(f"{where}.resources: limits and requests must be objects")
    return limits, requests


def _read(container: Mapping[str, Any], names: Iterable[str], where: str) -> dict[str, int]:
    limits, requests = _resource_maps(container, where)
    found: dict[str, int] = {}
    for name in names:
        limit = limits.get(name)
        request = requests.get(name)
        if limit is None and request is None:
            continue
        given = limit if limit is not None else request
        kind = "limits" if limit is not None else "requests"
        value = _quantity(given, f"{where} resources.{kind}[{name}]")
        if limit is not None and request is not None:
            asked = whole_number(request, f"{where} resources.requests[{name}]")
            if parse_quantity(request) != parse_quantity(limit) or asked != value:
                raise RequestError(
                    f"{where} {name}: requests must equal limits for extended resources "
                    f"(requests {request!r}, limits {limit!r})"
                )
        found[name] = value
    return found


def _own_values(found: Mapping[str, int], names: ResourceNames) -> GpuValues:
    return GpuValues(
        gpus=found.get(names.gpu),
        memory_mib=found.get(names.memory),
        memory_percent=found.get(names.memory_percent),
        cores=found.get(names.cores),
        priority=found.get(names.priority),
    )


def _one_spelling(found: Mapping[str, int], name: str, alias: str, where: str) -> int | None:
    """gpu-manager's value under either spelling; both at once must agree."""
    value, other = found.get(name), found.get(alias)
    if value is not None and other is not None and value != other:
        raise RequestError(f"{where}: {name} ({value}) and {alias} ({other}) disagree; give one")
    return value if value is not None else other


def _peer_values(found: Mapping[str, int], where: str, config: RequestConfig) -> GpuValues:
    """Translate one peer syntax into vgpu's terms; several syntaxes at once is an error."""
    families = {
        "volcano": {VOLCANO_NUMBER, VOLCANO_MEMORY, VOLCANO_MEMORY_PERCENT, VOLCANO_CORES},
        "aliyun": {ALIYUN_MEMORY},
        "tencent": {TENCENT_CORE, TENCENT_MEMORY, DOCKER_CORE, DOCKER_MEMORY},
        "aws": {AWS_VGPU},
    }
    used = [name for name, keys in families.items() if keys & set(found)]
    if len(used) > 1:
        raise RequestError(f"{where}: mixes the {' and '.join(used)} request syntaxes; use one")
    syntax = used[0]
    if syntax == "volcano":
        return GpuValues(
            gpus=found.get(VOLCANO_NUMBER),
            memory_mib=found.get(VOLCANO_MEMORY),
            memory_percent=found.get(VOLCANO_MEMORY_PERCENT),
            cores=found.get(VOLCANO_CORES),
            syntax=syntax,
        )
    if syntax == "aliyun":
        units = found[ALIYUN_MEMORY]
        unit = "GiB" if config.aliyun_unit_mib == ALIYUN_UNIT_MIB else "MiB"
        if units < 1:
            raise RequestError(f"{where} {ALIYUN_MEMORY}: must be at least 1 ({unit}), got {units}")
        memory = units * config.aliyun_unit_mib
        return GpuValues(gpus=1, memory_mib=memory, cores=0, syntax=syntax)
    if syntax == "tencent":
        core = _one_spelling(found, TENCENT_CORE, DOCKER_CORE, where)
        units = _one_spelling(found, TENCENT_MEMORY, DOCKER_MEMORY, where)
        docker = TENCENT_CORE not in found and TENCENT_MEMORY not in found
        core_name = DOCKER_CORE if docker else TENCENT_CORE
        if core is None:
            memory_name = DOCKER_MEMORY if docker else TENCENT_MEMORY
            raise RequestError(f"{where}: {memory_name} needs {core_name} beside it")
        if core >= 100:
            if core % 100:
                raise RequestError(
                    f"{where} {core_name}: above 100 it must be a multiple of 100 (whole "
                    f"GPUs), got {core}"
                )
            return GpuValues(gpus=core // 100, syntax=syntax)  # whole GPUs
        if core < 1:
            raise RequestError(f"{where} {core_name}: must be at least 1, got {core}")
        memory = None if units is None else units * TENCENT_UNIT_MIB
        return GpuValues(gpus=1, memory_mib=memory, cores=core, syntax=syntax)
    # How many vGPUs a GPU has is its node agent's split count (AWS's --vgpu there): one
    # place, so the share is computed per GPU at placement, never from a second setting.
    slices = found[AWS_VGPU]
    if slices < 1:
        raise RequestError(
            f"{where} {AWS_VGPU}: must be at least 1 (vGPUs of one GPU), got {slices}"
        )
    return GpuValues(gpus=1, vgpus=slices, syntax=syntax)


def _kai_values(annotations: Mapping[str, Any], where: str) -> GpuValues | None:
    fraction = annotations.get(KAI_FRACTION)
    memory = annotations.get(KAI_MEMORY)
    if fraction is None and memory is None:
        return None
    if fraction is not None and memory is not None:
        raise RequestError(f"{where}: give the {KAI_FRACTION} or {KAI_MEMORY} annotation, not both")
    if memory is not None:
        return GpuValues(
            gpus=1, memory_mib=_quantity(memory, f"{where} annotation {KAI_MEMORY}"), syntax="kai"
        )
    try:
        share = parse_quantity(fraction)
    except QuantityError:
        share = Fraction(-1)
    if not 0 < share <= 1:
        raise RequestError(
            f"{where} annotation {KAI_FRACTION}: expected a number in (0, 1], got {fraction!r}"
        )
    if share == 1:
        return GpuValues(gpus=1, syntax="kai")
    return GpuValues(gpus=1, memory_percent=max(1, round(share * 100)), syntax="kai")


def container_values(
    container: Mapping[str, Any], where: str, config: RequestConfig = DEFAULT_CONFIG
) -> GpuValues | None:
    """What one container asks for in vgpu's terms (peer syntaxes translated), or None."""
    names = config.names
    own = _read(container, names.own(), where)
    peers = _read(container, PEER_RESOURCES, where) if config.translate_peers else {}
    if own == {names.gpu: 1} and set(peers) == {AWS_VGPU}:
        own = {}  # the webhook's form of an AWS request: the GPU the kubelet hands out, + N
    if own and peers:
        raise RequestError(
            f"{where}: mixes {', '.join(sorted(own))} with {', '.join(sorted(peers))}; use one "
            f"request syntax"
        )
    if own:
        return _own_values(own, names)
    if peers:
        return _peer_values(peers, where, config)
    return None


def _to_request(
    values: GpuValues, name: str, where: str, init: bool, config: RequestConfig
) -> ContainerRequest | None:
    names = config.names
    if values.vgpus:  # AWS: one GPU, its share sized there (modes.py)
        return ContainerRequest(container=name, gpus=1, vgpus=values.vgpus, init=init)
    given_share = (values.memory_mib, values.memory_percent, values.cores)
    gpus = values.gpus if values.gpus is not None else 1
    memory = values.memory_mib or 0
    percent = values.memory_percent or 0
    cores = values.cores if values.cores is not None else config.default_cores
    if gpus < 1:
        if all(v is None for v in given_share):
            return None  # nvidia.com/gpu: 0 alone asks for nothing
        raise RequestError(
            f"{where}: {names.gpu} must be at least 1 when memory or cores are asked"
        )
    if not 0 <= percent <= 100:
        raise RequestError(f"{where} {names.memory_percent}: must be 0-100, got {percent}")
    if not 0 <= cores <= 100:
        raise RequestError(f"{where} {names.cores}: must be 0-100, got {cores}")
    if memory < 0:
        raise RequestError(f"{where} {names.memory}: must not be negative, got {memory}")
    if memory and percent:
        raise RequestError(f"{where}: give {names.memory} or {names.memory_percent}, not both")
    equal_share = False
    if all(v is None for v in given_share):
        if config.count_only_equal_share:
            equal_share, cores = True, 0  # sized per GPU at placement
        else:
            cores = 100  # a bare GPU count asks for whole GPUs
    elif not memory and not percent:
        memory = config.default_memory_mib  # HAMi's defaultMem; 0 = the whole card
    priority = values.priority if values.priority is not None else -1
    if priority not in (-1, 0, 1):
        raise RequestError(f"{where} {names.priority}: must be 0 (high) or 1 (low), got {priority}")
    return ContainerRequest(
        container=name,
        gpus=gpus,
        memory_mib=memory,
        memory_percent=percent,
        cores=cores,
        init=init,
        priority=priority,
        equal_share=equal_share,
    )


def _containers(spec: Mapping[str, Any], key: str) -> list[Mapping[str, Any]]:
    items = spec.get(key) or []
    if not isinstance(items, list) or not all(isinstance(c, Mapping) for c in items):
        raise RequestError(f"spec.{key}: expected a list of containers")
    return items


def _annotations(pod: Mapping[str, Any]) -> Mapping[str, Any]:
    metadata = pod.get("metadata") or {}
    annotations = metadata.get("annotations") if isinstance(metadata, Mapping) else None
    return annotations if isinstance(annotations, Mapping) else {}


def pod_container_values(
    pod: Mapping[str, Any], config: RequestConfig = DEFAULT_CONFIG
) -> list[tuple[str, int, str, GpuValues | None]]:
    """(spec key, index, container name, values) for every container, init containers first.

    KAI's pod annotations apply to the first app container that names no GPU resource.
    """
    spec = pod.get("spec")
    if not isinstance(spec, Mapping):
        raise RequestError("pod has no spec")
    found: list[tuple[str, int, str, GpuValues | None]] = []
    for key in ("initContainers", "containers"):
        for index, container in enumerate(_containers(spec, key)):
            name = container.get("name")
            if not isinstance(name, str) or not name:
                raise RequestError(f"spec.{key}[{index}]: container has no name")
            where = f"spec.{key} {name!r}"
            found.append((key, index, name, container_values(container, where, config)))
    if config.translate_peers:
        kai = _kai_values(_annotations(pod), "pod")
        if kai is not None:
            for position, (key, index, name, values) in enumerate(found):
                if key == "containers" and values is None:
                    found[position] = (key, index, name, kai)
                    break
    return found


def container_requests(
    pod: Mapping[str, Any], config: RequestConfig = DEFAULT_CONFIG
) -> list[ContainerRequest]:
    """The GPU requests of every container and init container of a v1.Pod (JSON form)."""
    requests: list[ContainerRequest] = []
    for key, _, name, values in pod_container_values(pod, config):
        if values is None:
            continue
        init = key == "initContainers"
        request = _to_request(values, name, f"spec.{key} {name!r}", init, config)
        if request is not None:
            requests.append(request)
    return requests


def normalized_limits(request: ContainerRequest, names: ResourceNames) -> dict[str, str]:
    """The request as vgpu's own resource limits (what the admission webhook writes); an AWS
    request keeps its count beside the GPU, as its share depends on the GPU it gets."""
    if request.vgpus:
        return {names.gpu: "1", AWS_VGPU: str(request.vgpus)}
    limits = {names.gpu: str(request.gpus)}
    if request.memory_mib:
        limits[names.memory] = str(request.memory_mib)
    if request.memory_percent:
        limits[names.memory_percent] = str(request.memory_percent)
    if request.cores and not (request.cores == 100 and len(limits) == 1):
        limits[names.cores] = str(request.cores)
    if request.priority >= 0:
        limits[names.priority] = str(request.priority)
    return limits


def asks_for_gpu(pod: Mapping[str, Any], config: RequestConfig = DEFAULT_CONFIG) -> bool:
    return bool(container_requests(pod, config))
