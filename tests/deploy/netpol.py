"""Kubernetes NetworkPolicy semantics (ingress), to ask rendered manifests who may connect where.

A pod is isolated for ingress once any policy of its namespace selects it with policy type
Ingress; then a connection is allowed only if some rule of some such policy admits both the
port and the source (networking.k8s.io/v1). Sources are pods (namespace and pod labels, an IP)
or addresses outside the cluster (an IP only). ipBlock is taken to match a pod's IP too, as
Calico does: the cautious reading (what a CNI may let through), not the narrow one.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass, field
from typing import Any

Obj = dict[str, Any]


@dataclass(frozen=True)
class Source:
    ip: str
    namespace: str | None = None  # None: outside the cluster
    namespace_labels: dict[str, str] = field(default_factory=dict)
    pod_labels: dict[str, str] = field(default_factory=dict)

    @classmethod
    def pod(cls, namespace: str, labels: dict[str, str], ip: str = "10.244.3.7",
            namespace_labels: dict[str, str] | None = None) -> Source:  # fmt: skip
        ns_labels = {"kubernetes.io/metadata.name": namespace, **(namespace_labels or {})}
        return cls(ip=ip, namespace=namespace, namespace_labels=ns_labels, pod_labels=labels)


def selects(selector: Obj | None, labels: dict[str, str]) -> bool:
    """A LabelSelector against labels; {} selects everything."""
    selector = selector or {}
    for key, value in (selector.get("matchLabels") or {}).items():
        if labels.get(key) != value:
            return False
    for expr in selector.get("matchExpressions") or []:
        key, op, values = expr["key"], expr["operator"], expr.get("values") or []
        present = key in labels
        if op == "In" and not (present and labels[key] in values):
            return False
        if op == "NotIn" and present and labels[key] in values:
            return False
        if op == "Exists" and not present:
            return False
        if op == "DoesNotExist" and present:
            return False
        if op not in ("In", "NotIn", "Exists", "DoesNotExist"):
            raise ValueError(f"unknown selector operator {op}")
    return True


def _peer_admits(peer: Obj, source: Source, policy_namespace: str) -> bool:
    if "ipBlock" in peer:
        block = peer["ipBlock"]
        address = ipaddress.ip_address(source.ip)
        network = ipaddress.ip_network(block["cidr"])
        if address.version != network.version or address not in network:
            return False
        return not any(address in ipaddress.ip_network(e) for e in block.get("except", [])
                       if ipaddress.ip_network(e).version == address.version)  # fmt: skip
    if source.namespace is None:
        return False  # selectors match pods only
    if "namespaceSelector" in peer:
        if not selects(peer["namespaceSelector"], source.namespace_labels):
            return False
    elif source.namespace != policy_namespace:
        return False  # a podSelector alone means the policy's own namespace
    return selects(peer.get("podSelector"), source.pod_labels)


def _port_admits(rule_ports: list[Obj] | None, port_name: str, port_number: int) -> bool:
    if not rule_ports:
        return True
    for entry in rule_ports:
        if entry.get("protocol", "TCP") != "TCP":
            continue
        port = entry.get("port")
        if port is None or port == port_name:
            return True
        if isinstance(port, int) and port <= port_number <= entry.get("endPort", port):
            return True
    return False


def policies_for(docs: list[Obj], namespace: str, pod_labels: dict[str, str]) -> list[Obj]:
    """The ingress policies that isolate a pod with these labels in this namespace."""
    return [d for d in docs if d["kind"] == "NetworkPolicy"
            and d["metadata"].get("namespace") == namespace
            and "Ingress" in d["spec"].get("policyTypes", ["Ingress"])
            and selects(d["spec"]["podSelector"], pod_labels)]  # fmt: skip


def allowed(docs: list[Obj], workload: Obj, port_name: str, source: Source) -> bool:
    """May `source` open a TCP connection to the named container port of the workload's pods?"""
    namespace = workload["metadata"]["namespace"]
    labels = workload["spec"]["template"]["metadata"]["labels"]
    number = next(p["containerPort"] for c in workload["spec"]["template"]["spec"]["containers"]
                  for p in c.get("ports", []) if p["name"] == port_name)  # fmt: skip
    policies = policies_for(docs, namespace, labels)
    if not policies:
        return True
    return any(
        _port_admits(rule.get("ports"), port_name, number)
        and (not rule.get("from") or any(_peer_admits(p, source, namespace) for p in rule["from"]))
        for policy in policies
        for rule in policy["spec"].get("ingress") or []
    )
