"""The Helm chart installs what kustomize installs.

Rendered by Helm's own engine (tests/deploy/chart.py) and by kubectl's kustomize, the two
must give the same objects with the same fields: the defaults against `deploy/k8s` (the
production overlay), and the values of each option against the overlay or component that
offers it. The usual rules (schema, locked-down containers, RBAC) are checked on the kustomize
side by test_manifests.py and test_rbac.py, so they hold for the chart too.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path
from typing import Any

import click
import pytest
import yaml

from services.allocator.settings import AllocatorSettings
from services.cli.main import main as vgpu
from services.common.config import load_settings
from services.nodeagent.settings import NodeAgentSettings, load_node_agent_settings
from tests.deploy.chart import (
    CHART,
    differences,
    lint_chart,
    normalized,
    notes,
    parse_set,
    render_chart,
    render_packaged,
    templates_used,
)
from tests.deploy.manifests import (
    K8S,
    REPO,
    env_of,
    find,
    find_generated,
    kubectl,
    pod_spec,
    render,
)
from tests.deploy.netpol import selects

DEV_VALUES = yaml.safe_load((CHART / "values-dev.yaml").read_text())

# Each kustomize overlay, and the chart values that ask for the same thing.
OVERLAY_VALUES: dict[str, dict[str, Any]] = {
    "": {},
    "overlays/production": {},
    "overlays/dev": DEV_VALUES,
    "overlays/existing-nats": {"nats": {"enabled": False}},
    "overlays/servicemonitor": {"serviceMonitor": {"enabled": True}},
    "overlays/cert-manager": {"scheduler": {"certManager": {"enabled": True}}},
}
# Components that no overlay uses: production plus the component, against these values.
COMPONENT_VALUES: dict[str, dict[str, Any]] = {
    "peer-node-labels": {"devicePlugin": {"peerNodeLabels": True}},
    "dynamic-mig": {"devicePlugin": {"migDynamic": "all"}},
    "mps": {"devicePlugin": {"sharingMode": "mps"}},
}


def _compare(kustomized: list[dict[str, Any]], charted: list[dict[str, Any]]) -> list[str]:
    left = normalized(kustomized, from_helm=False)
    right = normalized(charted, from_helm=True)
    found = [f"{k}: only in kustomize" for k in sorted(set(left) - set(right))]
    found += [f"{k}: only in the chart" for k in sorted(set(right) - set(left))]
    for name in sorted(set(left) & set(right)):
        found += differences(left[name], right[name], str(name))
    return found


@pytest.mark.parametrize("overlay", OVERLAY_VALUES, ids=lambda o: o or "default")
def test_chart_renders_what_the_overlay_installs(overlay: str) -> None:
    problems = _compare(render(overlay), render_chart(OVERLAY_VALUES[overlay]))
    assert not problems, "\n".join(problems)


def _with_component(component: str, work: Path) -> list[dict[str, Any]]:
    """Production plus one component, through a throwaway overlay."""
    (work / "kustomization.yaml").write_text(
        yaml.safe_dump({
            "apiVersion": "kustomize.config.k8s.io/v1beta1",
            "kind": "Kustomization",
            # kustomize takes relative paths only
            "resources": [os.path.relpath(K8S / "overlays/production", work)],
            "components": [os.path.relpath(K8S / "components" / component, work)],
        })
    )  # fmt: skip
    out = subprocess.run([kubectl(), "kustomize", str(work)], capture_output=True, text=True,
                         timeout=120, check=True)  # fmt: skip
    return [d for d in yaml.safe_load_all(out.stdout) if d is not None]


@pytest.mark.parametrize("component", COMPONENT_VALUES)
def test_chart_renders_what_the_component_adds(component: str, work_dir: Path) -> None:
    kustomized = _with_component(component, work_dir)
    problems = _compare(kustomized, render_chart(COMPONENT_VALUES[component]))
    assert not problems, "\n".join(problems)


def test_the_comparison_notices_a_difference() -> None:
    """One changed field, one extra object: both are reported, with where they are."""
    problems = _compare(render(""), render_chart({"scheduler": {"replicas": 3}}))
    assert problems == [
        "('Deployment', 'vgpu-system', 'vgpu-scheduler').spec.replicas: kustomize 2, chart 3"
    ]
    problems = _compare(render(""), render_chart({"serviceMonitor": {"enabled": True}}))
    assert sorted(problems) == [
        "('ClusterRoleBinding', '', 'vgpu-prometheus-metrics-reader'): only in the chart",
        "('PodMonitor', 'vgpu-system', 'vgpu-allocator'): only in the chart",
        "('Secret', 'vgpu-system', 'vgpu-prometheus-token'): only in the chart",
        "('ServiceAccount', 'vgpu-system', 'vgpu-prometheus'): only in the chart",
        "('ServiceMonitor', 'vgpu-system', 'vgpu-metrics'): only in the chart",
    ]


def test_chart_lints_clean() -> None:
    assert lint_chart() == []
    assert lint_chart(DEV_VALUES) == []


def test_every_template_renders_for_some_values() -> None:
    """No template is dead: each one renders objects for the defaults or an option."""
    used: set[str] = set()
    for values in [*OVERLAY_VALUES.values(), *COMPONENT_VALUES.values(), *OPTION_VALUES.values()]:
        used |= templates_used(values)
    assert used == {p.name for p in (CHART / "templates").glob("*.yaml")}


HAMI_VALUES: dict[str, Any] = {
    "namespace": {"name": "gpu-sharing"},
    "global": {"imageRegistry": "registry.example.com"},
    "resourceName": "example.com/vgpu",
    "resourceMem": "example.com/vgpu-memory",
    "resourceMemPercentage": "example.com/vgpu-memory-percentage",
    "resourceCores": "example.com/vgpu-cores",
    "resourcePriority": "example.com/vgpu-priority",
    "schedulerName": "hami-scheduler",
    "scheduler": {
        "defaultMem": 4096,
        "defaultCores": 30,
        "defaultSchedulerPolicy": {
            "nodeSchedulerPolicy": "binpack",
            "gpuSchedulerPolicy": "spread",
        },
        "admissionWebhook": {"whitelistNamespaces": ["batch-system"]},
        "kubeScheduler": {"image": {"registry": "registry.cn-hangzhou.aliyuncs.com",
                                    "repository": "google_containers/kube-scheduler",
                                    "tag": ""}},
    },
    "devicePlugin": {"deviceSplitCount": 4, "deviceListStrategy": "cdi-cri",
                     "deviceMemoryScaling": 1.5, "deviceCoreScaling": 2,
                     "failOnInitError": False, "nvidiaNodeSelector": {"gpu": "on"}},
}  # fmt: skip


def agent_flags(container: dict[str, Any]) -> dict[str, Any]:
    """The settings the node agent's args set, as `vgpu node-agent` parses them."""
    import click

    from services.cli.main import main as vgpu

    command = vgpu.get_command(click.Context(vgpu), "node-agent")
    assert command is not None
    context = command.make_context("node-agent", list(container.get("args", [])))
    return {k: v for k, v in context.params.items() if k != "config_file"}


