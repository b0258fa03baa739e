"""The in-process API server, driven through the real `kubernetes` client."""

from __future__ import annotations

import asyncio
import json

import pytest
from kubernetes import client as k8s
from kubernetes import watch as k8s_watch
from kubernetes.client.rest import ApiException

from services.simulators.apiserver import FakeApiServer


def core_api(api: FakeApiServer) -> k8s.CoreV1Api:
    configuration = k8s.Configuration()
    configuration.host = api.url
    return k8s.CoreV1Api(k8s.ApiClient(configuration))


POD = {
    "apiVersion": "v1",
    "kind": "Pod",
    "metadata": {"name": "p"},
    "spec": {"containers": [{"name": "c"}]},
}


async def test_pods_get_list_patch_bind_with_resource_versions(api: FakeApiServer) -> None:
    core = core_api(api)
    created = await asyncio.to_thread(core.create_namespaced_pod, "ns", POD)
    assert created.metadata.uid and created.metadata.resource_version == "1"
    listed = await asyncio.to_thread(core.list_pod_for_all_namespaces)
    assert [p.metadata.name for p in listed.items] == [
        "p"
    ] and listed.metadata.resource_version == "1"

    patched = await asyncio.to_thread(
        core.patch_namespaced_pod, "p", "ns", {"metadata": {"annotations": {"a": "1"}}}
    )
    assert patched.metadata.annotations == {"a": "1"} and patched.metadata.resource_version == "2"
    with pytest.raises(ApiException) as stale:
        await asyncio.to_thread(
            core.patch_namespaced_pod,
            "p",
            "ns",
            {"metadata": {"resourceVersion": "1", "labels": {"x": "y"}}},
        )
    assert stale.value.status == 409

    binding = {"metadata": {"name": "p", "uid": "wrong"}, "target": {"kind": "Node", "name": "n1"}}
    with pytest.raises(ApiException) as mismatch:
        await asyncio.to_thread(
            core.create_namespaced_pod_binding, "p", "ns", binding, _preload_content=False
        )
    assert mismatch.value.status == 409
    binding["metadata"]["uid"] = created.metadata.uid
    await asyncio.to_thread(
        core.create_namespaced_pod_binding, "p", "ns", binding, _preload_content=False
    )
    with pytest.raises(ApiException) as twice:
        await asyncio.to_thread(
            core.create_namespaced_pod_binding, "p", "ns", binding, _preload_content=False
        )
    assert twice.value.status == 409
    raw = await asyncio.to_thread(core.read_namespaced_pod, "p", "ns", _preload_content=False)
    assert json.loads(raw.data)["spec"]["nodeName"] == "n1"
    with pytest.raises(ApiException) as missing:
        await asyncio.to_thread(core.read_namespaced_pod, "nope", "ns")
    assert missing.value.status == 404


async def test_watch_replays_from_a_resource_version_and_expires_old_ones(
    api: FakeApiServer,
) -> None:
    core = core_api(api)
    await api.create_pod({"metadata": {"name": "a", "namespace": "ns"}})
    await api.create_pod({"metadata": {"name": "b", "namespace": "ns"}})
    await api.set_phase("ns", "a", "Succeeded")
    await api.delete_pod("ns", "b")

    def watch_from(version: str) -> list[tuple[str, str]]:
        watcher = k8s_watch.Watch()
        seen = []
        for event in watcher.stream(
            core.list_pod_for_all_namespaces, resource_version=version, timeout_seconds=1
        ):
            seen.append((event["type"], event["raw_object"]["metadata"].get("name", "")))
        return seen

    assert await asyncio.to_thread(watch_from, "1") == [
        ("ADDED", "b"),
        ("MODIFIED", "a"),
        ("DELETED", "b"),
    ]
    for i in range(1100):
        await api.create_pod({"metadata": {"name": f"x{i}", "namespace": "ns"}})
    with pytest.raises(ApiException) as gone:  # the client turns the ERROR event into 410
        await asyncio.to_thread(watch_from, "1")
    assert gone.value.status == 410


