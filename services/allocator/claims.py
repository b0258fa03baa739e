"""NATS edge: the node agents' claim and preferred-GPU requests. Thin over the engine."""

from __future__ import annotations

from prometheus_client import Counter

from services.common import subjects
from services.common.bus import Bus, ReplyError
from services.common.schemas import ClaimReply, ClaimRequest, PreferredReply, PreferredRequest

from .engine import ClaimError, PlacementEngine

CLAIMS = Counter(
    "vgpu_allocator_claims_total", "Container claims from node agents by outcome", ["outcome"]
)
HINTS = Counter(
    "vgpu_allocator_preferred_total",
    "Preferred-allocation requests by whether the allocator had a hint",
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
