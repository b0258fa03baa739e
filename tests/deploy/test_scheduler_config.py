"""The vgpu-scheduler's KubeSchedulerConfiguration parses as kubescheduler.config.k8s.io/v1 and
says what the allocator's extender needs."""

from __future__ import annotations

import copy
import re
from typing import Any

import pytest
import yaml

from services.common import resources
from tests.deploy.manifests import OVERLAYS, find, find_generated, pod_spec, render
from tests.deploy.scheduler_config import SchedulerConfigError, validate


def _config(overlay: str = "") -> dict[str, Any]:
    config_map = find_generated(render(overlay), "ConfigMap", "vgpu-scheduler-config-")
    return yaml.safe_load(config_map["data"]["config.yaml"])


@pytest.mark.parametrize("overlay", OVERLAYS, ids=lambda o: o or "default")
def test_configuration_parses_as_v1(overlay: str) -> None:
    validate(_config(overlay))


def _extenders() -> tuple[dict[str, Any], dict[str, Any]]:
    gpu_pods, every_pod = _config()["extenders"]
    return gpu_pods, every_pod


def test_gpu_pods_are_filtered_and_bound_by_the_extender_with_node_names_only() -> None:
    config = _config()
    assert [p["schedulerName"] for p in config["profiles"]] == ["vgpu-scheduler"]
    gpu_pods, _ = _extenders()
    assert gpu_pods["filterVerb"] == "filter"
    assert gpu_pods["bindVerb"] == "bind"
    assert "prioritizeVerb" not in gpu_pods  # the every-pod entry scores GPU pods too
    assert gpu_pods["nodeCacheCapable"] is True
    assert gpu_pods["ignorable"] is False
    assert gpu_pods["httpTimeout"] == "5s"


def test_the_extender_is_called_over_https_with_a_client_certificate() -> None:
    """Issue 20: only kube-scheduler may place and bind, so it proves who it is; the files are
    the Secret vgpu-scheduler-extender-client's (tests/deploy/test_manifests.py mounts them)."""
    for entry in _extenders():
        assert entry["urlPrefix"].startswith("https://")
        assert entry["enableHTTPS"] is True
        assert entry["tlsConfig"] == {
            "certFile": "/etc/vgpu/extender-client/tls.crt",
            "keyFile": "/etc/vgpu/extender-client/tls.key",
            "caFile": "/etc/vgpu/extender-client/ca.crt",
        }
        assert "insecure" not in entry["tlsConfig"]


def test_every_pod_is_scored_by_the_extender() -> None:
    """kube-scheduler calls an extender for a pod when it has no managedResources
    (IsInterested), so the second entry prioritizes pods without GPUs too; only it scores,
    so no pod is scored twice, and it is ignorable (a score is advice)."""
    gpu_pods, every_pod = _extenders()
    assert every_pod["urlPrefix"] == gpu_pods["urlPrefix"]
    assert every_pod["prioritizeVerb"] == "prioritize"
    assert "managedResources" not in every_pod
    assert not {"filterVerb", "bindVerb", "preemptVerb"} & set(every_pod)
    assert every_pod["nodeCacheCapable"] is True
    assert every_pod["ignorable"] is True


# The default profile's score plugins (kube-scheduler-scoring.md, section 1) that can rank
# nodes apart for a pod that states no preference: NodeResourcesFit, BalancedAllocation and
# ImageLocality (weight 1 each), and PodTopologySpread's system-default constraints (weight
# 2) for pods of a Service or controller. Each normalized score is 0-100.
SPREAD_WITHOUT_PREFERENCES = 100 * (1 + 1 + 1 + 2)


def test_one_step_of_the_extender_score_outweighs_the_default_plugins() -> None:
    """total = sum(weight_p x score_p) + 10 x weight_e x score_e: one step of the extender's
    0-10 score must be worth more than all those plugins can move a total, so vgpu's host
    score decides among the nodes that fit."""
    config = _config()
    _, every_pod = _extenders()
    assert "plugins" not in config["profiles"][0]  # default plugins, default weights
    assert 10 * every_pod["weight"] > SPREAD_WITHOUT_PREFERENCES


