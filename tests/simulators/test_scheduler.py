"""The scheduler simulator against a real allocator (and against misbehaving extenders)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest
from aiohttp import ClientSession, web
from opentelemetry.trace import format_span_id, format_trace_id

from services.allocator import Allocator, AllocatorSettings, LocalClusterBackend
from services.common.bus import Bus
from services.common.embedded_nats import EmbeddedNats
from services.simulators.apiserver import FakeApiServer
from services.simulators.scheduler import (
    CycleResult,
    ExtenderConfig,
    KubeSchedulerEmulation,
    SchedulerConfig,
    SchedulerSimulator,
)
from tests.allocator.helpers import container, give_nodes, node_inventory, pod


@pytest.fixture
async def allocator(nats_server: EmbeddedNats) -> AsyncIterator[Allocator]:
    started = Allocator(
        AllocatorSettings(
            nats_url=nats_server.url, http_port=0, node_policy="binpack", gpu_policy="binpack"
        ),
        LocalClusterBackend(),
    )
    await started.start()
    yield started
    await started.stop()


@pytest.fixture
async def scheduler(allocator: Allocator) -> AsyncIterator[SchedulerSimulator]:
    simulator = SchedulerSimulator(f"{allocator.url}/scheduler", timeout_s=5.0)
    yield simulator
    await simulator.close()


def _cluster(allocator: Allocator) -> LocalClusterBackend:
    backend = allocator.backend
    assert isinstance(backend, LocalClusterBackend)
    return backend


async def test_schedules_onto_the_binpack_winner(
    allocator: Allocator, scheduler: SchedulerSimulator, bus: Bus
) -> None:
    await give_nodes(bus, allocator, node_inventory("n1", 1), node_inventory("n2", 1))
    first = pod("first", [container("main", mem=20000)])
    _cluster(allocator).add_pod(first)
    result = await scheduler.schedule(first, ["n2", "n1"])
    assert result.error == "" and result.node == "n1"  # equal scores: lowest name
    assert result.scores == {"n1": 50, "n2": 50}  # 5 x weight 1 x 10

    second = pod("second", [container("main", mem=10000)])
    _cluster(allocator).add_pod(second)
    result = await scheduler.schedule(second, ["n1", "n2"])
    assert result.node == "n1" and result.scores["n1"] > result.scores["n2"]
    assert _cluster(allocator).node_of("default", "second") == "n1"
    assert result.scheduled and result.describe() == "bound to n1"


async def test_unschedulable_pod_returns_the_reasons(
    allocator: Allocator, scheduler: SchedulerSimulator, bus: Bus
) -> None:
    await give_nodes(bus, allocator, node_inventory("n1"))
    p = pod("p", [container("main", mem=99999)])
    _cluster(allocator).add_pod(p)
    result = await scheduler.schedule(p, ["n1", "ghost"])
    assert result.node is None and result.error == ""
    assert set(result.unresolvable_nodes) == {"n1", "ghost"}
    assert "nvidia.com/gpumem: 99999" in result.unresolvable_nodes["n1"]
    assert result.describe().startswith("0/2 nodes are available: ghost: ")

    q = pod("q", [container("main")])
    result = await scheduler.schedule(q, ["ghost"])
    assert result.node is None and "no GPU inventory" in result.failed_nodes["ghost"]


async def test_bind_error_is_reported(
    allocator: Allocator, scheduler: SchedulerSimulator, bus: Bus
) -> None:
    await give_nodes(bus, allocator, node_inventory("n1"))
    p = pod("p", [container("main")])  # never added to the cluster: the bind fails
    result = await scheduler.schedule(p, ["n1"])
    assert result.node is None
    assert (
        result.error.startswith("bind to n1: ") and "does not exist in the cluster" in result.error
    )


async def test_one_trace_from_scheduler_to_allocation_record(
    allocator: Allocator, scheduler: SchedulerSimulator, bus: Bus, spans
) -> None:
    await give_nodes(bus, allocator, node_inventory("n1"))
    p = pod("traced", [container("main", mem=1000)], namespace="ml")
    _cluster(allocator).add_pod(p)
    result = await scheduler.schedule(p, ["n1"])
    assert result.node == "n1"

    finished = {span.name: span for span in spans.get_finished_spans()}
    root = finished["schedule ml/traced"]
    assert root.parent is None
    trace_id = root.context.trace_id
    for name in ("extender filter", "extender prioritize", "extender bind"):
        assert finished[name].context.trace_id == trace_id, name
        assert finished[name].kind.name == "SERVER"
    record = allocator.engine.allocations()[0]
    _, record_trace, record_span, _ = record.traceparent.split("-")
    assert record_trace == format_trace_id(trace_id)
    assert record_span == format_span_id(finished["extender bind"].context.span_id)


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@pytest.fixture
async def fake_extender() -> AsyncIterator[Callable[[Handler], Awaitable[str]]]:
    """A misbehaving extender (not vgpu's): whatever answer a test wants."""
    runners: list[web.AppRunner] = []

    async def serve(handler: Handler) -> str:
        app = web.Application()
        app.router.add_post("/scheduler/{verb}", handler)
        runner = web.AppRunner(app)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        runners.append(runner)
        return f"http://127.0.0.1:{runner.addresses[0][1]}/scheduler"

    yield serve
    for runner in runners:
        await runner.cleanup()


@pytest.mark.parametrize(
    ("status", "body", "complaint"),
    [
        (500, b'{"Error": "boom"}', "filter: HTTP 500"),
        (200, b"<html>", "filter: the answer from"),
        (200, b"[]", "not an ExtenderFilterResult"),
        (200, b'{"NodeNames": ["n1", "intruder"]}', "was not given: intruder"),
        (200, b'{"NodeNames": [], "Error": "extender says no"}', "filter: extender says no"),
    ],
)
async def test_bad_extender_answers_are_errors(
    fake_extender, status: int, body: bytes, complaint: str
) -> None:
    async def answer(_: web.Request) -> web.Response:
        return web.Response(status=status, body=body, content_type="application/json")

    simulator = SchedulerSimulator(await fake_extender(answer), timeout_s=2)
    try:
        result = await simulator.schedule(pod("p", [container("main")]), ["n1"])
    finally:
        await simulator.close()
    assert result.node is None and complaint in result.error, result.error


async def test_failed_prioritize_is_ignored_like_kube_scheduler(fake_extender) -> None:
    calls: list[str] = []

    async def answer(request: web.Request) -> web.Response:
        verb = request.match_info["verb"]
        calls.append(verb)
        assert request.headers["traceparent"].startswith("00-")
        if verb == "filter":
            return web.json_response({"NodeNames": ["b", "a"], "Error": ""})
        if verb == "prioritize":
            return web.Response(status=503)
        return web.json_response({"Error": ""})

    simulator = SchedulerSimulator(await fake_extender(answer))
    try:
        result = await simulator.schedule(pod("p", [container("main")]), ["a", "b"])
    finally:
        await simulator.close()
    assert calls == ["filter", "prioritize", "bind"]
    assert result.node == "a" and result.scores == {"b": 0, "a": 0}


async def test_unreachable_extender_is_an_error() -> None:
    simulator = SchedulerSimulator("http://127.0.0.1:1/scheduler", timeout_s=1)
    try:
        result = await simulator.schedule(pod("p", [container("main")]), ["n1"])
    finally:
        await simulator.close()
    assert result.node is None and "filter: cannot reach" in result.error


def test_is_interested_as_kube_scheduler_decides() -> None:
    """An extender entry with managedResources is called only for pods that name one in a
    container's or init container's requests or limits; one without takes every pod."""
    from services.simulators.scheduler import interested

    managed = frozenset({"nvidia.com/gpumem"})
    plain = pod("web", [{"name": "m", "resources": {"limits": {"cpu": "1"}}}])
    in_requests = pod("a", [{"name": "m", "resources": {"requests": {"nvidia.com/gpumem": 1}}}])
    in_init = pod("b", [{"name": "m"}], init=[container("i", gpus=None, mem=100)])
    assert not interested(plain, managed)
    assert interested(in_requests, managed) and interested(in_init, managed)
    assert interested(plain, frozenset())
    with pytest.raises(ValueError, match="api_url"):
        SchedulerSimulator("http://127.0.0.1:1/scheduler", managed_resources=managed)


# -- the default-profile emulation against an extender that stops answering ----------------


async def _one_cycle(
    api: FakeApiServer, extender_url: str
) -> tuple[KubeSchedulerEmulation, CycleResult]:
    """One scheduling cycle of pod `p` over nodes n1 and n2 against the extender at
    `extender_url` (httpTimeout 0.5 s): the emulation (closed) and the cycle's result."""
    for name in ("n1", "n2"):
        api.add_node(name, allocatable={"cpu": "8", "memory": "16Gi", "pods": "110"})
    extender = ExtenderConfig(
        url=extender_url,
        filter_verb="filter",
        bind_verb="bind",
        managed={"nvidia.com/gpu": True},
        timeout_s=0.5,
    )
    emulation = KubeSchedulerEmulation(api.url, SchedulerConfig(extenders=(extender,)))
    try:
        await emulation.load_nodes()
        created = await api.create_pod(pod("p", [container("main")]))
        cycle = await emulation.schedule(created)
    finally:
        await emulation.close()
    return emulation, cycle


@pytest.mark.parametrize("binds_anyway", [True, False])
async def test_a_bind_without_answer_counts_as_what_the_api_server_says(
    fake_extender, api: FakeApiServer, binds_anyway: bool
) -> None:
    """kube-scheduler learns a timed-out bind's outcome from its pod informer: bound, the pod
    is placed and its node's cache charged; not bound, the cycle failed. Never a crash."""

    async def answer(request: web.Request) -> web.Response:
        body = await request.json()
        if request.match_info["verb"] == "filter":
            return web.json_response({"NodeNames": body["NodeNames"]})
        if binds_anyway:
            async with ClientSession() as http:
                binding = {"target": {"kind": "Node", "name": body["Node"]}}
                url = f"{api.url}/api/v1/namespaces/default/pods/p/binding"
                async with http.post(url, json=binding) as response:
                    assert response.status == 201
        await asyncio.sleep(2)  # past the extender's httpTimeout
        return web.json_response({})

    emulation, cycle = await _one_cycle(api, await fake_extender(answer))
    bound = api.pods[("default", "p")]["spec"].get("nodeName")
    if binds_anyway:
        assert cycle.node == bound and bound in ("n1", "n2")
        assert emulation.columns.pods.tolist() == [int(n == bound) for n in ("n1", "n2")]
    else:
        assert cycle.node is None and bound is None
        assert emulation.columns.pods.tolist() == [0, 0]
        assert "bind to n" in cycle.reason and "no answer" in cycle.reason, cycle.reason


async def test_a_filter_without_answer_fails_the_cycle(fake_extender, api: FakeApiServer) -> None:
    async def answer(_: web.Request) -> web.Response:
        await asyncio.sleep(2)
        return web.json_response({})

    _, cycle = await _one_cycle(api, await fake_extender(answer))
    assert cycle.node is None and cycle.reason.startswith("extender filter: filter: no answer")
