"""Every NATS subject vgpu uses, in one place, under one version prefix.

Events and state flow on plain subjects (publish/subscribe); decisions flow back by
request/reply on the ``alloc`` subjects, which the allocator serves in a queue group.
"""

from __future__ import annotations

import re

PREFIX = "vgpu.v1"

# Node agent -> everyone: a node's GPUs (on start, on change, and as a heartbeat).
INVENTORY_ALL = f"{PREFIX}.inventory.*"
# Node agent -> everyone: utilisation of a node's GPUs.
USAGE_ALL = f"{PREFIX}.usage.*"
# Node agent -> everyone: per-container usage relayed from the hooks.
CONTAINER_USAGE_ALL = f"{PREFIX}.container-usage.*"
# Node agent -> everyone: a container broke its slice or its hook's figures were forged
# (SliceViolation), as the agent measured from outside the container.
VIOLATIONS_ALL = f"{PREFIX}.violation.*"
# Allocator -> everyone: a pod's slices were bound, claimed or released.
ALLOC_EVENTS_ALL = f"{PREFIX}.alloc.events.*"
# Allocator -> everyone: pods waiting for GPUs and why (PendingPod), one scope per allocator.
ALLOC_PENDING_ALL = f"{PREFIX}.alloc.pending.*"
CLUSTER_SCOPE = "cluster"

# Request/reply served by the allocator.
ALLOC_CLAIM = f"{PREFIX}.alloc.claim"
ALLOC_PREFERRED = f"{PREFIX}.alloc.preferred"
# Allocator replica -> its peers: "did your filter pass this pod for this node?" (bind on a
# replica other than the one that filtered); answered only by a replica that did.
ALLOC_FILTER_PASS = f"{PREFIX}.alloc.filter-pass"
# Node agent -> allocator, in Allocate: the MIG placement awaiting on a dynamic-MIG GPU.
ALLOC_MIG = f"{PREFIX}.alloc.mig"

# Queue group that the allocator's replicas share for request/reply subjects.
ALLOCATOR_QUEUE = "vgpu-allocator"

_TOKEN = re.compile(r"^[A-Za-z0-9_-][A-Za-z0-9_.:-]*$")


def node_token(node: str) -> str:
    """A node name as a single subject token (Kubernetes names may contain dots)."""
    if not node or not _TOKEN.match(node):
        raise ValueError(f"node name {node!r} cannot be used in a NATS subject")
    return node.replace(".", "_")


def inventory(node: str) -> str:
    return f"{PREFIX}.inventory.{node_token(node)}"


def usage(node: str) -> str:
    return f"{PREFIX}.usage.{node_token(node)}"


def container_usage(node: str) -> str:
    return f"{PREFIX}.container-usage.{node_token(node)}"


def violations(node: str) -> str:
    return f"{PREFIX}.violation.{node_token(node)}"


def alloc_events(node: str) -> str:
    return f"{PREFIX}.alloc.events.{node_token(node)}"


def alloc_pending(scope: str = CLUSTER_SCOPE) -> str:
    """Pending pods of a scope: "cluster" for a cluster-wide allocator, or a node's name."""
    return f"{PREFIX}.alloc.pending.{node_token(scope)}"