def test_managed_resources_are_every_name_vgpu_reads() -> None:
    """kube-scheduler checks the device count itself and leaves every parameter resource
    (which no node advertises) to the extender; a pod naming any of them goes to it."""
    gpu_pods, _ = _extenders()
    managed = {r["name"]: r["ignoredByScheduler"] for r in gpu_pods["managedResources"]}
    parameters = (resources.GPU_MEMORY, resources.GPU_MEMORY_PERCENT, resources.GPU_CORES,
                  resources.GPU_PRIORITY, *resources.PEER_RESOURCES)  # fmt: skip
    assert managed == {resources.GPU: False} | dict.fromkeys(parameters, True)


def test_leader_election_uses_its_own_lease() -> None:
    config = _config()
    election = config["leaderElection"]
    assert election == {
        "leaderElect": True,
        "resourceLock": "leases",
        "resourceName": "vgpu-scheduler",
        "resourceNamespace": "vgpu-system",
    }
    role = find(render(""), "Role", "vgpu-scheduler-leader-election")
    names = {n for rule in role["rules"] for n in rule.get("resourceNames", [])}
    assert names == {election["resourceName"]}


def test_the_scheduler_runs_the_upstream_image_with_this_file() -> None:
    docs = render("")
    deployment = find(docs, "Deployment", "vgpu-scheduler")
    (container,) = pod_spec(deployment)["containers"]
    assert container["image"].startswith("registry.k8s.io/kube-scheduler:v1.")
    mount = next(m for m in container["volumeMounts"] if m["name"] == "config")
    assert f"--config={mount['mountPath']}/config.yaml" in container["command"]
    volume = next(v for v in pod_spec(deployment)["volumes"] if v["name"] == "config")
    assert volume["configMap"]["name"].startswith("vgpu-scheduler-config-")


def _part(config: dict[str, Any], part: str) -> dict[str, Any]:
    return {
        "config": config,
        "extender": config["extenders"][0],
        "scorer": config["extenders"][1],
        "resource": config["extenders"][0]["managedResources"][0],
        "election": config["leaderElection"],
    }[part]


@pytest.mark.parametrize(
    ("part", "key", "value", "problem"),
    [
        ("extender", "enableHttps", False, "extenders[0].enableHttps: unknown field"),
        ("extender", "nodeCacheCapable", "true", "expected bool, got str"),
        ("extender", "httpTimeout", 5, "expected a duration"),
        ("extender", "httpTimeout", "5 seconds", "expected a duration"),
        ("resource", "ignoredByscheduler", True, "ignoredByscheduler: unknown field"),
        ("scorer", "weight", 0, "weight must be positive"),
        ("config", "apiVersion", "kubescheduler.config.k8s.io/v1beta3", "apiVersion must be"),
        ("election", "leaseDuration", "15", "expected a duration"),
    ],
)
def test_the_reader_rejects_what_kube_scheduler_rejects(
    part: str, key: str, value: Any, problem: str
) -> None:
    config = copy.deepcopy(_config())
    _part(config, part)[key] = value
    with pytest.raises(SchedulerConfigError, match=re.escape(problem)):
        validate(config)


def test_the_reader_rejects_duplicate_profiles_and_binders() -> None:
    config = copy.deepcopy(_config())
    config["profiles"].append({"schedulerName": "vgpu-scheduler"})
    with pytest.raises(SchedulerConfigError, match="distinct"):
        validate(config)
    config = copy.deepcopy(_config())
    config["extenders"].append(dict(config["extenders"][0]))
    with pytest.raises(SchedulerConfigError, match="only one extender may implement bind"):
        validate(config)
