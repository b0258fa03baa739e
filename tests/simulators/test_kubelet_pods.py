"""The container env the kubelet simulator resolves, as a kubelet does at container start."""

from __future__ import annotations

import pytest

from services.simulators.kubelet_pods import PodError, parse_pod


def pod_with_env(env: list[dict[str, object]]) -> dict[str, object]:
    return {
        "metadata": {"name": "p", "namespace": "ml", "uid": "u-1", "labels": {"app": "a"},
                     "annotations": {"ALIYUN_COM_GPU_MEM_IDX": "2"}},
        "spec": {"nodeName": "node-1", "containers": [{"name": "c", "env": env}]},
    }  # fmt: skip


def field(name: str, path: str) -> dict[str, object]:
    return {"name": name, "valueFrom": {"fieldRef": {"fieldPath": path}}}


def test_values_and_downward_api_field_refs_are_resolved() -> None:
    spec = parse_pod(pod_with_env([
        {"name": "PLAIN", "value": "x"},
        {"name": "EMPTY"},
        field("IDX", "metadata.annotations['ALIYUN_COM_GPU_MEM_IDX']"),
        field("MISSING", "metadata.annotations['absent']"),
        field("APP", "metadata.labels['app']"),
        field("NODE", "spec.nodeName"),
        field("POD", "metadata.name"),
        field("NS", "metadata.namespace"),
        {"name": "SECRET", "valueFrom": {"secretKeyRef": {"name": "s", "key": "k"}}},
    ]))  # fmt: skip
    (container,) = spec.containers
    assert container.env == {
        "PLAIN": "x", "EMPTY": "", "IDX": "2", "MISSING": "", "APP": "a", "NODE": "node-1",
        "POD": "p", "NS": "ml",
    }  # fmt: skip


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ([field("X", "metadata.bogus")], "unsupported fieldRef.fieldPath 'metadata.bogus'"),
        ([{"value": "x"}], "env[0]: name is missing"),
        ({"X": "y"}, ".env: expected a list"),
    ],
)
def test_malformed_env_is_named(env: object, message: str) -> None:
    with pytest.raises(PodError, match=r"spec\.containers") as caught:
        parse_pod(pod_with_env(env))  # type: ignore[arg-type]
    assert message in str(caught.value)
