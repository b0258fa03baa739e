"""What every pod bound to a node holds of its CPU, memory and pod slots, GPU or not.

kube-scheduler's NodeResourcesFit counts every pod on a node; so does this, keyed by pod uid
so that two sources never count a pod twice:

- ``observe`` / ``end``: the cluster says so (the pod watch: bound, not finished; or gone).
  Authoritative: it replaces whatever was known of that uid.
- ``reserve`` / ``unreserve``: a bind of this allocator recorded the pod before the watch
  reports it (the ledger calls these). A reservation never overrides an observation, and
  unreserving leaves an observed pod alone (it is still bound in the cluster).

The totals go into ClusterState per node (``charge_host``); a node heard of later gets them
when it first reports (``reapply``).
"""

from __future__ import annotations

from typing import NamedTuple

from .cluster import ClusterState


class Held(NamedTuple):
    node: str
    cpu_milli: int
    memory_mib: int
    observed: bool  # True: from the cluster (watch); False: reserved by a bind


class HostUsage:
    def __init__(self, cluster: ClusterState) -> None:
        self._cluster = cluster
        self._pods: dict[str, Held] = {}
        self._by_node: dict[str, set[str]] = {}

    def observe(self, uid: str, node: str, cpu_milli: int, memory_mib: int) -> None:
        """The cluster has this pod bound to `node` holding this much."""
        held = Held(node, cpu_milli, memory_mib, True)
        if self._pods.get(uid) != held:
            self._set(uid, held)

    def end(self, uid: str) -> bool:
        """The pod finished or was deleted; True when it was counted."""
        return self._drop(uid)

    def reserve(self, uid: str, node: str, cpu_milli: int, memory_mib: int) -> None:
        """This allocator bound the pod: count it until the cluster says more."""
        known = self._pods.get(uid)
        reserved = Held(node, cpu_milli, memory_mib, False)
        if known is None or (not known.observed and known != reserved):
            self._set(uid, reserved)

    def unreserve(self, uid: str) -> None:
        known = self._pods.get(uid)
        if known is not None and not known.observed:
            self._drop(uid)

    def observed_uids(self) -> set[str]:
        return {uid for uid, held in self._pods.items() if held.observed}

    def held(self, uid: str) -> Held | None:
        return self._pods.get(uid)

    def on_node(self, node: str) -> int:
        return len(self._by_node.get(node, ()))

    def reapply(self, node: str) -> None:
        """Charge the node with every pod on it (after ClusterState.reset_usage)."""
        for uid in self._by_node.get(node, ()):
            held = self._pods[uid]
            self._cluster.charge_host(node, held.cpu_milli, held.memory_mib, 1)

    def __len__(self) -> int:
        return len(self._pods)

    def _set(self, uid: str, held: Held) -> None:
        self._drop(uid)
        self._pods[uid] = held
        self._by_node.setdefault(held.node, set()).add(uid)
        self._cluster.charge_host(held.node, held.cpu_milli, held.memory_mib, 1)

    def _drop(self, uid: str) -> bool:
        held = self._pods.pop(uid, None)
        if held is None:
            return False
        on_node = self._by_node.get(held.node)
        if on_node is not None:
            on_node.discard(uid)
            if not on_node:
                del self._by_node[held.node]
        self._cluster.charge_host(held.node, -held.cpu_milli, -held.memory_mib, -1)
        return True
