"""Render the Helm chart under deploy/helm/vgpu with Helm's own engine, and put its output and
kustomize's side by side.

No registry package ships the `helm` command for Linux (PyPI's helm wheels carry macOS and
Windows binaries only; Debian has no helm), so the tests render with Helm's Go SDK itself:
the `helm-python-sdk` test dependency wraps the SDK's chart loader and template engine
(`helm template` runs the same code) in a shared library. An operator's `helm` renders the
chart the same way.
"""

from __future__ import annotations

import functools
import json
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.deploy.manifests import NAMESPACE, REPO, Obj

CHART = REPO / "deploy" / "helm" / "vgpu"
RELEASE = "vgpu"
# The release record only: every object goes to namespace.name (values.yaml).
RELEASE_NAMESPACE = "kube-system"

# Labels Helm charts put on their objects by convention; kustomize has no equivalent.
HELM_LABELS = ("app.kubernetes.io/managed-by", "app.kubernetes.io/instance", "helm.sh/chart")
# ConfigMaps named after their content, by kustomize's generator and by the chart's helper.
GENERATED = (
    "vgpu-nats-config",
    "vgpu-nats-credentials-script",
    "vgpu-scheduler-config",
    "vgpu-extender-certs-script",
)
_HASHED = re.compile(r"\b(" + "|".join(GENERATED) + r")-[a-z0-9]{10}\b")


def _helm() -> Any:
    try:
        import helm_python
    except ImportError:
        pytest.fail("helm-python-sdk not found: install the test extras (pip install -e '.[test]')")
    return helm_python


@functools.cache
def _render(values_json: str) -> tuple[tuple[str, Obj], ...]:
    helm = _helm()
    with helm.Chart.load(str(CHART)) as chart:
        files = chart.render(json.loads(values_json), name=RELEASE, namespace=RELEASE_NAMESPACE)
    return tuple((path.rpartition("/")[2], doc) for path, text in sorted(files.items())
                 if path.endswith(".yaml")
                 for doc in yaml.safe_load_all(text) if doc is not None)  # fmt: skip


def render_chart(values: dict[str, Any] | None = None) -> list[Obj]:
    """The chart's objects for these values (merged over values.yaml), as Helm renders them."""
    rendered = _render(json.dumps(values or {}, sort_keys=True))
    return [json.loads(json.dumps(doc)) for _, doc in rendered]


def templates_used(values: dict[str, Any] | None = None) -> set[str]:
    """The template files (names under templates/) that give objects for these values."""
    return {name for name, _ in _render(json.dumps(values or {}, sort_keys=True))}


def lint_chart(values: dict[str, Any] | None = None) -> list[str]:
    """`helm lint --strict` findings above "info" (warnings and errors), as text."""
    report = _helm().lint(str(CHART), values=values or {}, strict=True, namespace=NAMESPACE)
    found = [f"{m['path']}: {m['error']}" for m in report["messages"] if m["severity"] >= 2]
    return found + list(report["errors"])


def key(obj: Obj) -> tuple[str, str, str]:
    return obj["kind"], obj["metadata"].get("namespace", ""), obj["metadata"]["name"]


def normalized(docs: list[Obj], *, from_helm: bool) -> dict[tuple[str, str, str], Obj]:
    """Objects by (kind, namespace, name), with what may differ between the two renderings
    taken out: content-hash suffixes of generated names (and references to them), Helm's
    bookkeeping labels (required on every chart object), the order of environment variables
    (it matters only to $(VAR) references, which none uses), and embedded YAML files compared
    as data, not text."""
    out: dict[tuple[str, str, str], Obj] = {}
    for doc in docs:
        obj = json.loads(_HASHED.sub(r"\1", json.dumps(doc)))
        labels = obj["metadata"].get("labels", {})
        if from_helm:
            missing = [k for k in HELM_LABELS if k not in labels]
            assert not missing, f"{key(obj)}: no {missing} label"
        for label in HELM_LABELS:
            labels.pop(label, None)
        for container in _containers(obj):
            _sort_env(container)
        if obj["kind"] == "ConfigMap":
            obj["data"] = {name: yaml.safe_load(text) if name.endswith(".yaml") else text
                           for name, text in obj.get("data", {}).items()}  # fmt: skip
        assert key(obj) not in out, f"{key(obj)} twice"
        out[key(obj)] = obj
    return out


def _containers(obj: Obj) -> list[Obj]:
    spec = obj.get("spec", {}).get("template", {}).get("spec", {})
    return [*spec.get("initContainers", []), *spec.get("containers", [])]


def _sort_env(container: Obj) -> None:
    env = container.get("env")
    if env:
        assert "$(" not in json.dumps(env), f"{container['name']}: env refers to env"
        container["env"] = sorted(env, key=lambda e: e["name"])


def differences(left: Any, right: Any, where: str = "") -> list[str]:
    """Every path at which two parsed documents differ, with both values."""
    if isinstance(left, dict) and isinstance(right, dict):
        found: list[str] = []
        for name in sorted(set(left) | set(right), key=str):
            if name not in right:
                found.append(f"{where}.{name}: only in kustomize")
            elif name not in left:
                found.append(f"{where}.{name}: only in the chart")
            else:
                found += differences(left[name], right[name], f"{where}.{name}")
        return found
    if isinstance(left, list) and isinstance(right, list) and len(left) == len(right):
        return [f for i, (a, b) in enumerate(zip(left, right, strict=True))
                for f in differences(a, b, f"{where}[{i}]")]  # fmt: skip
    return [] if left == right else [f"{where}: kustomize {left!r}, chart {right!r}"]


def parse_set(assignment: str) -> dict[str, Any]:
    """A `--set` argument as Helm's own parser reads it."""
    parsed: dict[str, Any] = _helm().parse_set_string(assignment)
    return parsed


def notes(values: dict[str, Any] | None = None) -> str:
    """What `helm install` prints after installing (templates/NOTES.txt)."""
    with _helm().Chart.load(str(CHART)) as chart:
        files = chart.render(values or {}, name=RELEASE, namespace=RELEASE_NAMESPACE)
    return str(files[f"{CHART.name}/templates/NOTES.txt"])


def render_packaged(destination: Path) -> list[Obj]:
    """The default objects of the chart as `helm package` archives it (links resolved)."""
    helm = _helm()
    archive = Path(helm.package(str(CHART), destination=str(destination)))
    with helm.Chart.load_archive(archive.read_bytes()) as chart:
        files = chart.render({}, name=RELEASE, namespace=RELEASE_NAMESPACE)
    return [doc for path, text in sorted(files.items()) if path.endswith(".yaml")
            for doc in yaml.safe_load_all(text) if doc is not None]  # fmt: skip
