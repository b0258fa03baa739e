"""POST /scheduler/bind: records per container name, tells the cluster and NATS, never overbooks."""

from __future__ import annotations

import asyncio
import json

import msgspec

from services.allocator import ALLOCATION_ANNOTATION, Allocator, LocalClusterBackend, extender
from services.common.bus import Bus
from services.common.schemas import PodAllocation

from .conftest import MakeAllocator
from .helpers import (
    admit_to_cluster,
    bind_args,
    collect_events,
    container,
    eventually,
    filter_args,
    give_nodes,
    node_inventory,
    pod,
    post,
)


async def _filter_then_bind(http, allocator: Allocator, p: dict, node: str) -> dict:
    status, result = await post(http, f"{allocator.url}/scheduler/filter", filter_args(p, [node]))
    assert status == 200 and result["NodeNames"] == [node], result
    status, answer = await post(http, f"{allocator.url}/scheduler/bind", bind_args(p, node))
    assert status == 200 and set(answer) == {"Error"}
    return answer


async def test_bind_records_by_container_name_and_publishes(
    allocator: Allocator, bus: Bus, http
) -> None:
    await give_nodes(bus, allocator, node_inventory("n1", count=2))
    events = await collect_events(bus, "n1")

    p = pod(
        "train",
        [container("worker", gpus=2, mem=8000, cores=50), container("sidecar", mem=1000)],
        init=[container("setup", percent=10)],
        namespace="ml",
    )
    admit_to_cluster(allocator, p)
    assert await _filter_then_bind(http, allocator, p, "n1") == {"Error": ""}

    await eventually(lambda: len(events) == 1)
    event = events[0]
    assert event.kind == "bound"
    record = event.allocation
    assert (record.namespace, record.name, record.node) == ("ml", "train", "n1")
    assert record.uid == p["metadata"]["uid"]
    assert list(record.containers) == ["setup", "worker", "sidecar"]  # init first
    setup, worker, sidecar = (record.containers[n] for n in ("setup", "worker", "sidecar"))
    assert setup.init and not worker.init
    assert [(s.uuid, s.memory_mib) for s in setup.slices] == [("GPU-n1-0", 4096)]
    assert [(s.uuid, s.memory_mib, s.cores) for s in worker.slices] == [
        ("GPU-n1-0", 8000, 50),
        ("GPU-n1-1", 8000, 50),
    ]
    assert [s.uuid for s in sidecar.slices] == ["GPU-n1-0"]
    assert not worker.claimed and worker.device_ids == []
    assert record.traceparent.startswith("00-")

    backend = allocator.backend
    assert isinstance(backend, LocalClusterBackend)
    assert backend.node_of("ml", "train") == "n1"
    annotation = json.loads(backend.annotations_of("ml", "train")[ALLOCATION_ANNOTATION])
    assert set(annotation) == {"setup", "worker", "sidecar"}
    assert annotation["worker"][1] == {
        "uuid": "GPU-n1-1",
        "index": 1,
        "memory_mib": 8000,
        "cores": 50,
    }

    async with http.get(f"{allocator.url}/allocations") as response:
        listed = msgspec.json.decode(await response.read(), type=list[PodAllocation])
    assert listed == [record]


async def test_bind_that_no_longer_fits_is_refused(allocator: Allocator, bus: Bus, http) -> None:
    await give_nodes(bus, allocator, node_inventory("n1", count=1))
    first = pod("first", [container("main", mem=30000)])
    second = pod("second", [container("main", mem=30000)])
    admit_to_cluster(allocator, first, second)
    for p in (first, second):  # both pass: filter does not reserve
        _, result = await post(http, f"{allocator.url}/scheduler/filter", filter_args(p, ["n1"]))
        assert result["NodeNames"] == ["n1"]
    _, ok = await post(http, f"{allocator.url}/scheduler/bind", bind_args(first, "n1"))
    status, refused = await post(http, f"{allocator.url}/scheduler/bind", bind_args(second, "n1"))
    assert ok == {"Error": ""}
    assert status == 200
    assert "no longer fits" in refused["Error"] and "'main'" in refused["Error"]
    backend = allocator.backend
    assert isinstance(backend, LocalClusterBackend)
    assert backend.node_of("default", "second") is None
    assert [a.name for a in allocator.engine.allocations()] == ["first"]


class SlowCluster(LocalClusterBackend):
    """An API server with latency, so concurrent binds really interleave inside the engine."""

    async def get_pod(self, namespace: str, name: str) -> dict | None:
        await asyncio.sleep(0.05)
        return await super().get_pod(namespace, name)

    async def annotate(self, namespace: str, name: str, annotations: dict[str, str]) -> None:
        await asyncio.sleep(0.05)
        await super().annotate(namespace, name, annotations)

    async def bind(self, namespace: str, name: str, uid: str, node: str) -> None:
        await asyncio.sleep(0.05)
        await super().bind(namespace, name, uid, node)