def test_hami_values_reach_every_component() -> None:
    """HAMi's value names set the same thing in every place that uses it, and the services
    load what the chart gives them."""
    docs = render_chart(HAMI_VALUES)
    ns = "gpu-sharing"
    assert {d["metadata"].get("namespace", ns) for d in docs} == {ns, "kube-system"}
    allocator = pod_spec(find(docs, "Deployment", "vgpu-allocator"))["containers"][0]
    assert allocator["image"] == "registry.example.com/vgpu/services:0.1.0"
    environ = {k: v if isinstance(v, str) else "nats://x" for k, v in env_of(allocator).items()}
    settings = load_settings(AllocatorSettings, section="allocator", environ=environ)
    config = settings.request_config()
    assert (config.names.gpu, config.names.memory, config.names.memory_percent,
            config.names.cores, config.names.priority) == (
        "example.com/vgpu", "example.com/vgpu-memory", "example.com/vgpu-memory-percentage",
        "example.com/vgpu-cores", "example.com/vgpu-priority")  # fmt: skip
    assert (config.default_memory_mib, config.default_cores) == (4096, 30)
    assert (settings.node_policy, settings.gpu_policy) == ("binpack", "spread")
    assert settings.scheduler_name == "hami-scheduler"

    # HAMi's empty tag: the version of the API server Helm renders for.
    kube_scheduler = pod_spec(find(docs, "Deployment", "vgpu-scheduler"))["containers"][0]
    assert re.fullmatch(
        r"registry\.cn-hangzhou\.aliyuncs\.com/google_containers/"
        r"kube-scheduler:v1\.\d+\.\d+",
        kube_scheduler["image"],
    )

    agent_spec = pod_spec(find(docs, "DaemonSet", "vgpu-node-agent"))
    assert agent_spec["nodeSelector"] == {"gpu": "on"}
    agent_env = {k: v if isinstance(v, str) else "x" for k, v in
                 env_of(agent_spec["containers"][0]).items()}  # fmt: skip
    agent = load_settings(NodeAgentSettings, section="nodeagent", environ=agent_env,
                          overrides=agent_flags(agent_spec["containers"][0]))  # fmt: skip
    assert (agent.resource_name, agent.split_count, agent.device_list_strategy) == (
        "example.com/vgpu",
        4,
        "cdi-cri",
    )
    assert (agent.memory_scaling, agent.cores_scaling, agent.fail_on_init_error) == (
        1.5, 2.0, False)  # fmt: skip

    scheduler = yaml.safe_load(
        find_generated(docs, "ConfigMap", "vgpu-scheduler-config-")["data"]["config.yaml"]
    )
    assert scheduler["profiles"] == [{"schedulerName": "hami-scheduler"}]
    gpu_pods, every_pod = scheduler["extenders"]
    assert (
        gpu_pods["urlPrefix"]
        == every_pod["urlPrefix"]
        == (f"https://vgpu-allocator.{ns}.svc:9443/scheduler")
    )
    managed = {m["name"]: m["ignoredByScheduler"] for m in gpu_pods["managedResources"]}
    assert managed["example.com/vgpu"] is False
    assert all(managed[f"example.com/vgpu-{n}"] for n in
               ("memory", "memory-percentage", "cores", "priority"))  # fmt: skip
    assert "nvidia.com/gpumem" not in managed and managed["tencent.com/vcuda-core"] is True

    (webhook,) = find(docs, "MutatingWebhookConfiguration", "vgpu-allocator")["webhooks"]
    assert webhook["clientConfig"]["service"]["namespace"] == ns
    excluded = webhook["namespaceSelector"]["matchExpressions"][0]["values"]
    assert excluded == ["kube-system", ns, "batch-system"]
    certgen = pod_spec(find(docs, "Job", "vgpu-webhook-certgen"))["initContainers"][0]
    assert f"--host=vgpu-allocator,vgpu-allocator.{ns},vgpu-allocator.{ns}.svc" in certgen["args"]
    policy = find(docs, "ValidatingAdmissionPolicy", "vgpu-node-agent-own-node")
    assert (
        f"system:serviceaccount:{ns}:vgpu-node-agent"
        in (policy["spec"]["matchConditions"][0]["expression"])
    )