async def test_events_and_nodes(api: FakeApiServer) -> None:
    core = core_api(api)
    api.add_node("n1", {"gpu": "yes"})
    node = await asyncio.to_thread(core.read_node, "n1")
    assert node.metadata.labels == {"gpu": "yes"}
    event = {
        "metadata": {"generateName": "p."},
        "involvedObject": {"kind": "Pod", "name": "p", "namespace": "ns"},
        "reason": "R",
        "message": "m",
    }
    await asyncio.to_thread(core.create_namespaced_event, "ns", event, _preload_content=False)
    (kept,) = api.events
    assert kept["reason"] == "R" and kept["metadata"]["name"].startswith("p.")


BOUND_RUNNING = "spec.nodeName!=,status.phase!=Succeeded,status.phase!=Failed"


async def test_field_selectors_list_and_watch_as_the_watch_cache_does(api: FakeApiServer) -> None:
    """A pod is ADDED to a selected watch when it starts to match (bound), MODIFIED while it
    matches, DELETED (with its last matching content) when it stops (ended) or is deleted."""
    core = core_api(api)
    listed = await asyncio.to_thread(core.list_pod_for_all_namespaces)
    start = listed.metadata.resource_version
    await api.create_pod({"metadata": {"name": "a", "namespace": "ns"}})
    await api.create_pod({"metadata": {"name": "b", "namespace": "ns"}})
    for name in ("a", "b"):
        binding = {"target": {"kind": "Node", "name": "n1"}, "metadata": {"name": name}}
        await asyncio.to_thread(
            core.create_namespaced_pod_binding, name, "ns", binding, _preload_content=False
        )
    await api.set_phase("ns", "a", "Running")
    await api.set_phase("ns", "a", "Succeeded")
    await api.delete_pod("ns", "b")

    def watch(selector: str) -> list[tuple[str, str, str]]:
        seen = []
        for event in k8s_watch.Watch().stream(
            core.list_pod_for_all_namespaces, resource_version=start, timeout_seconds=1,
            field_selector=selector,
        ):  # fmt: skip
            raw = event["raw_object"]
            seen.append((event["type"], raw["metadata"]["name"],
                         (raw.get("status") or {}).get("phase", "")))  # fmt: skip
        return seen

    assert await asyncio.to_thread(watch, BOUND_RUNNING) == [
        ("ADDED", "a", "Pending"),
        ("ADDED", "b", "Pending"),
        ("MODIFIED", "a", "Running"),
        ("DELETED", "a", "Running"),  # the last content that matched
        ("DELETED", "b", "Pending"),
    ]
    await api.create_pod({"metadata": {"name": "c", "namespace": "ns"}, "spec": {"nodeName": "n2"}})
    selected = await asyncio.to_thread(
        core.list_pod_for_all_namespaces, field_selector="spec.nodeName=n2"
    )
    assert [p.metadata.name for p in selected.items] == ["c"]
    with pytest.raises(ApiException) as unknown:
        await asyncio.to_thread(core.list_pod_for_all_namespaces, field_selector="spec.image=x")
    assert unknown.value.status == 400


async def test_nodes_watch_with_allocatable(api: FakeApiServer) -> None:
    core = core_api(api)
    start = (await asyncio.to_thread(core.list_node)).metadata.resource_version
    api.add_node("n1", allocatable={"cpu": "8", "memory": "32Gi", "pods": "110"})
    await api.set_allocatable("n1", {"cpu": "7", "memory": "32Gi", "pods": "110"})
    await api.delete_node("n1")

    def watch() -> list[tuple[str, str]]:
        return [
            (event["type"], event["raw_object"]["status"]["allocatable"]["cpu"])
            for event in k8s_watch.Watch().stream(
                core.list_node, resource_version=start, timeout_seconds=1
            )
        ]

    assert await asyncio.to_thread(watch) == [("ADDED", "8"), ("MODIFIED", "7"), ("DELETED", "7")]
