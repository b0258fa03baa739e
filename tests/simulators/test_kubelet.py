"""The kubelet simulator against the real node agent, over real sockets and HTTP."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import aiohttp
import grpc
import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from services.common.embedded_nats import EmbeddedNats
from services.common.kubelet import deviceplugin_v1beta1_pb2 as pb
from services.common.kubelet import deviceplugin_v1beta1_pb2_grpc as pb_grpc
from services.common.kubelet import podresources_v1_pb2 as pr
from services.common.kubelet import podresources_v1_pb2_grpc as pr_grpc
from services.common.tracing import current_traceparent, tracer
from services.nodeagent.service import NodeAgent
from services.simulators.kubelet import KubeletSimulator
from services.simulators.kubelet_pods import PodError
from tests.nodeagent.harness import (
    RESOURCE,
    NodeDirs,
    agent_settings,
    gpu_pod,
    kubelet_settings,
    node_dirs,
    running_node,
)

Node = tuple[KubeletSimulator, NodeAgent, NodeDirs]


@pytest.fixture
async def dirs() -> AsyncIterator[NodeDirs]:
    async with node_dirs() as made:
        yield made


@pytest.fixture
async def node(nats_server: EmbeddedNats, dirs: NodeDirs) -> AsyncIterator[Node]:
    """2 GPUs x 2 device IDs each: small enough to run out of devices."""
    async with running_node(nats_server.url, dirs, split_count=2) as (kubelet, agent):
        yield kubelet, agent, dirs


@pytest.fixture
async def lone_kubelet(dirs: NodeDirs) -> AsyncIterator[KubeletSimulator]:
    kubelet = KubeletSimulator(kubelet_settings(dirs))
    await kubelet.start()
    yield kubelet
    await kubelet.stop()


@pytest.fixture
async def pod_resources(dirs: NodeDirs) -> AsyncIterator[pr_grpc.PodResourcesListerStub]:
    async with grpc.aio.insecure_channel(f"unix://{dirs.pod_resources_socket}") as channel:
        yield pr_grpc.PodResourcesListerStub(channel)


def gpus_of(agent: NodeAgent) -> list[str]:
    return [gpu.uuid for gpu in agent.gpus]


async def test_registration_gives_the_resource_its_devices_and_topology(node: Node) -> None:
    kubelet, agent, _ = node
    a, b = gpus_of(agent)
    assert await kubelet.wait_for_resource(RESOURCE, 1) == [
        f"{a}::0",
        f"{a}::1",
        f"{b}::0",
        f"{b}::1",
    ]
    assert set(kubelet.devices(RESOURCE).values()) == {"Healthy"}
    assert kubelet.topology(RESOURCE, f"{a}::1") == [0]
    assert kubelet.topology(RESOURCE, f"{b}::0") == [1]
    assert kubelet.resources()[RESOURCE] == {
        "connected": True,
        "devices": 4,
        "healthy": 4,
        "allocated": 0,
    }


@pytest.mark.parametrize(
    ("request_fields", "message"),
    [
        ({"version": "v1alpha1"}, "requested device plugin version 'v1alpha1' is not supported"),
        ({"endpoint": "/abs/vgpu.sock"}, "endpoint '/abs/vgpu.sock' must be the plugin socket"),
        ({"endpoint": ""}, "endpoint '' must be the plugin socket"),
        ({"resource_name": "gpu"}, "the ResourceName 'gpu' is invalid"),
        ({"resource_name": "kubernetes.io/gpu"}, "the ResourceName 'kubernetes.io/gpu' is invalid"),
    ],
)
async def test_register_rejects_bad_requests(
    lone_kubelet: KubeletSimulator, request_fields: dict[str, str], message: str
) -> None:
    fields = {"version": "v1beta1", "endpoint": "vgpu.sock", "resource_name": RESOURCE}
    fields.update(request_fields)
    async with grpc.aio.insecure_channel(f"unix://{lone_kubelet.kubelet_socket}") as channel:
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await pb_grpc.RegistrationStub(channel).Register(
                pb.RegisterRequest(**fields), timeout=5
            )
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert message in (caught.value.details() or "")
    assert lone_kubelet.resources() == {}


async def test_register_fails_when_the_plugin_socket_does_not_answer(
    lone_kubelet: KubeletSimulator,
) -> None:
    request = pb.RegisterRequest(version="v1beta1", endpoint="missing.sock", resource_name=RESOURCE)
    async with grpc.aio.insecure_channel(f"unix://{lone_kubelet.kubelet_socket}") as channel:
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await pb_grpc.RegistrationStub(channel).Register(request, timeout=10)
    assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "cannot reach device plugin" in (caught.value.details() or "")


async def test_admit_collects_the_allocate_response_and_records_devices(
    node: Node, dirs: NodeDirs, pod_resources: pr_grpc.PodResourcesListerStub
) -> None:
    kubelet, agent, _ = node
    a, b = gpus_of(agent)
    result = await kubelet.admit(gpu_pod("web", {"main": 2, "side": 0}, namespace="apps"))
    assert result.admitted and result.uid == "uid-web"
    main, side = result.containers
    assert (main.name, main.init, side.device_ids) == ("main", False, [])
    assert main.device_ids == [f"{a}::0", f"{b}::0"]  # preferred pick: distinct GPUs
    assert main.envs["NVIDIA_VISIBLE_DEVICES"] == f"{a},{b}"
    # The records keep the Allocate response's mounts as they are, read-only flags included.
    assert [(m.container_path, m.read_only) for m in main.mounts] == [
        ("/var/run/vgpu", True),
        ("/var/run/vgpu-state", False),
    ]
    assert all(m.host_path.startswith(str(dirs.container_root)) for m in main.mounts)

    listed = await pod_resources.List(pr.ListPodResourcesRequest(), timeout=5)
    (pod,) = listed.pod_resources
    assert (pod.namespace, pod.name) == ("apps", "web")
    assert [c.name for c in pod.containers] == ["main", "side"]
    # One entry per NUMA node, as the kubelet groups a container's devices.
    assert [
        (d.resource_name, list(d.device_ids), [n.ID for n in d.topology.nodes])
        for d in pod.containers[0].devices
    ] == [(RESOURCE, [f"{a}::0"], [0]), (RESOURCE, [f"{b}::0"], [1])]
    assert list(pod.containers[1].devices) == []

    got = await pod_resources.Get(pr.GetPodResourcesRequest(pod_name="web", pod_namespace="apps"))
    assert got.pod_resources == pod
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await pod_resources.Get(pr.GetPodResourcesRequest(pod_name="nope", pod_namespace="apps"))
    assert caught.value.code() == grpc.StatusCode.NOT_FOUND
    assert caught.value.details() == "pod nope in namespace apps not found"

    allocatable = await pod_resources.GetAllocatableResources(pr.AllocatableResourcesRequest())
    assert [(list(d.device_ids), d.topology.nodes[0].ID) for d in allocatable.devices] == [
        ([f"{a}::0"], 0),
        ([f"{a}::1"], 0),
        ([f"{b}::0"], 1),
        ([f"{b}::1"], 1),
    ]


async def test_admission_fails_when_devices_run_out_and_records_nothing(
    node: Node, pod_resources: pr_grpc.PodResourcesListerStub
) -> None:
    kubelet, _, _ = node
    assert (await kubelet.admit(gpu_pod("first", {"main": 3}))).admitted
    # `ok` gets the last device, `greedy` finds none: the whole pod fails and holds nothing.
    failed = await kubelet.admit(gpu_pod("second", {"ok": 1, "greedy": 1}))
    assert not failed.admitted and failed.containers == []
    assert failed.error == (
        "UnexpectedAdmissionError: Allocate failed due to requested number of devices "
        "unavailable for nvidia.com/gpu. Requested: 1, Available: 0, which is unexpected"
    )
    listed = await pod_resources.List(pr.ListPodResourcesRequest(), timeout=5)
    assert [p.name for p in listed.pod_resources] == ["first"]
    assert kubelet.resources()[RESOURCE]["allocated"] == 3

    third = await kubelet.admit(gpu_pod("third", {"main": 1}))
    assert third.admitted, third.error
    assert not (await kubelet.admit(gpu_pod("fourth", {"main": 1}))).admitted
    assert kubelet.remove("default", "first") is True
    assert kubelet.remove("default", "first") is False
    assert (await kubelet.admit(gpu_pod("fourth", {"main": 3}))).admitted


async def test_same_pod_twice_is_refused(node: Node) -> None:
    kubelet, _, _ = node
    assert (await kubelet.admit(gpu_pod("once", {"main": 1}))).admitted
    again = await kubelet.admit(gpu_pod("once", {"main": 1}))
    assert again.error == "pod default/once is already admitted on node node-a"


async def test_init_container_devices_are_reused_by_app_containers(
    node: Node, pod_resources: pr_grpc.PodResourcesListerStub
) -> None:
    kubelet, _, _ = node
    pod = gpu_pod("job", {"main": 1}, init_containers={"prepare": 2})
    result = await kubelet.admit(pod)
    assert result.admitted, result.error
    prepare, main = result.containers
    assert prepare.init and not main.init
    assert set(main.device_ids) < set(prepare.device_ids)
    assert kubelet.resources()[RESOURCE]["allocated"] == 2
    (listed,) = (await pod_resources.List(pr.ListPodResourcesRequest())).pod_resources
    assert [c.name for c in listed.containers] == ["main"]  # plain init containers are not listed


async def test_sidecars_keep_their_devices_and_are_listed(
    node: Node, pod_resources: pr_grpc.PodResourcesListerStub
) -> None:
    kubelet, _, _ = node
    pod = gpu_pod("svc", {"main": 1}, init_containers={"proxy": 1})
    pod["spec"]["initContainers"][0]["restartPolicy"] = "Always"
    result = await kubelet.admit(pod)
    assert result.admitted, result.error
    proxy, main = result.containers
    assert set(proxy.device_ids).isdisjoint(main.device_ids)
    (listed,) = (await pod_resources.List(pr.ListPodResourcesRequest())).pod_resources
    assert [c.name for c in listed.containers] == ["proxy", "main"]


async def test_plugin_missing_fails_admission_but_parameter_resources_are_ignored(
    lone_kubelet: KubeletSimulator,
) -> None:
    missing = await lone_kubelet.admit(gpu_pod("lost", {"main": 1}))
    assert "no device plugin serves nvidia.com/gpu on node node-a" in missing.error
    pod = gpu_pod("param", {"main": 0})
    pod["spec"]["containers"][0]["resources"] = {"limits": {"nvidia.com/gpumem": "4096"}}
    assert (await lone_kubelet.admit(pod)).admitted


async def test_plugin_gone_after_agent_stops(node: Node) -> None:
    kubelet, agent, _ = node
    await agent.stop()
    for _ in range(100):  # the ListAndWatch stream ends as the agent stops
        if not kubelet.resources()[RESOURCE]["connected"]:
            break
        await asyncio.sleep(0.02)
    result = await kubelet.admit(gpu_pod("late", {"main": 1}))
    assert "no device plugin serves nvidia.com/gpu" in result.error


async def test_allocate_error_fails_admission_with_the_plugin_message(
    node: Node, dirs: NodeDirs
) -> None:
    kubelet, _, _ = node
    dirs.container_root.parent.mkdir(parents=True, exist_ok=True)
    dirs.container_root.write_text("not a directory")  # the agent cannot make the container dir
    result = await kubelet.admit(gpu_pod("doomed", {"main": 1}))
    assert result.error.startswith("UnexpectedAdmissionError: Allocate failed due to rpc error: ")
    assert "code = INTERNAL desc = cannot prepare container directory" in result.error
    assert kubelet.pods() == []


@pytest.mark.parametrize(
    ("pod", "message"),
    [
        ([], "a pod must be a JSON object"),
        ({"spec": {"containers": [{"name": "c"}]}}, "metadata.name is missing"),
        ({"metadata": {"name": "p"}}, "spec is missing"),
        ({"metadata": {"name": "p"}, "spec": {"containers": []}}, "at least one container"),
        ({"metadata": {"name": "p"}, "spec": {"containers": [{}]}}, "container has no name"),
        (
            {
                "metadata": {"name": "p"},
                "spec": {"containers": [{"name": "c", "resources": {"limits": {RESOURCE: "1.5"}}}]},
            },
            "spec.containers[0] (c) nvidia.com/gpu: extended resources must be whole numbers",
        ),
        (
            {
                "metadata": {"name": "p"},
                "spec": {
                    "containers": [
                        {
                            "name": "c",
                            "resources": {"limits": {RESOURCE: 1}, "requests": {RESOURCE: 2}},
                        }
                    ]
                },
            },
            "requests must equal limits",
        ),
    ],
)
async def test_malformed_pods_are_named(
    lone_kubelet: KubeletSimulator, pod: object, message: str
) -> None:
    with pytest.raises(PodError) as caught:
        await lone_kubelet.admit(pod)
    assert message in str(caught.value)


async def test_http_api(node: Node, spans: InMemorySpanExporter) -> None:
    kubelet, _, _ = node
    async with aiohttp.ClientSession(base_url=kubelet.url) as http:
        async with http.get("/healthz") as response:
            health = await response.json()
        assert response.status == 200
        assert health["node"] == "node-a" and health["resources"][RESOURCE]["devices"] == 4

        async with http.post("/pods", data=b"{not json") as response:
            assert response.status == 400
            assert "malformed JSON" in (await response.json())["error"]
        async with http.post("/pods", json={"metadata": {}}) as response:
            assert response.status == 400
            assert (await response.json())["error"] == "malformed pod: metadata.name is missing"

        with tracer("test").start_as_current_span("vgpu submit") as submit:
            headers = {"traceparent": current_traceparent()}
        async with http.post("/pods", json=gpu_pod("a", {"main": 1}), headers=headers) as response:
            admitted = await response.json()
        assert response.status == 200 and "error" not in admitted
        (container,) = admitted["containers"]
        assert set(container) == {
            "name", "init", "device_ids", "envs", "mounts", "devices", "annotations",
            "cdi_devices", "container_env",
        }  # fmt: skip
        assert [(m["container_path"], m["read_only"]) for m in container["mounts"]] == [
            ("/var/run/vgpu", True),
            ("/var/run/vgpu-state", False),
        ]

        async with http.post("/pods", json=gpu_pod("b", {"main": 4})) as response:
            refused = await response.json()
        assert response.status == 200
        assert "Requested: 4, Available: 3" in refused["error"] and "containers" not in refused

        async with http.get("/pods") as response:
            assert [p["name"] for p in await response.json()] == ["a"]
        async with http.delete("/pods/default/a") as response:
            assert response.status == 200
        async with http.delete("/pods/default/a") as response:
            assert response.status == 404
            assert "default/a" in (await response.json())["error"]
        async with http.get("/pods") as response:
            assert await response.json() == []

    finished = spans.get_finished_spans()
    (admit,) = [s for s in finished if s.name == "kubelet admit default/a"]
    assert admit.parent is not None and admit.parent.span_id == submit.get_span_context().span_id
    # The traceparent rides in gRPC metadata into the plugin's spans.
    preferred = [s for s in finished if s.name == "device-plugin GetPreferredAllocation"]
    assert any(
        s.parent is not None and s.parent.span_id == admit.context.span_id for s in preferred
    )


async def test_a_restarted_agent_registers_again_with_the_same_ids(
    nats_server: EmbeddedNats, node: Node, dirs: NodeDirs
) -> None:
    kubelet, agent, _ = node
    before = await kubelet.wait_for_resource(RESOURCE, 1)
    await agent.stop()
    again = NodeAgent(agent_settings(nats_server.url, dirs, split_count=2))
    await again.start()
    try:
        await again.wait_registered(10)
        assert kubelet.resources()[RESOURCE]["connected"]
        assert await kubelet.wait_for_resource(RESOURCE, 1) == before
        assert (await kubelet.admit(gpu_pod("after", {"main": 1}))).admitted
    finally:
        await again.stop()