def test_generated_config_maps_change_name_with_their_content() -> None:
    """As with kustomize's generator: new content, new name, so the pods that mount it roll."""
    before = find_generated(render_chart(), "ConfigMap", "vgpu-scheduler-config-")
    after = find_generated(render_chart({"schedulerName": "other"}), "ConfigMap",
                           "vgpu-scheduler-config-")  # fmt: skip
    assert before["metadata"]["name"] != after["metadata"]["name"]
    deployment = find(render_chart({"schedulerName": "other"}), "Deployment", "vgpu-scheduler")
    volume = next(v for v in pod_spec(deployment)["volumes"] if v["name"] == "config")
    assert volume["configMap"]["name"] == after["metadata"]["name"]


def test_chart_files_are_the_kustomize_files() -> None:
    """The chart reads nats.conf and the credentials script through links into deploy/k8s, so
    there is one copy of each."""
    for name, folder in (
        ("nats.conf", "nats"),
        ("nats_credentials.py", "nats"),
        ("extender_certs.py", "certs"),
    ):
        link = CHART / "files" / name
        assert link.is_symlink()
        assert link.resolve() == (K8S / "base" / folder / name).resolve()


def test_schedulers_without_leader_election_must_be_one() -> None:
    with pytest.raises(
        Exception, match=r"scheduler\.leaderElect=false needs scheduler\.replicas=1"
    ):
        render_chart({"scheduler": {"leaderElect": False}})
    assert render_chart({"scheduler": {"leaderElect": False, "replicas": 1}})


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"devicePlugin": {"deviceSplitcount": 5}}, "'/devicePlugin': additional properties "
         "'deviceSplitcount' not allowed"),
        ({"scheduler": {"nodeLockExpire": "5m"}}, "'/scheduler': additional properties "
         "'nodeLockExpire' not allowed"),
        ({"scheduler": {"defaultCores": 150}}, "'/scheduler/defaultCores': maximum: got 150"),
        ({"nats": {"enabled": "yes"}}, "'/nats/enabled': got string, want boolean"),
        ({"networkPolicy": {"apiServerCIDRs": ["10.0.0.1"]}}, "'/networkPolicy/apiServerCIDRs/0'"),
        ({"scheduler": {"defaultSchedulerPolicy": {"gpuSchedulerPolicy": "random"}}},
         "'/scheduler/defaultSchedulerPolicy/gpuSchedulerPolicy'"),
    ],
)  # fmt: skip
def test_bad_values_are_refused_by_name(values: dict[str, Any], message: str) -> None:
    """values.schema.json: a misspelt key, a HAMi-only key or a wrong type stops `helm
    install` with the path of the value, instead of being ignored."""
    with pytest.raises(Exception, match="values don't meet the specifications") as refused:
        render_chart(values)
    assert message in str(refused.value)


