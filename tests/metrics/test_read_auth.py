"""The metrics service's read API by permission: two tenants each see only their own pods on
every endpoint (picture, pod, pending, live stream, dashboard), a cluster-admin sees all,
/metrics is for Prometheus, health stays open; tokens are checked with the fake API server.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest

from services.common import subjects
from services.common.bus import Bus
from services.common.embedded_nats import EmbeddedNats
from services.common.schemas import (
    AllocationEvent,
    ContainerAllocation,
    GpuSlice,
    PendingPod,
    PodAllocation,
)
from services.metrics.service import MetricsService
from services.simulators.apiserver import FakeApiServer
from tests.kubefake.tenants import ADMIN, ALICE, BOB, NOBODY, PROMETHEUS, bearer, tenant_api
from tests.metrics.helpers import INVENTORY, announce, settings, wait_for
from tests.metrics.test_api_stream import next_event

READ_PATHS = ["/api/v1/picture", "/api/v1/pending", "/api/v1/events", "/api/v1/pods/team-a/a1"]


def allocation(namespace: str, name: str, uuid: str, index: int) -> PodAllocation:
    return PodAllocation(
        namespace=namespace, name=name, uid=f"uid-{name}", node="node-a",
        containers={"main": ContainerAllocation(container="main", claimed=True, slices=[
            GpuSlice(uuid=uuid, index=index, memory_mib=10240, cores=30)])},
    )  # fmt: skip


async def bind(bus: Bus, metrics: MetricsService, pod: PodAllocation) -> None:
    event = AllocationEvent(kind="bound", allocation=pod)
    await bus.publish(subjects.alloc_events("node-a"), event)
    await wait_for(lambda: pod.uid in metrics.picture.pods)


@pytest.fixture
async def api() -> AsyncIterator[FakeApiServer]:
    async with tenant_api() as server:
        yield server


@pytest.fixture
async def metrics(nats_server: EmbeddedNats, api: FakeApiServer) -> AsyncIterator[MetricsService]:
    service = MetricsService(settings(nats_server.url, read_auth="kubernetes",
                                      auth_api_url=api.url))  # fmt: skip
    await service.start()
    yield service
    await service.stop()


@pytest.fixture
async def tenants(metrics: MetricsService, bus: Bus) -> MetricsService:
    """team-a's pod on GPU 0, team-b's on GPU 1, and one pending pod in each namespace."""
    await announce(bus, metrics, INVENTORY)
    await bind(bus, metrics, allocation("team-a", "a1", "GPU-a0", 0))
    await bind(bus, metrics, allocation("team-b", "b1", "GPU-a1", 1))
    for namespace in ("team-a", "team-b"):
        pending = PendingPod(namespace=namespace, name="waits", uid=f"uid-{namespace}-waits")
        await bus.publish(subjects.alloc_pending(), pending)
    await wait_for(lambda: len(metrics.picture.pending) == 2)
    return metrics


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as session:
        yield session


async def get(http: aiohttp.ClientSession, url: str, token: str | None) -> tuple[int, Any]:
    headers = bearer(token) if token else {}
    async with http.get(url, headers=headers, allow_redirects=False) as response:
        if response.content_type == "text/event-stream":
            return response.status, await next_event(response.content)
        body = await response.read()
        return response.status, json.loads(body) if body.startswith((b"{", b"[")) else body


def namespaces_of(picture: dict[str, Any]) -> set[str]:
    found = {p["namespace"] for p in picture["pods"]} | {p["namespace"] for p in picture["pending"]}
    for node in picture["nodes"]:
        for gpu in node["gpus"]:
            found |= {s["namespace"] for s in gpu["slices"]}
    return found


async def test_no_token_or_a_bad_one_is_401_and_health_stays_open(
    tenants: MetricsService, http: aiohttp.ClientSession
) -> None:
    for path in [*READ_PATHS, "/metrics"]:
        for token in (None, "forged"):
            status, body = await get(http, tenants.url + path, token)
            assert status == 401, (path, token, body)
            assert "token" in body["error"]
    async with http.get(tenants.url + "/api/v1/picture",
                        headers={"Authorization": "Basic YWxpY2U6eA=="}) as response:  # fmt: skip
        assert response.status == 401 and response.headers["WWW-Authenticate"].startswith("Bearer")
    for path in ("/healthz", "/livez"):
        assert (await get(http, tenants.url + path, None))[0] == 200
    status, _ = await get(http, tenants.url + "/", None)  # the dashboard asks to sign in
    assert status == 303


@pytest.mark.parametrize(("token", "mine", "theirs"), [
    (ALICE, "team-a", "team-b"), (BOB, "team-b", "team-a"),
])  # fmt: skip
async def test_each_tenant_sees_only_its_own_namespace_everywhere(
    tenants: MetricsService, http: aiohttp.ClientSession, token: str, mine: str, theirs: str
) -> None:
    status, picture = await get(http, tenants.url + "/api/v1/picture", token)
    assert status == 200 and namespaces_of(picture) == {mine}
    assert [g["uuid"] for n in picture["nodes"] for g in n["gpus"]] == [
        "GPU-a0" if mine == "team-a" else "GPU-a1"]  # fmt: skip
    assert picture["totals"]["pods"] == 1 and picture["totals"]["memory_allocated_mib"] == 10240
    assert theirs not in json.dumps(picture)

    status, pending = await get(http, tenants.url + "/api/v1/pending", token)
    assert status == 200 and [p["namespace"] for p in pending] == [mine]

    status, (event, snapshot) = await get(http, tenants.url + "/api/v1/events", token)
    assert status == 200 and event == "snapshot" and namespaces_of(snapshot) == {mine}

    own = "a1" if mine == "team-a" else "b1"
    other = "b1" if mine == "team-a" else "a1"
    status, pod = await get(http, f"{tenants.url}/api/v1/pods/{mine}/{own}", token)
    assert status == 200 and pod["namespace"] == mine
    status, body = await get(http, f"{tenants.url}/api/v1/pods/{theirs}/{other}", token)
    assert status == 403 and f'namespace "{theirs}"' in body["error"]
    status, _ = await get(http, f"{tenants.url}/api/v1/pods/{theirs}/nope", token)
    assert status == 403  # not 404: whether a pod exists there is not the caller's business

    assert (await get(http, tenants.url + "/metrics", token))[0] == 403


async def test_a_cluster_admin_sees_every_namespace(
    tenants: MetricsService, http: aiohttp.ClientSession
) -> None:
    status, picture = await get(http, tenants.url + "/api/v1/picture", ADMIN)
    assert status == 200 and namespaces_of(picture) == {"team-a", "team-b"}
    assert picture["totals"]["pods"] == 2
    status, pod = await get(http, tenants.url + "/api/v1/pods/team-b/b1", ADMIN)
    assert status == 200 and pod["name"] == "b1"
    assert (await get(http, tenants.url + "/metrics", ADMIN))[0] == 200


async def test_a_user_without_rights_is_403(
    tenants: MetricsService, http: aiohttp.ClientSession
) -> None:
    for path in READ_PATHS:
        status, body = await get(http, tenants.url + path, NOBODY)
        assert status == 403 and '"nobody"' in body["error"], path
    assert (await get(http, tenants.url + "/metrics", NOBODY))[0] == 403


async def test_metrics_are_for_prometheus_and_nothing_else(
    tenants: MetricsService, http: aiohttp.ClientSession
) -> None:
    status, body = await get(http, tenants.url + "/metrics", PROMETHEUS)
    assert status == 200 and b"vgpu_" in body
    for path in READ_PATHS:
        assert (await get(http, tenants.url + path, PROMETHEUS))[0] == 403, path


async def test_the_dashboard_signs_in_with_a_token_cookie(
    tenants: MetricsService, http: aiohttp.ClientSession
) -> None:
    async with http.post(tenants.url + "/login", data={"token": "forged"},
                         allow_redirects=False) as response:  # fmt: skip
        assert response.status == 401 and "not valid" in await response.text()
    async with aiohttp.ClientSession(cookie_jar=aiohttp.CookieJar(unsafe=True)) as browser:
        async with browser.post(tenants.url + "/login", data={"token": ALICE},
                                allow_redirects=False) as response:  # fmt: skip
            assert response.status == 303 and response.headers["Location"] == "/"
            cookie = response.cookies["vgpu_token"]
            assert cookie["httponly"] and cookie["samesite"] == "Strict"
        async with browser.get(tenants.url + "/", allow_redirects=False) as response:
            assert response.status == 200 and "<title>vgpu" in await response.text()
        async with browser.get(tenants.url + "/api/v1/picture") as response:
            assert response.status == 200 and namespaces_of(await response.json()) == {"team-a"}
        async with browser.post(tenants.url + "/logout", allow_redirects=False) as response:
            assert response.status == 303
        async with browser.get(tenants.url + "/api/v1/picture") as response:
            assert response.status == 401


async def test_a_tenants_live_stream_never_carries_another_namespace(
    tenants: MetricsService, bus: Bus, http: aiohttp.ClientSession
) -> None:
    async with http.get(tenants.url + "/api/v1/events", headers=bearer(ALICE)) as response:
        assert response.status == 200
        event, snapshot = await next_event(response.content)
        assert namespaces_of(snapshot) == {"team-a"}
        await bind(bus, tenants, allocation("team-b", "b2", "GPU-a1", 1))
        await bind(bus, tenants, allocation("team-a", "a2", "GPU-a0", 0))
        seen: set[str] = set()
        while "a2" not in seen:
            event, batch = await next_event(response.content)
            assert event == "snapshot" and namespaces_of(batch) == {"team-a"}, batch
            assert "b2" not in json.dumps(batch)
            seen = {p["name"] for p in batch["pods"]}


async def test_an_unreachable_api_server_is_503(
    tenants: MetricsService, api: FakeApiServer, http: aiohttp.ClientSession
) -> None:
    await api.stop()
    status, body = await get(http, tenants.url + "/api/v1/picture", ADMIN)
    assert status == 503 and api.url in body["error"]
    assert (await get(http, tenants.url + "/healthz", None))[0] == 200
    for path in [*READ_PATHS, "/metrics"]:  # nothing was cached: every request fails closed
        assert (await get(http, tenants.url + path, PROMETHEUS))[0] == 503, path
