"""Who may connect to which vgpu port, read off the rendered NetworkPolicies (kustomize's
production overlay and the Helm chart, whose defaults render the same objects).

The ports are found the way traffic finds them: the extender through the URL in
kube-scheduler's configuration and the allocator's Service, the webhook through its
clientConfig, NATS clients through the URLs in their environment. Sources are real pod labels
from the rendering (the scheduler, each vgpu component) and made-up ones (a tenant's pod,
Prometheus, an API server address).
"""

from __future__ import annotations

from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml

from tests.deploy.chart import render_chart
from tests.deploy.manifests import (
    NAMESPACE,
    WORKLOAD_KINDS,
    Obj,
    find,
    find_generated,
    name_of,
    pod_spec,
    render,
)
from tests.deploy.netpol import Source, allowed, policies_for, selects

API_SERVER = Source(ip="172.18.0.2")  # a control-plane node's address
TENANT = Source.pod("team-a", {"app": "training"}, ip="10.244.7.12")
PROMETHEUS = Source.pod("monitoring", {"app.kubernetes.io/name": "prometheus"}, ip="10.244.2.9")
DASHBOARD_USER = Source.pod("ops", {"app": "toolbox"}, ip="10.244.4.4",
                            namespace_labels={"vgpu.io/dashboard": "allowed"})  # fmt: skip


def _pod_source(workload: Obj) -> Source:
    return Source.pod(NAMESPACE, workload["spec"]["template"]["metadata"]["labels"])


def _labels(workload: Obj) -> dict[str, str]:
    return workload["spec"]["template"]["metadata"]["labels"]


def _workloads(docs: list[Obj]) -> list[Obj]:
    return [d for d in docs if d["kind"] in WORKLOAD_KINDS]


def _service_target(docs: list[Obj], service_name: str, port: int) -> str:
    service = find(docs, "Service", service_name)
    return next(p["targetPort"] for p in service["spec"]["ports"] if p["port"] == port)


def extender_port(docs: list[Obj]) -> str:
    """The allocator's container port that kube-scheduler's extender URL leads to."""
    config = yaml.safe_load(
        find_generated(docs, "ConfigMap", "vgpu-scheduler-config-")["data"]["config.yaml"]
    )
    ports = set()
    for extender in config["extenders"]:
        url = urlsplit(extender["urlPrefix"])
        assert url.hostname == f"vgpu-allocator.{NAMESPACE}.svc"
        ports.add(_service_target(docs, "vgpu-allocator", url.port or 443))
    (port,) = ports
    return port


def webhook_port(docs: list[Obj]) -> str:
    (webhook,) = find(docs, "MutatingWebhookConfiguration", "vgpu-allocator")["webhooks"]
    service = webhook["clientConfig"]["service"]
    return _service_target(docs, service["name"], service["port"])


RENDERINGS = {
    "kustomize": lambda: render(""),
    "chart": lambda: render_chart(),
}
renderings = pytest.mark.parametrize("rendering", RENDERINGS)


@renderings
def test_only_the_scheduler_reaches_the_extender(rendering: str) -> None:
    docs = RENDERINGS[rendering]()
    allocator = find(docs, "Deployment", "vgpu-allocator")
    port = extender_port(docs)
    scheduler = _pod_source(find(docs, "Deployment", "vgpu-scheduler"))
    assert allowed(docs, allocator, port, scheduler), (
        f"vgpu-scheduler cannot reach the extender (port {port}): let its pods in on that port "
        "in components/network-policies and the chart's networkpolicies.yaml"
    )
    others = [_pod_source(w) for w in _workloads(docs) if w["metadata"]["name"] != "vgpu-scheduler"]
    for source in [*others, TENANT, API_SERVER]:
        assert not allowed(docs, allocator, port, source), f"{source} reaches the extender"
    # Prometheus scrapes every allocator's /metrics on a port of its own, and only that one.
    monitor_port = find(render("overlays/servicemonitor"), "PodMonitor", "vgpu-allocator")
    metrics_port = monitor_port["spec"]["podMetricsEndpoints"][0]["port"]
    assert metrics_port != port
    assert allowed(docs, allocator, metrics_port, PROMETHEUS)
    assert not allowed(docs, allocator, port, PROMETHEUS)
    assert not allowed(docs, allocator, metrics_port, TENANT)


@renderings
def test_the_api_server_reaches_the_webhook(rendering: str) -> None:
    docs = RENDERINGS[rendering]()
    allocator = find(docs, "Deployment", "vgpu-allocator")
    assert allowed(docs, allocator, webhook_port(docs), API_SERVER)


def test_the_webhook_can_be_narrowed_to_the_api_server_addresses() -> None:
    docs = render_chart({"networkPolicy": {"apiServerCIDRs": ["172.18.0.0/28", "fd00:1::/64"]}})
    allocator = find(docs, "Deployment", "vgpu-allocator")
    port = webhook_port(docs)
    assert allowed(docs, allocator, port, API_SERVER)
    assert allowed(docs, allocator, port, Source(ip="fd00:1::5"))
    for source in (TENANT, PROMETHEUS, Source(ip="172.18.0.20"), Source(ip="fd00:2::5")):
        assert not allowed(docs, allocator, port, source), source
    assert not allowed(docs, allocator, extender_port(docs), API_SERVER)


@renderings
def test_metrics_from_monitoring_and_dashboard_users_only(rendering: str) -> None:
    docs = RENDERINGS[rendering]()
    metrics = find(docs, "Deployment", "vgpu-metrics")
    (port,) = {p["targetPort"] for p in find(docs, "Service", "vgpu-metrics")["spec"]["ports"]}
    assert allowed(docs, metrics, port, PROMETHEUS)
    assert allowed(docs, metrics, port, DASHBOARD_USER)
    for source in [TENANT, API_SERVER, *(_pod_source(w) for w in _workloads(docs))]:
        assert not allowed(docs, metrics, port, source), source