def _value_paths(node: dict[str, Any], schema: dict[str, Any], prefix: str = "") -> list[str]:
    """Every value an operator sets, by its dotted path; container resources count as one."""
    while "$ref" in node:
        if node["$ref"].endswith("/resources"):
            return [prefix]
        node = schema["definitions"][node["$ref"].rpartition("/")[2]]
    if "properties" not in node:
        return [prefix]
    return [path for name, sub in node["properties"].items()
            for path in _value_paths(sub, schema, f"{prefix}.{name}".lstrip("."))]  # fmt: skip


def _helm_docs() -> str:
    readme = (REPO / "deploy" / "README.md").read_text()
    return readme[readme.index("## Helm") : readme.index("## Decisions")]


def test_every_value_is_in_values_yaml_the_schema_and_the_docs() -> None:
    schema = json.loads((CHART / "values.schema.json").read_text())
    defaults = yaml.safe_load((CHART / "values.yaml").read_text())
    table = _helm_docs()
    paths = _value_paths(schema, schema)
    assert len(paths) > 60
    for path in paths:
        if path.rpartition(".")[2] == "registry":
            continue  # optional per image, documented with its image
        node: Any = defaults
        for part in path.split("."):
            assert isinstance(node, dict) and part in node, f"{path}: not in values.yaml"
            node = node[part]
        assert f"`{path}`" in table, f"{path}: not in deploy/README.md's values table"


