"""Least privilege: each component may do exactly what it needs, written out here in full."""

from __future__ import annotations

import pytest

from tests.deploy.manifests import NAMESPACE, OVERLAYS, Obj, render

# (where, API group, resource, verb, resource name or "*"); where is "cluster" or a namespace.
Permission = tuple[str, str, str, str, str]


def _grants(where: str, group: str, resource: str, verbs: str, name: str = "*") -> set[Permission]:
    return {(where, group, resource, verb, name) for verb in verbs.split()}


EXPECTED: dict[str, set[Permission]] = {
    # Binds pods (it is the binding extender), annotates them with its decision, lists and
    # watches them to rebuild state and release slices, records scheduling failures.
    "vgpu-allocator": _grants("cluster", "", "pods", "get list watch patch")
    | _grants("cluster", "", "nodes", "get list watch")
    | _grants("cluster", "", "pods/binding", "create")
    | _grants("cluster", "", "events", "create"),
    # Labels its node and reads its vgpu.io/mode labels; which pod holds which device it
    # learns from the kubelet, not the API.
    "vgpu-node-agent": _grants("cluster", "", "nodes", "get patch"),
    # Its own Secret only (create cannot name an object that does not exist yet).
    "vgpu-nats-credentials": _grants(NAMESPACE, "", "secrets", "create")
    | _grants(NAMESPACE, "", "secrets", "get patch", "vgpu-nats-credentials"),
    "vgpu-webhook-certgen": _grants(NAMESPACE, "", "secrets", "create")
    | _grants(NAMESPACE, "", "secrets", "get", "vgpu-allocator-webhook-tls")
    | _grants(NAMESPACE, "", "secrets", "get update", "vgpu-extender-tls")
    | _grants(NAMESPACE, "", "secrets", "get update", "vgpu-scheduler-extender-client")
    | _grants(
        "cluster",
        "admissionregistration.k8s.io",
        "mutatingwebhookconfigurations",
        "get update patch",
        "vgpu-allocator",
    ),
    # Besides the built-in scheduler roles: its own leader-election Lease.
    "vgpu-scheduler": _grants(NAMESPACE, "coordination.k8s.io", "leases", "create")
    | _grants(NAMESPACE, "coordination.k8s.io", "leases", "get update", "vgpu-scheduler"),
}
# Roles that Kubernetes itself defines. The allocator and the metrics service check their
# readers' bearer tokens (TokenReview, SubjectAccessReview): system:auth-delegator.
AUTH_DELEGATOR = ("cluster", "ClusterRole", "system:auth-delegator")
BUILT_IN = {
    "vgpu-scheduler": {
        ("cluster", "ClusterRole", "system:kube-scheduler"),
        ("cluster", "ClusterRole", "system:volume-scheduler"),
        ("kube-system", "Role", "extension-apiserver-authentication-reader"),
    },
    "vgpu-allocator": {AUTH_DELEGATOR},
    "vgpu-metrics": {AUTH_DELEGATOR},
}
# NATS reads nothing from the API: no bindings, no token.
NO_ACCESS = {"vgpu-nats"}


def _rules(role: Obj) -> list[Obj]:
    return role.get("rules") or []


def _permissions(docs: list[Obj]) -> tuple[dict[str, set[Permission]], dict[str, set]]:
    roles = {(d["kind"], d["metadata"].get("namespace", "cluster"), d["metadata"]["name"]): d
             for d in docs if d["kind"] in ("Role", "ClusterRole")}  # fmt: skip
    granted: dict[str, set[Permission]] = {}
    built_in: dict[str, set] = {}
    for binding in (d for d in docs if d["kind"] in ("RoleBinding", "ClusterRoleBinding")):
        where = binding["metadata"].get("namespace", "cluster")
        ref = binding["roleRef"]
        role_key = (ref["kind"], where if ref["kind"] == "Role" else "cluster", ref["name"])
        for subject in binding["subjects"]:
            assert subject["kind"] == "ServiceAccount" and subject["namespace"] == NAMESPACE
            account = subject["name"]
            role = roles.get(role_key)
            if role is None:
                built_in.setdefault(account, set()).add((where, ref["kind"], ref["name"]))
                continue
            for rule in _rules(role):
                for path in rule.get("nonResourceURLs", []):
                    for verb in rule["verbs"]:
                        granted.setdefault(account, set()).add(("cluster", "url", path, verb, "*"))
                for group in rule.get("apiGroups", []):
                    for resource in rule["resources"]:
                        for verb in rule["verbs"]:
                            for name in rule.get("resourceNames", ["*"]):
                                granted.setdefault(account, set()).add(
                                    (where, group, resource, verb, name)
                                )
    return granted, built_in


