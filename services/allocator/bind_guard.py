"""Bind trusts nothing it did not decide (issue 20).

A bind is a request to place a pod on a node; the extender answers it only for a pod that
* this allocator's filter passed for that very node, within ``window_s`` (kube-scheduler binds
  right after its cycle; anything older, or a node the filter did not pass, was decided by
  someone else);
* the cluster (the API server, read now, not the body of some earlier call) shows with the
  UID given, with vgpu's scheduler name, still pending: not bound, not finished, not deleting.
Every refusal names its reason and is counted by it (``BindRefused.reason``).

Replicas: kube-scheduler's calls go through the allocator's Service, so filter and bind of
one pod may reach two replicas. A replica that has no record asks the others over NATS
(``vgpu.v1.alloc.filter-pass``, answered only by a replica that holds a record), so a bind
is never refused because the filter ran next door.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

from .core import PodRef, pod_ref
from .engine import BindError

# What the pass records may hold, oldest dropped first: pods, and node names over all pods
# (a filter over 5,000 nodes may pass all of them; ~80 bytes a name, so ~80 MB at most).
PASS_CAPACITY = 65536
NODE_ENTRIES_CAPACITY = 1_000_000
FINISHED_PHASES = ("Succeeded", "Failed")

AskPeers = Callable[[str, str], Awaitable[float | None]]  # (uid, node) -> age of the pass


class BindRefused(BindError):
    """A bind the guard refused; ``reason`` is the metric label."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message, reason=reason)


class FilterPasses:
    """For each pod, the nodes its last filter passed and when (monotonic clock). Records
    older than `keep_s` are dropped as new ones come (oldest first: they are kept in time
    order), and so are the oldest beyond the capacities."""

    def __init__(
        self,
        keep_s: float = 300.0,
        capacity: int = PASS_CAPACITY,
        node_entries: int = NODE_ENTRIES_CAPACITY,
    ) -> None:
        self._keep_s = keep_s
        self._capacity = capacity
        self._node_capacity = node_entries
        self._entries = 0
        self._passes: OrderedDict[str, tuple[frozenset[str], float]] = OrderedDict()

    def record(self, uid: str, nodes: list[str], now: float | None = None) -> None:
        if not uid or not nodes:
            return
        now = time.monotonic() if now is None else now
        self.forget(uid)
        passed = frozenset(nodes)
        self._passes[uid] = (passed, now)
        self._entries += len(passed)
        while self._passes and (
            len(self._passes) > self._capacity
            or self._entries > self._node_capacity
            or now - next(iter(self._passes.values()))[1] > self._keep_s
        ):
            _, (dropped, _) = self._passes.popitem(last=False)
            self._entries -= len(dropped)

    def age(self, uid: str, node: str, now: float | None = None) -> float | None:
        """Seconds since the filter passed `node` for the pod; None if its last filter did not."""
        entry = self._passes.get(uid)
        if entry is None or node not in entry[0]:
            return None
        return (time.monotonic() if now is None else now) - entry[1]

    def forget(self, uid: str) -> None:
        entry = self._passes.pop(uid, None)
        if entry is not None:
            self._entries -= len(entry[0])

    def __len__(self) -> int:
        return len(self._passes)


@dataclass
class BindGuard:
    scheduler_name: str
    window_s: float = 300.0
    passes: FilterPasses | None = None
    ask_peers: AskPeers | None = None

    def __post_init__(self) -> None:
        if self.passes is None:
            self.passes = FilterPasses(keep_s=self.window_s)

    def filtered(self, pod: Mapping[str, Any], passed: list[str]) -> None:
        assert self.passes is not None
        self.passes.record(pod_ref(pod).uid, passed)

    async def check_filtered(self, ref: PodRef, node: str) -> None:
        assert self.passes is not None
        age = self.passes.age(ref.uid, node)
        if age is None and self.ask_peers is not None:
            age = await self.ask_peers(ref.uid, node)
        if age is None:
            raise BindRefused(
                "not_filtered",
                f"pod {ref} (uid {ref.uid}) was not passed by this extender's filter for node "
                f"{node!r}: only a bind that follows kube-scheduler's filter is accepted",
            )
        if age > self.window_s:
            raise BindRefused(
                "filter_expired",
                f"pod {ref}: the filter passed node {node!r} {age:.1f}s ago, more than the "
                f"bind window of {self.window_s:g}s",
            )

    def check_pod(
        self, ref: PodRef, pod: Mapping[str, Any] | None, node: str, recorded_on: str | None
    ) -> None:
        """The cluster's pod may be bound by us to `node` now (or already is, by us)."""
        if pod is None:
            raise BindRefused("unknown_pod", f"pod {ref} does not exist in the cluster")
        uid = pod_ref(pod).uid
        if uid != ref.uid:
            raise BindRefused(
                "uid_mismatch",
                f"pod {ref} has uid {uid or '(none)'}, not {ref.uid}: it is another pod",
            )
        spec = pod.get("spec") or {}
        scheduler = spec.get("schedulerName") or "default-scheduler"
        if scheduler != self.scheduler_name:
            raise BindRefused(
                "other_scheduler",
                f"pod {ref} is scheduled by {scheduler!r}, not {self.scheduler_name!r}",
            )
        metadata = pod.get("metadata") or {}
        phase = (pod.get("status") or {}).get("phase") or "Pending"
        if phase in FINISHED_PHASES or metadata.get("deletionTimestamp"):
            state = "being deleted" if metadata.get("deletionTimestamp") else phase
            raise BindRefused("not_pending", f"pod {ref} is {state}, not pending")
        bound_to = spec.get("nodeName")
        if bound_to and not (bound_to == node and recorded_on == node):
            raise BindRefused("already_bound", f"pod {ref} is already bound to node {bound_to!r}")