def test_documented_set_arguments_are_valid_values() -> None:
    """Every `--set` for this chart in the docs parses as Helm parses it and passes the
    schema (the install guide's Helm section; other charts' commands precede it)."""
    install = (REPO / "docs" / "install.md").read_text()
    docs = install[install.index("## Installing with Helm") : install.index("## Troubleshooting")]
    assignments = re.findall(r"--set ([^\s`]+)", docs + _helm_docs())
    assert len(assignments) >= 8
    for assignment in assignments:
        if "..." in assignment:
            continue
        shell_word = assignment.replace('""', "")  # what the shell passes on
        assert render_chart(parse_set(shell_word)), assignment


OPTION_VALUES: dict[str, dict[str, Any]] = {
    "hami": HAMI_VALUES,
    "dev": DEV_VALUES,
    "options": {
        "global": {"imagePullSecrets": [{"name": "regcred"}]},
        "scheduler": {"certManager": {"enabled": True}, "leaderElect": False, "replicas": 1},
        "devicePlugin": {"peerNodeLabels": True, "runtimeClassName": "nvidia",
                         "failOnInitError": False, "onViolation": "kill",
                         "migStrategy": "mixed", "passDeviceSpecsEnabled": True,
                         "config": {"map": {"config.yaml": "version: v1\n"}}},
        "serviceMonitor": {"enabled": True, "labels": {"release": "kube-prometheus-stack"}},
        "nats": {"storageClassName": "fast-ssd"},
        "networkPolicy": {"apiServerCIDRs": ["10.0.0.0/28"]},
    },
    "modes": {"scheduler": {"memoryUnit": "MiB", "adoptSchedulers": ["hami-scheduler", "volcano"],
                            "countOnlyEqualShare": True},
              "devicePlugin": {"sharingMode": "mps", "sharingReplicas": 4, "modeLabels": False}},
    "existing-nats": {"nats": {"enabled": False}, "scheduler": {"extender": {"stateReplicas": 1}},
                      "nodeRestriction": {"enabled": False}, "networkPolicy": {"enabled": False}},
}  # fmt: skip


@pytest.mark.parametrize("name", OPTION_VALUES)
def test_chart_objects_fit_the_kubernetes_schema_with_options(name: str) -> None:
    """Values no overlay covers still give valid objects and settings the services load."""
    from tests.deploy.test_manifests import SCHEMAS, _model_class, check
    from tests.deploy.test_service_settings import _check

    docs = render_chart(OPTION_VALUES[name])
    problems: list[str] = []
    for obj in docs:
        schema = SCHEMAS.get((obj["apiVersion"], obj["kind"]))
        if schema is not None:
            problems += check(obj, schema, obj["metadata"]["name"])
        else:
            _model_class(obj).model_validate(obj)
    assert not problems, "\n".join(problems)
    checked = 0
    for obj in (d for d in docs if d["kind"] in ("Deployment", "DaemonSet")):
        for container in pod_spec(obj)["containers"]:
            if container.get("command", [])[:1] == ["vgpu"]:
                _check(container["command"][1:], env_of(container), obj["metadata"]["name"])
                checked += 1
    assert checked == 3


def test_the_packaged_chart_renders_the_same(work_dir: Path) -> None:
    """`helm package` resolves the links to deploy/k8s: the archive an operator installs from
    renders what the directory does."""
    assert _compare(render(""), render_packaged(work_dir)) == []


