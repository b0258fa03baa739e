"""Plain GPU init containers, which the PodResources API never lists, get their own limit
file: the agent finds them in the kubelet's device checkpoint and claims them by pod UID from
the REAL allocator. Also what the kubelet simulator writes into that checkpoint."""

from __future__ import annotations

import base64
import json
from typing import Any

from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from services.allocator.backend import LocalClusterBackend
from services.allocator.service import Allocator
from services.common.embedded_nats import EmbeddedNats
from services.common.kubelet import deviceplugin_v1beta1_pb2 as pb
from services.nodeagent.grant import container_key
from services.nodeagent.kubelet_checkpoint import CHECKPOINT_FILE, KubeletCheckpoint
from services.simulators import kubelet_checkpoint as sim
from services.simulators.scheduler import SchedulerSimulator
from tests.nodeagent.harness import (
    NODE,
    RESOURCE,
    NodeDirs,
    gpu_pod,
    running_node,
    wait_until,
)


def container(name: str, gpus: int, memory: int, cores: int) -> dict[str, Any]:
    limits = {
        RESOURCE: str(gpus),
        "nvidia.com/gpumem": str(memory),
        "nvidia.com/gpucores": str(cores),
    }
    return {"name": name, "image": "cuda:12", "resources": {"limits": limits}}


def init_pod() -> dict[str, Any]:
    """The init container asks 1 GPU, the app container 2: the app takes the init container's
    device over and one more, so the two hold different ID sets (two directories)."""
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "prep-train", "namespace": "ml", "uid": "uid-prep-train"},
        "spec": {
            "initContainers": [container("setup", 1, 3000, 20)],
            "containers": [container("app", 2, 5000, 40)],
            "schedulerName": "vgpu-scheduler",
        },
    }


def read_limits(text: str) -> dict[str, str]:
    return dict(line.split("=", 1) for line in text.splitlines())


async def test_plain_init_container_gets_its_own_limits_through_the_checkpoint(
    nats_server: EmbeddedNats,
    allocator: Allocator,
    dirs: NodeDirs,
    spans: InMemorySpanExporter,
) -> None:
    async with running_node(nats_server.url, dirs, resolve_timeout_s=15.0) as (kubelet, _):
        await wait_until(
            lambda: allocator.cluster.node(NODE) is not None, 10, "allocator knows the node"
        )
        spec = init_pod()
        backend = allocator.backend
        assert isinstance(backend, LocalClusterBackend)
        backend.add_pod(spec)
        scheduler = SchedulerSimulator(allocator.url + "/scheduler")
        try:
            scheduled = await scheduler.schedule(spec, [NODE])
        finally:
            await scheduler.close()
        assert scheduled.node == NODE, scheduled.describe()

        result = await kubelet.admit(spec)
        assert result.admitted, result.error
        setup, app = result.containers
        assert (setup.name, len(setup.device_ids), app.name, len(app.device_ids)) == (
            "setup", 1, "app", 2,
        )  # fmt: skip
        assert set(setup.device_ids) < set(app.device_ids)  # the app took the device over

        wanted = {"setup": (1, 3000, 20), "app": (2, 5000, 40)}
        for admitted in (setup, app):
            path = dirs.container_root / container_key(admitted.device_ids) / "config" / "limits"
            await wait_until(path.exists, 15, f"limits of {admitted.name}")
            limits = read_limits(path.read_text())
            count, memory, cores = wanted[admitted.name]
            assert (limits["namespace"], limits["pod"], limits["container"]) == (
                "ml", "prep-train", admitted.name,
            )  # fmt: skip
            visible = admitted.envs["NVIDIA_VISIBLE_DEVICES"].split(",")
            assert limits["device_count"] == str(count) == str(len(visible))
            assert [limits[f"device.{i}.uuid"] for i in range(count)] == visible
            for i in range(count):
                assert limits[f"device.{i}.memory_limit_mib"] == str(memory)
                assert limits[f"device.{i}.cores"] == str(cores)

        decided = allocator.ledger.get("uid-prep-train")
        assert decided is not None
        assert decided.containers["setup"].claimed
        assert decided.containers["setup"].device_ids == setup.device_ids
        assert decided.containers["app"].claimed

        allocate_spans = await wait_until(
            lambda: (
                [
                    s
                    for s in spans.get_finished_spans()
                    if s.name == "device-plugin Allocate" and s.status.is_ok
                ]
                if len([s for s in spans.get_finished_spans() if s.name == "write limits"]) == 2
                else []
            ),
            10,
            "both Allocate spans",
        )
        sources = {
            s.attributes["k8s.container.name"]: (
                s.attributes["vgpu.resolved_by"],
                s.attributes["k8s.pod.uid"],
                s.attributes["k8s.pod.name"],
            )
            for s in allocate_spans
        }
        assert sources == {
            "setup": ("checkpoint", "uid-prep-train", "prep-train"),
            "app": ("podresources", "uid-prep-train", "prep-train"),
        }


