"""`vgpu submit`: a Pod manifest through the scheduler simulator and the node's kubelet.

The path is the production one: the API server creates the pod (running the mutating
webhook, which rewrites peer syntaxes into vgpu's names), filter/prioritize/bind on the
allocator's extender, then the kubelet simulator admits the pod as the API server holds it
(bound and annotated) through the node agent's device plugin (real gRPC), and the node agent
writes each container's limit file once it knows whose devices those are. A container that
asked for GPUs and got none fails the submission: placed without its GPU is not placed.
"""

from __future__ import annotations

import asyncio
import datetime
import time
import uuid
from pathlib import Path
from typing import Any

import aiohttp
import msgspec
import yaml

from services.cli.object_names import name_problem, namespace_problem
from services.cli.state import UpState
from services.cli.supervisor import Backoff
from services.common.quantity import QuantityError
from services.common.resources import MANAGED_RESOURCES, RequestError, pod_container_values
from services.common.tracing import inject_headers, tracer
from services.simulators.kubelet_records import AdmitResult
from services.simulators.scheduler import ScheduleResult, SchedulerSimulator

_tracer = tracer("vgpu.submit")
CONTAINER_DIR = "/var/run/vgpu"
EXTENDER_WEIGHT = 60  # the prioritize entry's weight in deploy/k8s/base/scheduler/config.yaml
SCHEDULER_NAME = "vgpu-scheduler"  # the profile of deploy/k8s/base/scheduler/config.yaml
# kube-scheduler sends a pod whose cycle failed with an error (the extender down, the store
# unreachable: not a pod that fits nowhere) round again after a backoff, 1 s doubling to 10 s
# (podInitialBackoffSeconds, podMaxBackoffSeconds); `vgpu submit` does too, for this long.
SCHEDULING_BACKOFF = Backoff(initial_s=1.0, max_s=10.0)
RETRY_ERRORS_FOR_S = 30.0


class ManifestError(ValueError):
    pass