def test_install_notes_warn_about_what_only_the_operator_can_fix() -> None:
    default = notes()
    assert "networkPolicy.apiServerCIDRs to your API server's source addresses" in default
    assert "kubectl -n vgpu-system port-forward svc/vgpu-metrics 9400" in default
    assert "nvidia-device-enable=enable" not in default
    tuned = notes({
        "networkPolicy": {"apiServerCIDRs": ["10.0.0.0/28"]},
        "scheduler": {"kubeScheduler": {"image": {"tag": ""}}},
        "devicePlugin": {"peerNodeLabels": True},
    })  # fmt: skip
    assert "apiServerCIDRs" not in tuned and "kube-scheduler may be" not in tuned
    assert "k8s.amazonaws.com/accelerator=vgpu" in tuned
    # kube-scheduler newer than the cluster, or two minors older: said; one older: fine.
    own = render_chart({"scheduler": {"kubeScheduler": {"image": {"tag": ""}}}})
    image = pod_spec(find(own, "Deployment", "vgpu-scheduler"))["containers"][0]["image"]
    minor = int(image.rpartition(":v1.")[2].partition(".")[0])  # the version Helm renders for
    for tag, warned in ((minor + 1, True), (minor - 1, False), (minor - 2, True)):
        text = notes({"scheduler": {"kubeScheduler": {"image": {"tag": f"v1.{tag}.0"}}}})
        assert ("kube-scheduler may be one minor version older" in text) == warned, tag


def _runs_on(daemonset: dict[str, Any], node_labels: dict[str, str]) -> bool:
    """Would the DaemonSet place a pod on a node with these labels (nodeSelector and required
    node affinity; terms ORed, expressions within a term ANDed)?"""
    spec = pod_spec(daemonset)
    if not selects({"matchLabels": spec.get("nodeSelector") or {}}, node_labels):
        return False
    required = spec["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    return any(selects({"matchExpressions": term["matchExpressions"]}, node_labels)
               for term in required["nodeSelectorTerms"])  # fmt: skip


TENCENT_NODE = {"nvidia-device-enable": "enable"}
AWS_NODE = {"k8s.amazonaws.com/accelerator": "vgpu"}
GFD_NODE = {"nvidia.com/gpu.present": "true"}


def test_peer_node_labels_bring_the_agent_to_tencent_and_aws_gpu_nodes(work_dir: Path) -> None:
    with_peers = [
        find(_with_component("peer-node-labels", work_dir), "DaemonSet", "vgpu-node-agent"),
        find(render_chart({"devicePlugin": {"peerNodeLabels": True}}), "DaemonSet",
             "vgpu-node-agent"),
    ]  # fmt: skip
    without = [find(render(""), "DaemonSet", "vgpu-node-agent"),
               find(render_chart(), "DaemonSet", "vgpu-node-agent")]  # fmt: skip
    for agent in with_peers:
        assert all(_runs_on(agent, n) for n in (TENCENT_NODE, AWS_NODE, GFD_NODE))
        assert not _runs_on(agent, {"nvidia-device-enable": "disable"})
        assert not _runs_on(agent, {"k8s.amazonaws.com/accelerator": "nvidia-tesla-t4"})
    for agent in without:
        assert _runs_on(agent, GFD_NODE)
        assert not _runs_on(agent, TENCENT_NODE) and not _runs_on(agent, AWS_NODE)
    # HAMi's nodeSelector narrows on top of the labels: gpu=on and a GPU-node label.
    hami = find(render_chart({"devicePlugin": {"nvidiaNodeSelector": {"gpu": "on"}}}),
                "DaemonSet", "vgpu-node-agent")  # fmt: skip
    assert _runs_on(hami, {**GFD_NODE, "gpu": "on"})
    assert not _runs_on(hami, GFD_NODE) and not _runs_on(hami, {"gpu": "on"})


# NVIDIA's time-slicing example as an operator keeps it in a ConfigMap.
NVIDIA_CONFIG = """\
version: v1
flags:
  migStrategy: single
  failOnInitError: true
sharing:
  timeSlicing:
    resources:
    - name: nvidia.com/gpu
      replicas: 4
"""


