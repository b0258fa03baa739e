"""Bookings match the API server: the leader's view of every pod, and what it frees.

``PodWatchHandler`` takes the leader's list+watch of every pod (kube.py in a cluster, the
local API server's memory under `vgpu up`):

- at each list it rebuilds bookings from pod annotations the store lacks, and frees the
  bookings of pods that ended or are no longer listed;
- a pod deleted or ended (Succeeded, Failed) frees its slices at once;
- ``reconcile`` (every ``reconcile_interval_s``) frees, within a bounded time, what no event
  says: a booking whose pod was never bound (a bind that failed after the decision was
  stored, a scheduler that gave up) once it is older than ``release_unbound_after_s``; a
  booking whose pod is bound to another node; a booking whose pod the API server does not
  have (a delete the watch missed), after the same grace.

Every release is logged with pod, node, GPUs and reason and counted in
``vgpu_allocator_reconciled_releases_total{reason}``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping
from typing import Any

from prometheus_client import Counter

from .core import pod_ref
from .engine import ALLOCATION_ANNOTATION, PlacementEngine, decode_annotation

log = logging.getLogger("vgpu.allocator")

TERMINAL_PHASES = ("Succeeded", "Failed")
RECONCILE_SLICE = 250  # bookings checked between two turns of the event loop (about 0.3 ms)

RELEASES = Counter(
    "vgpu_allocator_reconciled_releases_total",
    "Bookings freed because the API server says their pod is gone, ended, never bound or "
    "bound elsewhere",
    ["reason"],
)


def finished(pod: Mapping[str, Any]) -> bool:
    return (pod.get("status") or {}).get("phase") in TERMINAL_PHASES


def _node_of(pod: Mapping[str, Any]) -> str:
    return str((pod.get("spec") or {}).get("nodeName") or "")


class PodWatchHandler:
    """Rebuild from pod annotations at list time; free what the pods say is free."""

    def __init__(
        self,
        engine: PlacementEngine,
        release_unbound_after_s: float = 60.0,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._engine = engine
        self._grace_s = release_unbound_after_s
        self._clock = clock
        self._nodes: dict[str, str] = {}  # uid -> node name ("" = not bound yet), live pods
        self.listed = False

    async def _release(self, uid: str, reason: str) -> bool:
        released = await self._engine.release(uid, reason) is not None
        if released:
            RELEASES.labels(reason=reason.split(":")[0].replace(" ", "_")).inc()
        return released

    async def on_list(self, pods: list[dict[str, Any]], listed_at: float) -> None:
        engine = self._engine
        nodes: dict[str, str] = {}
        adopted = released = 0
        for pod in pods:
            ref = pod_ref(pod)
            if finished(pod):
                released += await self._release(ref.uid, "ended")
                continue
            node = _node_of(pod)
            nodes[ref.uid] = node
            annotation = ((pod.get("metadata") or {}).get("annotations") or {}).get(
                ALLOCATION_ANNOTATION
            )
            if annotation and node and ref.uid not in engine.ledger:
                inits = {c.get("name") for c in (pod.get("spec") or {}).get("initContainers") or []}
                try:
                    allocation = decode_annotation(annotation, pod, node, inits)
                except Exception as exc:
                    log.warning(
                        "unreadable allocation annotation",
                        extra={"pod": str(ref), "node": node, "error": str(exc)},
                    )
                    continue
                adopted += await engine.adopt(allocation)
        self._nodes = nodes
        self.listed = True
        for allocation in engine.allocations():
            if allocation.uid not in nodes and allocation.bound_at < listed_at:
                released += await self._release(allocation.uid, "deleted")
        log.info(
            "rebuilt from the cluster's pods",
            extra={"pods": len(pods), "adopted": adopted, "released": released},
        )

    async def on_change(self, kind: str, pod: dict[str, Any]) -> None:
        uid = pod_ref(pod).uid
        if kind == "DELETED" or finished(pod):
            self._nodes.pop(uid, None)
            await self._release(uid, "deleted" if kind == "DELETED" else "ended")
            return
        node = self._nodes[uid] = _node_of(pod)
        booked = self._engine.ledger.get(uid)
        if booked is not None and node and node != booked.node:
            await self._release(uid, f"bound elsewhere: the pod runs on {node}")

    async def reconcile(self) -> int:
        """Free bookings no pod stands behind any more; how many were freed."""
        if not self.listed:
            return 0
        now = self._clock()
        released = 0
        ledger = self._engine.ledger
        for count, allocation in enumerate(self._engine.allocations(), 1):
            if count % RECONCILE_SLICE == 0:
                # Tens of thousands of bookings take tens of milliseconds: let the extender's
                # calls in between (the loop would otherwise hold a filter that long).
                await asyncio.sleep(0)
            if ledger.get(allocation.uid) is not allocation:
                continue  # released or booked anew while this loop waited: not this booking
            node = self._nodes.get(allocation.uid)
            old = now - allocation.bound_at > self._grace_s
            if node is None and old:
                released += await self._release(allocation.uid, "gone: the API server has no pod")
            elif node == "" and old:
                released += await self._release(
                    allocation.uid, f"never bound: unbound {now - allocation.bound_at:.0f}s"
                )
            elif node and node != allocation.node:
                released += await self._release(
                    allocation.uid, f"bound elsewhere: the pod runs on {node}"
                )
        return released