class ApiRefused(RuntimeError):
    """The API server refused to create the pod; `reason` is its Status reason."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


class ContainerOutcome(msgspec.Struct, kw_only=True):
    name: str
    init: bool
    gpus: list[str]
    envs: dict[str, str]
    mounts: list[dict[str, Any]]
    limits: dict[str, str]  # the limit file the hook will read ({} if it never appeared)
    hooked: bool = True  # False: a time-slicing/mps/exclusive GPU, no hook nor limit file


class SubmitOutcome(msgspec.Struct, kw_only=True):
    namespace: str
    name: str
    uid: str
    node: str | None = None
    reason: str = ""  # why the pod was not scheduled or admitted
    containers: list[ContainerOutcome] = []


def load_pod(path: Path) -> dict[str, Any]:
    """The Pod in a manifest file, completed as the API server would (namespace, uid)."""
    try:
        text = path.read_bytes().decode("utf-8")
    except OSError as exc:
        raise ManifestError(f"cannot read {path}: {exc.strerror}") from exc
    except UnicodeDecodeError as exc:  # a binary file, or another encoding
        raise ManifestError(
            f"{path} is not a YAML or JSON manifest: byte {exc.start} is not UTF-8 text"
        ) from exc
    try:
        documents = [d for d in yaml.safe_load_all(text) if d is not None]
    except yaml.YAMLError as exc:
        raise ManifestError(f"{path} is not valid YAML: {exc}") from exc
    pods = [d for d in documents if isinstance(d, dict) and d.get("kind") == "Pod"]
    if len(pods) != 1:
        raise ManifestError(f"{path}: expected exactly one object of kind Pod, found {len(pods)}")
    pod = pods[0]
    metadata = pod.setdefault("metadata", {})
    if not isinstance(metadata, dict) or not metadata.get("name"):
        raise ManifestError(f"{path}: the Pod has no metadata.name")
    metadata.setdefault("namespace", "default")
    problem = name_problem(metadata["name"]) or namespace_problem(metadata["namespace"])
    if problem:
        raise ManifestError(f"{path}: {problem}")
    metadata["uid"] = str(uuid.uuid4())
    now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    metadata["creationTimestamp"] = now
    return pod


def read_limits(host_dir: Path) -> dict[str, str]:
    path = host_dir / "limits"
    if not path.is_file():
        return {}
    pairs = (line.split("=", 1) for line in path.read_text().splitlines() if "=" in line)
    return {key: value for key, value in pairs if not key.startswith("#")}


async def _wait_for_limits(host_dir: Path, timeout_s: float) -> dict[str, str]:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while True:
        limits = read_limits(host_dir)
        if limits or asyncio.get_running_loop().time() >= deadline:
            return limits
        await asyncio.sleep(0.05)


class CreateRefused(RuntimeError):
    """The API server refused the pod (an admission webhook denied it, or it is invalid)."""


def _status_reason(body: str) -> str:
    try:
        status = msgspec.json.decode(body)
    except msgspec.DecodeError:
        return "Failure"
    reason = status.get("reason") if isinstance(status, dict) else None
    return reason if isinstance(reason, str) and reason else "Failure"


def _status_message(body: str) -> str:
    try:
        status = msgspec.json.decode(body)
    except msgspec.DecodeError:
        return body[:500]
    message = status.get("message") if isinstance(status, dict) else None
    return message if isinstance(message, str) and message else body[:500]


async def _create(api_url: str, pod: dict[str, Any]) -> dict[str, Any]:
    """The pod as the API server stored it (after mutating admission)."""
    namespace = pod["metadata"]["namespace"]
    async with (
        aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session,
        session.post(
            f"{api_url}/api/v1/namespaces/{namespace}/pods", json=pod, headers=inject_headers()
        ) as response,
    ):
        body = await response.text()
        if response.status != 201:
            if response.status == 409:  # AlreadyExists: the user's to fix, worded as kubectl
                raise ApiRefused(_status_reason(body), _status_message(body))
            raise CreateRefused(
                f"the API server refused the pod ({response.status}): {_status_message(body)}"
            )
    created: dict[str, Any] = msgspec.json.decode(body)
    return created


async def _read(api_url: str, namespace: str, name: str) -> dict[str, Any]:
    """The pod as the API server holds it now (bound and annotated), as the kubelet sees it."""
    async with (
        aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as session,
        session.get(f"{api_url}/api/v1/namespaces/{namespace}/pods/{name}") as response,
    ):
        body = await response.text()
        if response.status != 200:
            raise RuntimeError(f"reading pod {namespace}/{name} failed ({response.status}): "
                               f"{_status_message(body)}")  # fmt: skip
    pod: dict[str, Any] = msgspec.json.decode(body)
    return pod


def gpu_containers(pod: dict[str, Any]) -> dict[tuple[bool, str], str]:
    """(init?, name) -> how the container asks for GPUs, for containers that do (any syntax)."""
    try:
        found = pod_container_values(pod)
    except (RequestError, QuantityError):
        return {}  # the extender has already refused such a pod, naming the field
    asking: dict[tuple[bool, str], str] = {}
    for key, _, name, values in found:
        if values is not None and values.gpus != 0:
            asking[(key == "initContainers", name)] = values.syntax
    return asking


def without_gpu(pod: dict[str, Any], containers: list[ContainerOutcome]) -> str:
    """Why the admitted pod is a failure: a container that asked for GPUs got none ("" if not)."""
    asking = gpu_containers(pod)
    missing = [c for c in containers if (c.init, c.name) in asking and not c.gpus]
    if not missing:
        return ""
    names = ", ".join(f"{c.name!r} ({asking[(c.init, c.name)]} syntax)" for c in missing)
    return (
        f"container(s) {names} asked for GPUs but the kubelet allocated none: their request "
        f"never became a device-plugin resource (was the admission webhook bypassed?)"
    )


async def _admit(kubelet_url: str, pod: dict[str, Any]) -> AdmitResult:
    timeout = aiohttp.ClientTimeout(total=30)
    async with (
        aiohttp.ClientSession(timeout=timeout) as session,
        session.post(f"{kubelet_url}/pods", json=pod, headers=inject_headers()) as response,
    ):
        body = await response.read()
        if response.status != 200:
            raise RuntimeError(f"kubelet simulator answered {response.status}: {body[:300]!r}")
    return msgspec.json.decode(body, type=AdmitResult)


async def _container_outcome(admitted: Any, limits_timeout_s: float) -> ContainerOutcome:
    mounts = [msgspec.to_builtins(m) for m in admitted.mounts]
    own_dir = next((m["host_path"] for m in mounts if m["container_path"] == CONTAINER_DIR), "")
    limits = await _wait_for_limits(Path(own_dir), limits_timeout_s) if own_dir else {}
    visible = admitted.envs.get("NVIDIA_VISIBLE_DEVICES", "")
    return ContainerOutcome(
        name=admitted.name,
        init=admitted.init,
        gpus=[g for g in visible.split(",") if g],
        # What the container's processes see: the device plugin's variables, then the
        # container's own env (downward API resolved), which the runtime appends after them.
        envs={**admitted.envs, **admitted.container_env},
        mounts=mounts,
        limits=limits,
        hooked=bool(own_dir),
    )


async def _schedule_with_backoff(
    scheduler: SchedulerSimulator, pod: dict[str, Any], state: UpState, retry_for_s: float
) -> ScheduleResult:
    """The scheduling cycle, run again after kube-scheduler's backoff while it fails with an
    error, for up to `retry_for_s` (a pod that fits nowhere is not retried: it waits, as in a
    cluster). A pod the API server holds as bound meanwhile counts as placed there."""
    metadata = pod["metadata"]
    deadline = time.monotonic() + retry_for_s
    delay: float | None = None
    while True:
        result = await scheduler.schedule(pod, sorted(state.kubelets))
        delay = SCHEDULING_BACKOFF.after(delay, up_for_s=0.0)
        if result.node is not None or not result.error or time.monotonic() + delay > deadline:
            return result
        await asyncio.sleep(delay)
        pod = await _read(state.api_url, metadata["namespace"], metadata["name"])
        bound = (pod.get("spec") or {}).get("nodeName")
        if bound:
            return ScheduleResult(node=bound)


async def submit(
    pod: dict[str, Any],
    state: UpState,
    limits_timeout_s: float = 10.0,
    retry_for_s: float = RETRY_ERRORS_FOR_S,
) -> SubmitOutcome:
    metadata = pod["metadata"]
    outcome = SubmitOutcome(
        namespace=metadata["namespace"], name=metadata["name"], uid=metadata["uid"]
    )
    with _tracer.start_as_current_span(f"vgpu submit {outcome.namespace}/{outcome.name}"):
        try:
            pod = await _create(state.api_url, pod)
        except CreateRefused as exc:
            outcome.reason = str(exc)
            return outcome
        # As deploy/k8s configures kube-scheduler: GPU pods of the vgpu-scheduler profile
        # filtered and bound by the extender, every pod scored by it, the others bound
        # through the API server (a pod left with another scheduler by a bypassed webhook
        # is placed as the default scheduler would: without the extender's bind).
        scheduler = SchedulerSimulator(
            state.extender_url,
            weight=EXTENDER_WEIGHT,
            managed_resources=frozenset(MANAGED_RESOURCES),
            api_url=state.api_url,
            scheduler_name=SCHEDULER_NAME,
            ssl_context=state.extender_ssl(),
        )
        try:
            result = await _schedule_with_backoff(scheduler, pod, state, retry_for_s)
        finally:
            await scheduler.close()
        if result.node is None:
            outcome.reason = result.describe()
            return outcome
        outcome.node = result.node
        pod = await _read(state.api_url, outcome.namespace, outcome.name)
        admitted = await _admit(state.kubelets[result.node], pod)
        if admitted.error:
            outcome.reason = f"admission failed on {result.node}: {admitted.error}"
            return outcome
        outcome.containers = [
            await _container_outcome(container, limits_timeout_s)
            for container in admitted.containers
        ]
        outcome.reason = without_gpu(pod, outcome.containers)
    return outcome


def render(outcome: SubmitOutcome) -> str:
    """The outcome for people: placement, then each container's environment and mounts."""
    title = f"pod {outcome.namespace}/{outcome.name}"
    created = "the API server refused" not in outcome.reason
    remove = f"`vgpu delete {outcome.name} -n {outcome.namespace}` removes it"
    if outcome.node is None:
        stays = f"\n  the pod stays pending; {remove}" if created else ""
        return f"{title}: not placed\n  reason: {outcome.reason}{stays}"
    if outcome.reason:
        return f"{title}: failed on node {outcome.node}\n  reason: {outcome.reason}\n  {remove}"
    lines = [f"{title}: placed on node {outcome.node}"]
    for container in outcome.containers:
        kind = "init container" if container.init else "container"
        if not container.gpus:
            lines.append(f"  {kind} {container.name}: no GPU")
            continue
        lines.append(f"  {kind} {container.name}: GPUs {', '.join(container.gpus)}")
        lines.append("    env:")
        lines.extend(f"      {key}={value}" for key, value in sorted(container.envs.items()))
        lines.append("    mounts:")
        for mount in container.mounts:
            mode = "ro" if mount.get("read_only") else "rw"
            lines.append(f"      {mount['host_path']} -> {mount['container_path']} ({mode})")
        if not container.hooked:
            lines.append("    limits: no hook (the GPU's sharing mode holds it: docs/modes.md)")
        elif container.limits:
            lines.append("    limits (read by the hook):")
            lines.extend(f"      {key}={value}" for key, value in container.limits.items())
        else:
            lines.append(
                "    limits: not written yet (the node agent could not resolve this container)"
            )
    return "\n".join(lines)
