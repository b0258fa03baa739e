"""After Allocate: find out which container got the devices, claim its decision, write limits.

Allocate carries no pod identity. Rather than guess by request size or lock the node, the
agent waits for the kubelet to record the device IDs (it does so right after Allocate
returns), reads the owner from the PodResources API, and asks the allocator for that
container's decision by name. Plain init containers, which PodResources never lists, are
found in the kubelet's device checkpoint instead and claimed by pod UID. Every Allocate
resolves on its own, so bursts onto one node proceed in parallel.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Protocol

import grpc
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeoutError
from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import Link, Status, StatusCode
from prometheus_client import Counter, Histogram

from services.common import subjects
from services.common.bus import Bus, BusError
from services.common.schemas import ClaimReply, ClaimRequest
from services.common.tasks import stop_task
from services.common.tracing import context_from_traceparent, tracer
from services.nodeagent import limits_file
from services.nodeagent.container_files import config_dir
from services.nodeagent.containers import ResolvedContainer
from services.nodeagent.grant import ContainerGrant
from services.nodeagent.kubelet_checkpoint import CheckpointEntry, CheckpointError
from services.nodeagent.limits_file import LimitsError
from services.nodeagent.podresources import ContainerRef

log = logging.getLogger("vgpu.nodeagent")
_tracer = tracer("vgpu.nodeagent")

RESOLVE_FAILURES = Counter(
    "vgpu_nodeagent_resolve_failures_total",
    "Allocations whose container could not be resolved, claimed or given a limit file",
    ["node", "reason"],
)
LIMIT_FILES_WRITTEN = Counter(
    "vgpu_nodeagent_limit_files_written_total", "Limit files written", ["node"]
)
RESOLVE_SECONDS = Histogram(
    "vgpu_nodeagent_resolve_seconds",
    "Time from the end of Allocate to the limit file being written",
    ["node"],
    buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
)


# A checkpoint-only owner is taken once this long has passed since its Allocate: when an app
# container takes over a plain init container's IDs (same count), the kubelet allocates it
# right after the init container (one Allocate call later), and the two then share the
# directory, which PodResources attributes to the app container, as before.
CHECKPOINT_SETTLE_S = 0.5
PODRESOURCES = "podresources"
CHECKPOINT = "checkpoint"


class ContainerLocator(Protocol):
    async def holders(self, resource_name: str, device_ids: set[str]) -> list[ContainerRef]: ...


class CheckpointLocator(Protocol):
    """The kubelet's device checkpoint (kubelet_checkpoint.KubeletCheckpoint)."""

    def holders(self, resource: str, device_ids: set[str]) -> list[CheckpointEntry]: ...


@dataclass(frozen=True)
class Owner:
    """Whose the devices are: by name from PodResources, or by pod UID from the checkpoint
    (namespace and pod empty until the allocator's reply names them)."""

    namespace: str
    pod: str
    container: str
    pod_uid: str = ""
    source: str = PODRESOURCES

    def __str__(self) -> str:
        if self.namespace or self.pod:
            return f"{self.namespace}/{self.pod}/{self.container}"
        return f"pod uid {self.pod_uid} container {self.container}"


@dataclass(frozen=True)
class AllocateCall:
    """One container's Allocate, as the plugin served it."""

    grant: ContainerGrant
    started_ns: int
    ended_ns: int
    caller_traceparent: str = ""  # from gRPC metadata; a real kubelet sends none


class ResolveFailure(Exception):
    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason  # metric label


def _is_transport_error(exc: BusError) -> bool:
    return isinstance(exc.__cause__, NoRespondersError | NatsTimeoutError | TimeoutError)