@pytest.mark.parametrize("overlay", ["", "overlays/dev"], ids=["production", "dev"])
def test_each_component_gets_exactly_its_permissions(overlay: str) -> None:
    granted, built_in = _permissions(render(overlay))
    assert granted == EXPECTED
    assert built_in == BUILT_IN
    assert not NO_ACCESS & (set(granted) | set(built_in))


def test_cert_manager_overlay_drops_the_certgen_permissions() -> None:
    granted, _ = _permissions(render("overlays/cert-manager"))
    assert "vgpu-webhook-certgen" not in granted


@pytest.mark.parametrize("overlay", OVERLAYS, ids=lambda o: o or "default")
def test_no_wildcards_or_dangerous_verbs(overlay: str) -> None:
    for role in (d for d in render(overlay) if d["kind"] in ("Role", "ClusterRole")):
        for rule in _rules(role):
            for field in ("apiGroups", "resources", "verbs", "nonResourceURLs"):
                assert "*" not in rule.get(field, []), (role["metadata"]["name"], rule)
            assert not {"escalate", "bind", "impersonate"} & set(rule["verbs"])
            if "secrets" in rule.get("resources", []):
                assert not {"list", "watch"} & set(rule["verbs"]), "secrets are never listed"


def test_prometheus_scrapes_with_a_token_that_may_only_get_metrics() -> None:
    docs = render("overlays/servicemonitor")
    granted, built_in = _permissions(docs)
    assert granted["vgpu-prometheus"] == {("cluster", "url", "/metrics", "get", "*")}
    assert "vgpu-prometheus" not in built_in
    secret = next(d for d in docs if d["kind"] == "Secret"
                  and d["metadata"]["name"] == "vgpu-prometheus-token")  # fmt: skip
    assert secret["type"] == "kubernetes.io/service-account-token"
    assert secret["metadata"]["annotations"]["kubernetes.io/service-account.name"] == (
        "vgpu-prometheus")  # fmt: skip
    endpoints = [
        e
        for d in docs
        if d["kind"] in ("ServiceMonitor", "PodMonitor")
        for e in d["spec"].get("endpoints", d["spec"].get("podMetricsEndpoints", []))
    ]
    assert len(endpoints) == 2
    for endpoint in endpoints:
        assert endpoint["authorization"] == {
            "type": "Bearer",
            "credentials": {"name": "vgpu-prometheus-token", "key": "token"},
        }


@pytest.mark.parametrize("overlay", OVERLAYS, ids=lambda o: o or "default")
def test_read_apis_check_tokens_and_probes_need_none(overlay: str) -> None:
    """Both readers' services ask the API server (VGPU_READ_AUTH=kubernetes); liveness and
    readiness use the open endpoints, never the gated /metrics."""
    for name in ("vgpu-allocator", "vgpu-metrics"):
        deployment = next(d for d in render(overlay) if d["kind"] == "Deployment"
                          and d["metadata"]["name"] == name)  # fmt: skip
        [container] = deployment["spec"]["template"]["spec"]["containers"][:1]
        env = {e["name"]: e.get("value") for e in container["env"]}
        assert env["VGPU_READ_AUTH"] == "kubernetes", name
        for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
            if probe in container:
                assert container[probe]["httpGet"]["path"] in ("/livez", "/healthz"), (name, probe)