async def test_simulator_writes_the_checkpoint_as_the_kubelet(
    nats_server: EmbeddedNats, dirs: NodeDirs
) -> None:
    path = dirs.plugin_dir / CHECKPOINT_FILE
    reader = KubeletCheckpoint(path)
    # No allocator answers the claims here: only the kubelet side is looked at.
    async with running_node(nats_server.url, dirs, resolve_timeout_s=1.0) as (kubelet, _):
        first = await kubelet.admit(gpu_pod("first", {"main": 1}))
        pod = gpu_pod("both", {"app": 2}, init_containers={"setup": 1}, uid="uid-both")
        result = await kubelet.admit(pod)
        assert first.admitted and result.admitted, (first.error, result.error)
        setup, app = result.containers

        document = json.loads(path.read_bytes())
        assert set(document) == {"Data", "Checksum"}
        raw = document["Data"]["PodDeviceEntries"]
        assert [(e["PodUID"], e["ContainerName"], e["ResourceName"]) for e in raw] == [
            ("uid-first", "main", RESOURCE),
            ("uid-both", "setup", RESOURCE),
            ("uid-both", "app", RESOURCE),
        ]
        # DeviceIDs keyed by the device's NUMA node (simulated GPU i of 2: NUMA node i).
        for entry, admitted in zip(raw[1:], (setup, app), strict=True):
            assert {i for ids in entry["DeviceIDs"].values() for i in ids} == set(
                admitted.device_ids
            )
            for numa, ids in entry["DeviceIDs"].items():
                assert all(kubelet.topology(RESOURCE, i) == [int(numa)] for i in ids)
            response = pb.ContainerAllocateResponse.FromString(base64.b64decode(entry["AllocResp"]))
            assert dict(response.envs) == admitted.envs
        registered = document["Data"]["RegisteredDevices"]
        assert sorted(registered[RESOURCE]) == sorted(kubelet.devices(RESOURCE))
        assert document["Checksum"] == sim.kubelet_checksum(
            kubelet.checkpoint_entries(), registered
        )
        holders = reader.holders(RESOURCE, set(setup.device_ids))
        assert [(h.pod_uid, h.container) for h in holders] == [("uid-both", "setup")]

        # A pod failing admission after its init container's Allocate keeps nothing.
        failing = gpu_pod("greedy", {"app": 50}, init_containers={"setup": 1})
        failed = await kubelet.admit(failing)
        assert "requested number of devices unavailable" in failed.error
        assert [e.pod_uid for e in reader.entries()] == ["uid-first", "uid-both", "uid-both"]

        await kubelet.restart()  # the checkpoint is the one file a restart keeps
        assert len(reader.entries()) == 3

        assert kubelet.remove("default", "both")
        assert [e.pod_uid for e in reader.entries()] == ["uid-first"]
        assert kubelet.remove("default", "first")
        assert reader.entries() == ()
        assert json.loads(path.read_bytes())["Data"]["PodDeviceEntries"] is None
