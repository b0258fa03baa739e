"""NATS edge: the node agents' claim and preferred-GPU requests. Thin over the engine."""

from __future__ import annotations

from prometheus_client import Counter

from services.common import subjects
from services.common.bus import Bus, ReplyError
from services.common.schemas import (
    ClaimReply,
    ClaimRequest,
    MigPrepareReply,
    MigPrepareRequest,
    PreferredReply,
    PreferredRequest,
)

from .engine import ClaimError, PlacementEngine

CLAIMS = Counter(
    "vgpu_allocator_claims_total", "Container claims from node agents by outcome", ["outcome"]
)
HINTS = Counter(
    "vgpu_allocator_preferred_total",
    "Preferred-allocation requests by whether the allocator had a hint",
    ["outcome"],
)
MIG_PLACEMENTS = Counter(
    "vgpu_allocator_mig_placements_total",
    "Dynamic MIG placements asked by node agents in Allocate, by outcome",
    ["outcome"],
)


class ClaimHandlers:
    def __init__(self, engine: PlacementEngine) -> None:
        self._engine = engine

    async def serve(self, bus: Bus) -> None:
        await bus.serve(
            subjects.ALLOC_CLAIM, ClaimRequest, self.claim, queue=subjects.ALLOCATOR_QUEUE
        )
        await bus.serve(
            subjects.ALLOC_PREFERRED,
            PreferredRequest,
            self.preferred,
            queue=subjects.ALLOCATOR_QUEUE,
        )
        await bus.serve(
            subjects.ALLOC_MIG, MigPrepareRequest, self.mig, queue=subjects.ALLOCATOR_QUEUE
        )

    async def mig(self, request: MigPrepareRequest) -> MigPrepareReply:
        try:
            allocation, container, piece = self._engine.mig_placement(
                request.node, request.gpu_uuid, request.key
            )
        except ClaimError as exc:
            MIG_PLACEMENTS.labels(outcome="none").inc()
            raise ReplyError(str(exc)) from exc
        MIG_PLACEMENTS.labels(outcome="placed").inc()
        return MigPrepareReply(
            profile=piece.mig_profile,
            start=piece.mig_start,
            pod_uid=allocation.uid,
            namespace=allocation.namespace,
            pod=allocation.name,
            container=container,
        )

    async def claim(self, request: ClaimRequest) -> ClaimReply:
        try:
            allocation, container = await self._engine.claim(request)
        except ClaimError as exc:
            CLAIMS.labels(outcome="refused").inc()
            raise ReplyError(str(exc)) from exc
        CLAIMS.labels(outcome="claimed").inc()
        return ClaimReply(
            pod_uid=allocation.uid,
            allocation=container,
            traceparent=allocation.traceparent,
            namespace=allocation.namespace,
            pod=allocation.name,
        )

    async def preferred(self, request: PreferredRequest) -> PreferredReply:
        if request.size < 1:
            raise ReplyError(f"preferred allocation size must be at least 1, got {request.size}")
        slices = self._engine.preferred_slices(
            request.node, list(request.available_gpus), request.size
        )
        HINTS.labels(outcome="hint" if slices else "none").inc()
        return PreferredReply(gpu_uuids=[piece.uuid for piece in slices], slices=slices)