async def test_concurrent_binds_never_overfill_a_gpu(
    make_allocator: MakeAllocator, bus: Bus, http
) -> None:
    allocator = await make_allocator(backend=SlowCluster())
    await give_nodes(bus, allocator, node_inventory("n1", count=1))
    pods = [pod(f"p{i}", [container("main", mem=25000)]) for i in range(2)]
    admit_to_cluster(allocator, *pods)
    for p in pods:  # both pass: filter does not reserve; both binds wait on the cluster
        _, result = await post(http, f"{allocator.url}/scheduler/filter", filter_args(p, ["n1"]))
        assert result["NodeNames"] == ["n1"]
    answers = await asyncio.gather(
        *(post(http, f"{allocator.url}/scheduler/bind", bind_args(p, "n1")) for p in pods)
    )
    errors = sorted(bool(answer["Error"]) for _, answer in answers)
    assert errors == [False, True]
    assert len(allocator.engine.allocations()) == 1
    assert allocator.ledger.reserved("n1")["GPU-n1-0"].memory_mib == 25000


async def test_bind_unknown_pod_or_node_is_refused(allocator: Allocator, bus: Bus, http) -> None:
    await give_nodes(bus, allocator, node_inventory("n1"))
    stranger = pod("stranger", [container("main")])
    _, result = await post(http, f"{allocator.url}/scheduler/filter", filter_args(stranger, ["n1"]))
    assert result["NodeNames"] == ["n1"]
    _, answer = await post(http, f"{allocator.url}/scheduler/bind", bind_args(stranger, "n1"))
    assert "default/stranger does not exist in the cluster" in answer["Error"]

    p = pod("p", [container("main")])
    admit_to_cluster(allocator, p)
    _, result = await post(http, f"{allocator.url}/scheduler/filter", filter_args(p, ["ghost"]))
    assert result["NodeNames"] == [] and "no GPU inventory" in result["FailedNodes"]["ghost"]
    _, answer = await post(http, f"{allocator.url}/scheduler/bind", bind_args(p, "ghost"))
    assert (
        "'ghost'" in answer["Error"] and "not passed by this extender's filter" in answer["Error"]
    )
    assert await _filter_then_bind(http, allocator, p, "n1") == {"Error": ""}


async def test_bind_retry_is_idempotent_and_other_node_refused(
    allocator: Allocator, bus: Bus, http
) -> None:
    await give_nodes(bus, allocator, node_inventory("n1"), node_inventory("n2"))
    p = pod("p", [container("main", mem=1000)])
    admit_to_cluster(allocator, p)
    assert await _filter_then_bind(http, allocator, p, "n1") == {"Error": ""}
    _, again = await post(http, f"{allocator.url}/scheduler/bind", bind_args(p, "n1"))
    assert again == {"Error": ""}
    assert allocator.ledger.reserved("n1")["GPU-n1-0"].memory_mib == 1000
    _, elsewhere = await post(http, f"{allocator.url}/scheduler/bind", bind_args(p, "n2"))
    assert "not passed by this extender's filter for node 'n2'" in elsewhere["Error"]
    _, result = await post(http, f"{allocator.url}/scheduler/filter", filter_args(p, ["n2"]))
    assert result["NodeNames"] == ["n2"]  # room there, but the pod is bound already
    _, elsewhere = await post(http, f"{allocator.url}/scheduler/bind", bind_args(p, "n2"))
    assert "already bound to node 'n1'" in elsewhere["Error"]


async def refuse(namespace: str, name: str, uid: str, node: str) -> None:
    raise RuntimeError("the API server is away")


async def test_cluster_refusal_rolls_the_reservation_back(
    allocator: Allocator, bus: Bus, http
) -> None:
    await give_nodes(bus, allocator, node_inventory("n1", count=1))
    p = pod("p", [container("main", mem=1000)])
    _, result = await post(http, f"{allocator.url}/scheduler/filter", filter_args(p, ["n1"]))
    assert result["NodeNames"] == ["n1"]
    # The pod was filtered and is in the cluster, which then refuses the binding.
    allocator.backend.add_pod(p)
    allocator.backend.bind = refuse  # type: ignore[method-assign]
    _, answer = await post(http, f"{allocator.url}/scheduler/bind", bind_args(p, "n1"))
    assert "the API server is away" in answer["Error"]
    assert allocator.engine.allocations() == []
    assert allocator.ledger.reserved("n1") == {}


async def test_pod_without_gpu_is_bound_without_a_record(allocator: Allocator, http) -> None:
    cpu_only = pod("web", [{"name": "nginx"}])
    admit_to_cluster(allocator, cpu_only)
    assert await _filter_then_bind(http, allocator, cpu_only, "any") == {"Error": ""}
    backend = allocator.backend
    assert isinstance(backend, LocalClusterBackend)
    assert backend.node_of("default", "web") == "any"
    assert allocator.engine.allocations() == []


async def test_a_filter_answered_in_slices_lets_any_passed_node_be_bound(
    allocator: Allocator, bus: Bus, http, monkeypatch
) -> None:
    """A filter over more names than one slice (extender.FILTER_SLICE, 2 here) passes nodes of
    every slice: a bind to a node of the first slice is accepted (it was refused as never
    filtered when only the last slice's passes were kept)."""
    monkeypatch.setattr(extender, "FILTER_SLICE", 2)
    names = ["n1", "n2", "n3", "n4", "n5"]
    await give_nodes(bus, allocator, *(node_inventory(n) for n in names))
    p = pod("sliced", [container("main", gpus=1, mem=1000)])
    admit_to_cluster(allocator, p)
    status, result = await post(http, f"{allocator.url}/scheduler/filter", filter_args(p, names))
    assert status == 200 and result["NodeNames"] == names, result
    status, answer = await post(http, f"{allocator.url}/scheduler/bind", bind_args(p, "n1"))
    assert status == 200 and answer == {"Error": ""}