def test_monitoring_namespaces_and_dashboard_users_are_values() -> None:
    values: dict[str, Any] = {"networkPolicy": {
        "monitoringNamespaces": ["observability"],
        "dashboardFrom": [{"podSelector": {"matchLabels": {"app": "toolbox"}},
                           "namespaceSelector": {"matchLabels": {"team": "sre"}}}],
    }}  # fmt: skip
    docs = render_chart(values)
    metrics = find(docs, "Deployment", "vgpu-metrics")
    allocator = find(docs, "Deployment", "vgpu-allocator")
    prometheus = Source.pod("observability", PROMETHEUS.pod_labels)
    sre = Source.pod("sre-tools", {"app": "toolbox"}, namespace_labels={"team": "sre"})
    assert allowed(docs, metrics, "http", prometheus) and allowed(
        docs, allocator, "http", prometheus
    )
    assert allowed(docs, metrics, "http", sre)
    for source in (
        PROMETHEUS,
        DASHBOARD_USER,
        Source.pod("sre-tools", {"app": "other"}, namespace_labels={"team": "sre"}),
    ):
        assert not allowed(docs, metrics, "http", source), source


@renderings
def test_nats_takes_clients_from_vgpu_pods_only(rendering: str) -> None:
    docs = RENDERINGS[rendering]()
    nats = find(docs, "StatefulSet", "vgpu-nats")
    clients = [
        w
        for w in _workloads(docs)
        if any(
            e["name"] == "VGPU_NATS_URL"
            for c in pod_spec(w)["containers"]
            for e in c.get("env", [])
        )
    ]
    assert {w["metadata"]["name"] for w in clients} == {
        "vgpu-allocator", "vgpu-node-agent", "vgpu-metrics"}  # fmt: skip
    for client in clients:
        assert allowed(docs, nats, "client", _pod_source(client))
        assert not allowed(docs, nats, "cluster", _pod_source(client))
    assert allowed(docs, nats, "cluster", _pod_source(nats))
    for source in (TENANT, PROMETHEUS, API_SERVER):
        assert not allowed(docs, nats, "client", source), source
    # Its monitoring port lists connections and subscriptions: Prometheus, not tenants.
    assert allowed(docs, nats, "monitor", PROMETHEUS)
    assert not allowed(docs, nats, "monitor", TENANT)


@renderings
def test_every_vgpu_pod_is_isolated_and_every_policy_selects_real_pods_and_ports(
    rendering: str,
) -> None:
    docs = RENDERINGS[rendering]()
    pods = [d for d in docs if d["kind"] in (*WORKLOAD_KINDS, "Job")]
    for pod in pods:
        labels = pod["spec"]["template"]["metadata"]["labels"]
        assert policies_for(docs, NAMESPACE, labels), f"{name_of(pod)} takes any connection"
    for policy in (d for d in docs if d["kind"] == "NetworkPolicy"):
        selector = policy["spec"]["podSelector"]
        targets = [
            p for p in pods if selects(selector, p["spec"]["template"]["metadata"]["labels"])
        ]
        assert targets, f"{name_of(policy)} selects no pod"
        if selector:  # a named workload: its ports must exist there
            ports = {p["name"] for t in targets for c in pod_spec(t)["containers"]
                     for p in c.get("ports", [])}  # fmt: skip
            for rule in policy["spec"].get("ingress", []):
                for entry in rule.get("ports", []):
                    assert entry["port"] in ports, f"{name_of(policy)}: no port {entry['port']}"
                for peer in rule.get("from", []):
                    if "podSelector" in peer and "namespaceSelector" not in peer:
                        matched = [p for p in pods if selects(peer["podSelector"], _labels(p))]
                        assert matched, f"{name_of(policy)}: peer {peer} matches no pod"


def test_the_evaluator_follows_kubernetes_semantics() -> None:
    """Without a policy anything goes; one policy isolates; rules are ORed, a peer's two
    selectors ANDed; a podSelector alone means the policy's namespace."""
    workload = {"kind": "Deployment", "metadata": {"name": "w", "namespace": "ns"},
                "spec": {"template": {"metadata": {"labels": {"app": "w"}}, "spec": {
                    "containers": [{"name": "c", "ports": [{"name": "http",
                                                           "containerPort": 80}]}]}}}}  # fmt: skip
    here = Source.pod("ns", {"role": "client"})
    there = Source.pod("other", {"role": "client"}, namespace_labels={"env": "prod"})
    assert allowed([], workload, "http", TENANT)
    policy = {"kind": "NetworkPolicy", "metadata": {"name": "p", "namespace": "ns"},
              "spec": {"podSelector": {"matchLabels": {"app": "w"}}, "ingress": []}}  # fmt: skip
    assert not allowed([policy], workload, "http", here)
    policy["spec"]["ingress"] = [{"from": [{"podSelector": {"matchLabels": {"role": "client"}}}]}]
    assert allowed([policy], workload, "http", here)
    assert not allowed([policy], workload, "http", there)
    policy["spec"]["ingress"] = [{"from": [{
        "namespaceSelector": {"matchExpressions": [{"key": "env", "operator": "In",
                                                    "values": ["prod"]}]},
        "podSelector": {"matchLabels": {"role": "client"}}}], "ports": [{"port": 80}]}]  # fmt: skip
    assert allowed([policy], workload, "http", there)
    assert not allowed([policy], workload, "http", here)
    policy["spec"]["ingress"][0]["ports"] = [{"port": "metrics"}]
    assert not allowed([policy], workload, "http", there)
