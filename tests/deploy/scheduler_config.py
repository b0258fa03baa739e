"""A strict reader of kubescheduler.config.k8s.io/v1 KubeSchedulerConfiguration.

The field names and types are those of the Go types (k8s.io/kube-scheduler/config/v1 and the
component-base types it embeds), matched to the letter as kube-scheduler's strict decoding
does: an unknown or misspelt key (`enableHttps`, the old Policy API's spelling) is an error,
and so is a value of the wrong type. The semantic checks are the ones kube-scheduler's
validation applies to the parts vgpu uses.
"""

from __future__ import annotations

import re
from typing import Any

DURATION = re.compile(r"^(\d+(\.\d+)?(ns|us|µs|ms|s|m|h))+$")  # Go's time.ParseDuration


class Duration:
    """metav1.Duration: a Go duration string such as "5s" or "1m30s"."""


PLUGIN = {"name": str, "weight": int}
PLUGIN_SET = {"enabled": [PLUGIN], "disabled": [PLUGIN]}
EXTENSION_POINTS = (
    "preEnqueue", "queueSort", "preFilter", "filter", "postFilter", "preScore", "score",
    "reserve", "permit", "preBind", "bind", "postBind", "multiPoint",
)  # fmt: skip

SCHEMA: dict[str, Any] = {
    "apiVersion": str,
    "kind": str,
    "parallelism": int,
    "leaderElection": {
        "leaderElect": bool,
        "leaseDuration": Duration,
        "renewDeadline": Duration,
        "retryPeriod": Duration,
        "resourceLock": str,
        "resourceName": str,
        "resourceNamespace": str,
    },
    "clientConnection": {
        "kubeconfig": str,
        "acceptContentTypes": str,
        "contentType": str,
        "qps": float,
        "burst": int,
    },
    # DebuggingConfiguration, inlined.
    "enableProfiling": bool,
    "enableContentionProfiling": bool,
    "percentageOfNodesToScore": int,
    "podInitialBackoffSeconds": int,
    "podMaxBackoffSeconds": int,
    "delayCacheUntilActive": bool,
    "profiles": [
        {
            "schedulerName": str,
            "percentageOfNodesToScore": int,
            "plugins": dict.fromkeys(EXTENSION_POINTS, PLUGIN_SET),
            "pluginConfig": [{"name": str, "args": dict}],
        }
    ],
    "extenders": [
        {
            "urlPrefix": str,
            "filterVerb": str,
            "preemptVerb": str,
            "prioritizeVerb": str,
            "weight": int,
            "bindVerb": str,
            "enableHTTPS": bool,
            "tlsConfig": {
                "insecure": bool,
                "serverName": str,
                "certFile": str,
                "keyFile": str,
                "caFile": str,
                "certData": str,
                "keyData": str,
                "caData": str,
            },
            "httpTimeout": Duration,
            "nodeCacheCapable": bool,
            "managedResources": [{"name": str, "ignoredByScheduler": bool}],
            "ignorable": bool,
        }
    ],
}


class SchedulerConfigError(ValueError):
    pass


def _check(value: Any, schema: Any, path: str, problems: list[str]) -> None:
    if schema is Duration:
        if not isinstance(value, str) or not DURATION.match(value):
            problems.append(f"{path}: expected a duration such as 5s, got {value!r}")
    elif isinstance(schema, type):
        numeric_ok = schema is float and isinstance(value, int)
        wrong_bool = isinstance(value, bool) and schema is not bool
        if wrong_bool or not (isinstance(value, schema) or numeric_ok):
            problems.append(f"{path}: expected {schema.__name__}, got {type(value).__name__}")
    elif isinstance(schema, list):
        if not isinstance(value, list):
            problems.append(f"{path}: expected a list, got {type(value).__name__}")
            return
        for index, item in enumerate(value):
            _check(item, schema[0], f"{path}[{index}]", problems)
    else:
        if not isinstance(value, dict):
            problems.append(f"{path}: expected a mapping, got {type(value).__name__}")
            return
        for key, item in value.items():
            if key not in schema:
                problems.append(f"{path}.{key}: unknown field")
            else:
                _check(item, schema[key], f"{path}.{key}", problems)


def validate(config: Any) -> None:
    """Raise SchedulerConfigError listing every problem; return quietly when it is valid."""
    problems: list[str] = []
    _check(config, SCHEMA, "config", problems)
    if problems:
        raise SchedulerConfigError("\n".join(problems))
    if config.get("apiVersion") != "kubescheduler.config.k8s.io/v1":
        problems.append(
            f"apiVersion must be kubescheduler.config.k8s.io/v1, got {config.get('apiVersion')!r}"
        )
    if config.get("kind") != "KubeSchedulerConfiguration":
        problems.append(f"kind must be KubeSchedulerConfiguration, got {config.get('kind')!r}")
    names = [p.get("schedulerName", "default-scheduler") for p in config.get("profiles", [])]
    if len(set(names)) != len(names) or "" in names:
        problems.append(f"profiles need distinct non-empty schedulerNames, got {names}")
    binders = 0
    for index, extender in enumerate(config.get("extenders", [])):
        where = f"extenders[{index}]"
        if not extender.get("urlPrefix"):
            problems.append(f"{where}.urlPrefix must be set")
        if extender.get("prioritizeVerb") and extender.get("weight", 0) <= 0:
            problems.append(f"{where}.weight must be positive when prioritizeVerb is set")
        binders += bool(extender.get("bindVerb"))
        resources = [r["name"] for r in extender.get("managedResources", [])]
        if len(set(resources)) != len(resources):
            problems.append(f"{where}.managedResources names a resource twice")
    if binders > 1:
        problems.append("only one extender may implement bind")
    election = config.get("leaderElection", {})
    if election.get("leaderElect") and election.get("resourceLock", "leases") != "leases":
        problems.append("leaderElection.resourceLock must be leases")
    if problems:
        raise SchedulerConfigError("\n".join(problems))