class AllocationResolver:
    def __init__(
        self,
        *,
        node_name: str,
        resource_name: str,
        bus: Bus,
        locator: ContainerLocator,
        resolve_timeout_s: float,
        poll_interval_s: float = 0.05,
        on_resolved: Callable[[ResolvedContainer], Awaitable[object]] | None = None,
        context_overhead: Callable[[tuple[str, ...]], int] | None = None,
        spill_limit_mib: int | None = None,
        checkpoint: CheckpointLocator | None = None,
        checkpoint_settle_s: float = CHECKPOINT_SETTLE_S,
        record: Callable[[ResolvedContainer], None] | None = None,
    ) -> None:
        self._node = node_name
        self._record = record
        self._context_overhead = context_overhead  # GPU uuids -> MiB charged per context
        # Virtual device memory (memory scaling > 1): its host bound; None = off.
        self._spill_limit_mib = spill_limit_mib
        self._resource = resource_name
        self._bus = bus
        self._locator = locator
        self._timeout_s = resolve_timeout_s
        self._poll_s = poll_interval_s
        self._on_resolved = on_resolved
        self._checkpoint = checkpoint
        self._settle_s = checkpoint_settle_s
        self._checkpoint_problem = ""  # last checkpoint error logged, to log each once
        self._tasks: set[asyncio.Task[None]] = set()

    def track(self, call: AllocateCall) -> None:
        task = asyncio.create_task(self._resolve(call), name=f"resolve-{call.grant.key}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def stop(self) -> None:
        tasks = list(self._tasks)
        fields = {"node": self._node}
        await asyncio.gather(
            *(stop_task(task, "allocation resolve", fields=fields) for task in tasks),
            return_exceptions=True,
        )

    async def _resolve(self, call: AllocateCall) -> None:
        grant = call.grant
        fields = {"node": self._node, "device_ids": list(grant.device_ids), "key": grant.key}
        try:
            deadline = time.monotonic() + self._timeout_s
            owner = await self._find_container(grant, deadline)
            fields["container"] = str(owner)
            fields["source"] = owner.source
            reply = await self._claim(owner, call, deadline)
            if reply.allocation is None:
                raise ResolveFailure("claim_refused", f"allocator sent no decision for {owner}")
            owner = _named(owner, reply)
            fields["container"] = str(owner)
            limits = limits_file.limits_from_decision(
                owner.namespace, owner.pod, owner.container, grant.gpu_uuids, reply.allocation
            )
            if self._context_overhead is not None:
                overhead = self._context_overhead(grant.gpu_uuids)
                limits = dataclasses.replace(limits, context_overhead_mib=overhead)
            if self._spill_limit_mib is not None:
                limits = limits_file.with_virtual_memory(limits, self._spill_limit_mib)
            resolved = ResolvedContainer(grant.key, grant.host_dir, limits, reply.pod_uid)
            write_started = time.time_ns()
            if self._record is not None:
                self._record(resolved)  # the agent's own state: what a restart rebuilds from
            if self._on_resolved is not None:
                # The relay socket exists before the limit file: a hook that found its
                # limits can always connect.
                await self._on_resolved(resolved)
            path = limits_file.write(config_dir(grant.host_dir), limits)
            write_ended = time.time_ns()
        except ResolveFailure as exc:
            self._fail(call, exc.reason, str(exc), fields)
            return
        except LimitsError as exc:
            self._fail(call, "bad_decision", str(exc), fields)
            return
        except OSError as exc:
            self._fail(call, "write_failed", f"cannot write limit file: {exc}", fields)
            return
        LIMIT_FILES_WRITTEN.labels(node=self._node).inc()
        RESOLVE_SECONDS.labels(node=self._node).observe((write_ended - call.ended_ns) / 1e9)
        log.info("limit file written", extra={**fields, "path": str(path)})
        self._emit_spans(call, owner, reply.traceparent, (write_started, write_ended))

    async def _find_container(self, grant: ContainerGrant, deadline: float) -> Owner:
        """PodResources first; the kubelet checkpoint for what it does not list."""
        wanted = set(grant.device_ids)
        settled_at = time.monotonic() + self._settle_s
        last_error = ""
        while True:
            try:
                holders = await self._locator.holders(self._resource, wanted)
                last_error = ""
            except grpc.aio.AioRpcError as exc:
                holders = []
                last_error = f"; PodResources API: {exc.code().name}: {exc.details()}"
            if holders:
                if len(holders) > 1:
                    log.warning(
                        "several containers hold the same device IDs; taking the first",
                        extra={
                            "node": self._node,
                            "holders": [str(h) for h in holders],
                            "device_ids": sorted(wanted),
                        },
                    )
                ref = holders[0]
                return Owner(ref.namespace, ref.pod, ref.container)
            now = time.monotonic()
            owner = self._checkpoint_owner(wanted, now >= settled_at, now >= deadline)
            if owner is not None:
                return owner
            if now >= deadline:
                problem = f"; {self._checkpoint_problem}" if self._checkpoint_problem else ""
                raise ResolveFailure(
                    "no_container",
                    f"no container holds devices {sorted(wanted)} after "
                    f"{self._timeout_s}s{last_error}{problem}",
                )
            await asyncio.sleep(self._poll_s)

    def _checkpoint_owner(self, wanted: set[str], settled: bool, last_try: bool) -> Owner | None:
        """The one checkpoint entry holding exactly `wanted`, once settled. Several entries
        (an app container took over an init container's IDs) are left to PodResources, which
        lists the app container; only on the last try is the first of them taken."""
        if self._checkpoint is None:
            return None
        try:
            entries = self._checkpoint.holders(self._resource, wanted)
        except CheckpointError as exc:
            if str(exc) != self._checkpoint_problem:
                self._checkpoint_problem = str(exc)
                log.warning(
                    "cannot use the kubelet checkpoint: " + str(exc), extra={"node": self._node}
                )
            return None
        self._checkpoint_problem = ""
        ready = last_try or (len(entries) == 1 and settled)
        if not entries or not ready:
            return None
        if len(entries) > 1:
            log.warning(
                "several containers hold the same device IDs in the kubelet checkpoint; "
                "taking the first",
                extra={
                    "node": self._node,
                    "holders": [f"{e.pod_uid}/{e.container}" for e in entries],
                    "device_ids": sorted(wanted),
                },
            )
        entry = entries[0]
        return Owner("", "", entry.container, pod_uid=entry.pod_uid, source=CHECKPOINT)

    async def _claim(self, ref: Owner, call: AllocateCall, deadline: float) -> ClaimReply:
        request = ClaimRequest(
            node=self._node,
            namespace=ref.namespace,
            pod=ref.pod,
            container=ref.container,
            device_ids=list(call.grant.device_ids),
            gpu_uuids=list(call.grant.gpu_uuids),
            pod_uid=ref.pod_uid,
        )
        # Carry the caller's trace (if any) into the NATS headers of the claim.
        context = context_from_traceparent(call.caller_traceparent)
        while True:
            timeout = max(0.1, min(5.0, deadline - time.monotonic()))
            try:
                token = otel_context.attach(context)
                try:
                    return await self._bus.request(
                        subjects.ALLOC_CLAIM, request, ClaimReply, timeout=timeout
                    )
                finally:
                    otel_context.detach(token)
            except BusError as exc:
                # Unreachable allocator: retry (claims are idempotent); a refusal is final.
                if not _is_transport_error(exc):
                    raise ResolveFailure(
                        "claim_refused", f"claim for {ref} refused: {exc}"
                    ) from exc
                if time.monotonic() >= deadline:
                    raise ResolveFailure(
                        "allocator_unreachable", f"claim for {ref} not answered: {exc}"
                    ) from exc
                await asyncio.sleep(0.2)

    def _fail(
        self, call: AllocateCall, reason: str, message: str, fields: dict[str, object]
    ) -> None:
        RESOLVE_FAILURES.labels(node=self._node, reason=reason).inc()
        log.error(
            "no limit file for allocated devices: " + message,
            extra={**fields, "reason": reason},
        )
        span = _tracer.start_span(
            "device-plugin Allocate",
            context=context_from_traceparent(call.caller_traceparent),
            start_time=call.started_ns,
            attributes={"vgpu.node": self._node, "vgpu.device_ids": list(call.grant.device_ids)},
        )
        span.set_status(Status(StatusCode.ERROR, message))
        span.end(end_time=call.ended_ns)

    def _emit_spans(
        self, call: AllocateCall, ref: Owner, traceparent: str, write: tuple[int, int]
    ) -> None:
        """Join the pod's trace (from the claim reply) with the real Allocate times."""
        links = []
        caller = trace.get_current_span(
            context_from_traceparent(call.caller_traceparent)
        ).get_span_context()
        if caller.is_valid:
            links.append(Link(caller))
        span = _tracer.start_span(
            "device-plugin Allocate",
            context=context_from_traceparent(traceparent),
            kind=trace.SpanKind.SERVER,
            start_time=call.started_ns,
            links=links,
            attributes={
                "vgpu.node": self._node,
                "vgpu.device_ids": list(call.grant.device_ids),
                "vgpu.gpu_uuids": list(call.grant.gpu_uuids),
                "k8s.namespace.name": ref.namespace,
                "k8s.pod.name": ref.pod,
                "k8s.container.name": ref.container,
                "k8s.pod.uid": ref.pod_uid,
                "vgpu.resolved_by": ref.source,
            },
        )
        child = _tracer.start_span(
            "write limits",
            context=trace.set_span_in_context(span),
            start_time=write[0],
            attributes={"vgpu.container_dir": str(call.grant.host_dir)},
        )
        child.end(end_time=write[1])
        span.end(end_time=call.ended_ns)


def _named(owner: Owner, reply: ClaimReply) -> Owner:
    """Complete the owner from the allocator's reply: a checkpoint owner learns its namespace
    and pod name, a PodResources owner its pod UID."""
    if not (owner.namespace or owner.pod):
        if not (reply.namespace and reply.pod):
            raise ResolveFailure(
                "claim_refused",
                f"the allocator's reply for {owner} names no pod (an allocator that cannot "
                "claim by pod uid?)",
            )
        owner = dataclasses.replace(owner, namespace=reply.namespace, pod=reply.pod)
    return dataclasses.replace(owner, pod_uid=owner.pod_uid or reply.pod_uid)