def _agent_settings(docs: list[dict[str, Any]], files: Path) -> NodeAgentSettings:
    """The node agent's settings as it would load them in its pod: environment, flags, and
    the mounted NVIDIA config file (its ConfigMap written under `files`)."""
    agent_spec = pod_spec(find(docs, "DaemonSet", "vgpu-node-agent"))
    container = agent_spec["containers"][0]
    env = {k: v if isinstance(v, str) else "x" for k, v in env_of(container).items()}
    if "CONFIG_FILE" in env:
        (volume,) = [v for v in agent_spec["volumes"] if v["name"] == "device-plugin-config"]
        config_map = find(docs, "ConfigMap", volume["configMap"]["name"])
        key = volume["configMap"]["items"][0]["key"]
        (files / key).write_text(config_map["data"][key])
        assert env["CONFIG_FILE"].rpartition("/")[2] == key
        env["CONFIG_FILE"] = str(files / key)
    # The flags as `vgpu node-agent` parses them and hands them to the same loader.
    command = vgpu.get_command(click.Context(vgpu), "node-agent")
    assert command is not None
    params = command.make_context("node-agent", list(container.get("args", []))).params
    flags = {k: v for k, v in params.items()
             if v is not None and k not in ("config_file", "nvidia_config_file")}  # fmt: skip
    return load_node_agent_settings(environ=env, flags=flags)


def test_nvidia_config_file_reaches_the_agent_unchanged(work_dir: Path) -> None:
    """devicePlugin.config.map: the operator's NVIDIA file goes into a ConfigMap, is mounted,
    and the agent reads it as NVIDIA's plugin would; chart values win over it, as NVIDIA's
    flags win over its file."""
    docs = render_chart({"devicePlugin": {"config": {"map": {"time-slicing.yaml": NVIDIA_CONFIG}}}})
    settings = _agent_settings(docs, work_dir)
    assert (settings.sharing_mode, settings.sharing_replicas) == ("time-slicing", 4)
    assert settings.mig_strategy == "single"  # from the file: the chart left it alone
    docs = render_chart({"devicePlugin": {"migStrategy": "mixed", "passDeviceSpecsEnabled": True,
                                          "config": {"map": {"a.yaml": NVIDIA_CONFIG,
                                                             "b.yaml": "version: v1\n"},
                                                     "default": "a.yaml"}}})  # fmt: skip
    settings = _agent_settings(docs, work_dir)
    assert (settings.mig_strategy, settings.pass_device_specs) == ("mixed", True)
    assert settings.sharing_mode == "time-slicing"
    # A new file is a new ConfigMap name: the agents roll and read it.
    first = find_generated(docs, "ConfigMap", "vgpu-device-plugin-config-")
    edited = {"devicePlugin": {"config": {"map": {"a.yaml": "version: v1\n"}}}}
    second = find_generated(render_chart(edited), "ConfigMap", "vgpu-device-plugin-config-")
    assert first["metadata"]["name"] != second["metadata"]["name"]


def test_an_existing_nvidia_config_map_is_mounted_by_name(work_dir: Path) -> None:
    docs = render_chart({"devicePlugin": {"config": {"name": "nvidia-plugin-configs",
                                                     "default": "any"}}})  # fmt: skip
    agent_spec = pod_spec(find(docs, "DaemonSet", "vgpu-node-agent"))
    (volume,) = [v for v in agent_spec["volumes"] if v["name"] == "device-plugin-config"]
    assert volume["configMap"] == {"name": "nvidia-plugin-configs",
                                   "items": [{"key": "any", "path": "any"}]}  # fmt: skip
    assert (
        env_of(agent_spec["containers"][0])["CONFIG_FILE"] == "/etc/vgpu/device-plugin-config/any"
    )
    assert not [d for d in docs if d["metadata"]["name"].startswith("vgpu-device-plugin-config")]


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"map": {"a": "x", "b": "y"}}, "devicePlugin.config.default: name the file to use"),
        ({"name": "mine"}, "devicePlugin.config.default: name the file to use"),
        ({"map": {"a": "x"}, "default": "b"}, '"b" is not a key of devicePlugin.config.map'),
        ({"map": {"a": "x"}, "name": "mine"}, "give map (the files) or name"),
    ],
)
def test_a_config_that_names_no_single_file_is_refused(
    config: dict[str, Any], message: str
) -> None:
    with pytest.raises(Exception) as refused:
        render_chart({"devicePlugin": {"config": config}})
    assert message in str(refused.value)


