"""The fields we use of the custom resources the manifests create (no Python models exist).

Each schema is a nested mapping: key -> type, nested schema, or [item schema]. Anything not
listed is an error, as the API server's structural schema would prune or reject it; the
lists follow the CRDs of prometheus-operator (monitoring.coreos.com/v1) and cert-manager
(cert-manager.io/v1).
"""

from __future__ import annotations

from typing import Any

METADATA = {"name": str, "namespace": str, "labels": {str: str}, "annotations": {str: str}}
LABEL_SELECTOR = {
    "matchLabels": {str: str},
    "matchExpressions": [{"key": str, "operator": str, "values": [str]}],
}
NAMESPACE_SELECTOR = {"any": bool, "matchNames": [str]}
SECRET_KEY = {"name": str, "key": str, "optional": bool}
ENDPOINT = {"port": str, "path": str, "interval": str, "scrapeTimeout": str, "scheme": str,
            "honorLabels": bool,
            "authorization": {"type": str, "credentials": SECRET_KEY}}  # fmt: skip

SCHEMAS: dict[tuple[str, str], dict[Any, Any]] = {
    ("monitoring.coreos.com/v1", "ServiceMonitor"): {
        "apiVersion": str, "kind": str, "metadata": METADATA,
        "spec": {"selector": LABEL_SELECTOR, "namespaceSelector": NAMESPACE_SELECTOR,
                 "endpoints": [ENDPOINT], "jobLabel": str},
    },
    ("monitoring.coreos.com/v1", "PodMonitor"): {
        "apiVersion": str, "kind": str, "metadata": METADATA,
        "spec": {"selector": LABEL_SELECTOR, "namespaceSelector": NAMESPACE_SELECTOR,
                 "podMetricsEndpoints": [ENDPOINT], "jobLabel": str},
    },
    ("cert-manager.io/v1", "Issuer"): {
        "apiVersion": str, "kind": str, "metadata": METADATA,
        "spec": {"selfSigned": {"crlDistributionPoints": [str]}, "ca": {"secretName": str}},
    },
    ("cert-manager.io/v1", "Certificate"): {
        "apiVersion": str, "kind": str, "metadata": METADATA,
        "spec": {
            "secretName": str, "commonName": str, "dnsNames": [str], "isCA": bool,
            "duration": str, "renewBefore": str,
            "issuerRef": {"name": str, "kind": str, "group": str},
            "privateKey": {"algorithm": str, "size": int, "encoding": str, "rotationPolicy": str},
            "usages": [str],
            "subject": {"organizations": [str], "organizationalUnits": [str]},
        },
    },
}  # fmt: skip


def check(value: Any, schema: Any, path: str) -> list[str]:
    """Every place where `value` does not fit `schema`, as 'path: problem'."""
    if isinstance(schema, type):
        if (schema is int and isinstance(value, bool)) or not isinstance(value, schema):
            return [f"{path}: expected {schema.__name__}, got {type(value).__name__}"]
        return []
    if isinstance(schema, list):
        if not isinstance(value, list):
            return [f"{path}: expected a list, got {type(value).__name__}"]
        return [p for i, item in enumerate(value) for p in check(item, schema[0], f"{path}[{i}]")]
    if not isinstance(value, dict):
        return [f"{path}: expected a mapping, got {type(value).__name__}"]
    if len(schema) == 1 and isinstance(next(iter(schema)), type):  # a map of free keys
        key_type, value_schema = next(iter(schema.items()))
        problems = []
        for key, item in value.items():
            problems += check(key, key_type, f"{path} key")
            problems += check(item, value_schema, f"{path}.{key}")
        return problems
    problems = [f"{path}.{key}: unknown field" for key in value if key not in schema]
    for key, item in value.items():
        if key in schema:
            problems += check(item, schema[key], f"{path}.{key}")
    return problems
