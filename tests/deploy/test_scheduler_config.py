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


def test_the_extender_filters_scores_and_binds_with_node_names_only() -> None:
    config = _config()
    assert [p["schedulerName"] for p in config["profiles"]] == ["vgpu-scheduler"]
    (extender,) = config["extenders"]
    assert extender["filterVerb"] == "filter"
    assert extender["prioritizeVerb"] == "prioritize"
    assert extender["bindVerb"] == "bind"
    assert extender["nodeCacheCapable"] is True
    assert extender["enableHTTPS"] is False
    assert extender["ignorable"] is False
    assert extender["weight"] >= 1
    assert extender["httpTimeout"] == "5s"


def test_managed_resources_are_every_name_vgpu_reads() -> None:
    """kube-scheduler checks the device count itself and leaves every parameter resource
    (which no node advertises) to the extender; a pod naming any of them goes to it."""
    (extender,) = _config()["extenders"]
    managed = {r["name"]: r["ignoredByScheduler"] for r in extender["managedResources"]}
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
        ("extender", "weight", 0, "weight must be positive"),
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