def _agent_and_spec(docs: list[dict[str, Any]]) -> tuple[NodeAgentSettings, dict[str, Any]]:
    spec = pod_spec(find(docs, "DaemonSet", "vgpu-node-agent"))
    container = spec["containers"][0]
    environ = {k: v if isinstance(v, str) else "x" for k, v in env_of(container).items()}
    settings = load_node_agent_settings(flags=agent_flags(container), environ=environ)
    return settings, spec


def test_sharing_modes_and_peer_settings_reach_the_services() -> None:
    """MPS mode, time-slicing replicas, resourceConfig, node labels, and the allocator's
    gpushare, HAMi-adoption and 4paradigm values, as the services load them."""
    docs = render_chart(OPTION_VALUES["modes"])
    agent, spec = _agent_and_spec(docs)
    assert (agent.sharing_mode, agent.sharing_replicas, agent.mode_labels) == ("mps", 4, False)
    assert agent.mps_root == "/run/nvidia/mps"
    # The MPS root is the host's, at the same path (Allocate mounts from it into clients),
    # and the runtime gives the agent the MPS control program (compute capability).
    container = spec["containers"][0]
    (mount,) = [m for m in container["volumeMounts"] if m["name"] == "mps-root"]
    (volume,) = [v for v in spec["volumes"] if v["name"] == "mps-root"]
    assert mount["mountPath"] == volume["hostPath"]["path"] == "/run/nvidia/mps"
    assert env_of(container)["NVIDIA_DRIVER_CAPABILITIES"] == "compute,utility"
    allocator = pod_spec(find(docs, "Deployment", "vgpu-allocator"))["containers"][0]
    environ = {k: v if isinstance(v, str) else "x" for k, v in env_of(allocator).items()}
    settings = load_settings(AllocatorSettings, section="allocator", environ=environ)
    assert settings.memory_unit == "MiB" and settings.count_only_equal_share
    assert settings.adopt_schedulers == ["hami-scheduler", "volcano"]
    # Nodes that only node labels put in MPS mode: the directory without the mode.
    labelled = render_chart({"devicePlugin": {"mps": {"enabled": True}, "simulate": "1xT4"}})
    agent, spec = _agent_and_spec(labelled)
    assert agent.sharing_mode == "vgpu" and agent.mode_labels
    assert any(v["name"] == "mps-root" for v in spec["volumes"])
    assert agent.mps_control == "python -m services.simulators.mps_control"
    # The fork's resourceConfig reaches the agent as its --resource-config.
    forked = render_chart(
        {"devicePlugin": {"resourceConfig": "gpu:sharedgpu:4,mig-3g.20gb:small:2"}}
    )
    assert _agent_and_spec(forked)[0].resource_config == "gpu:sharedgpu:4,mig-3g.20gb:small:2"
    # Defaults add none of it (the chart still renders what kustomize installs).
    agent, spec = _agent_and_spec(render_chart())
    assert agent.sharing_mode == "vgpu" and not agent.resource_config
    assert not any(v["name"] == "mps-root" for v in spec["volumes"])


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"devicePlugin": {"sharingMode": "slices"}}, "sharingMode"),
        ({"devicePlugin": {"sharingReplicas": 1}}, "sharingReplicas"),
        ({"scheduler": {"memoryUnit": "GB"}}, "memoryUnit"),
        ({"devicePlugin": {"mps": {"root": "run/mps"}}}, "root"),
    ],
)
def test_bad_mode_values_are_refused_by_name(values: dict[str, Any], message: str) -> None:
    with pytest.raises(Exception, match=message):
        render_chart(values)
