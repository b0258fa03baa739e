"""GET /allocations and /metrics on the allocator by permission, checked with the fake API
server (TokenReview, SubjectAccessReview through the `kubernetes` client); the extender's
verbs and the health endpoints are not behind the gate (issue 20 items 1-2 guard them)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest

from services.allocator import Allocator
from services.common.bus import Bus
from services.simulators.apiserver import FakeApiServer
from tests.kubefake.tenants import ADMIN, ALICE, BOB, NOBODY, PROMETHEUS, bearer, tenant_api

from .conftest import MakeAllocator
from .helpers import (
    admit_to_cluster,
    bind_args,
    container,
    filter_args,
    give_nodes,
    node_inventory,
    pod,
    post,
)


@pytest.fixture
async def api() -> AsyncIterator[FakeApiServer]:
    async with tenant_api() as server:
        yield server


@pytest.fixture
async def guarded(make_allocator: MakeAllocator, api: FakeApiServer, bus: Bus,
                  http: aiohttp.ClientSession) -> Allocator:  # fmt: skip
    """An allocator with one pod bound in team-a and one in team-b."""
    allocator = await make_allocator(read_auth="kubernetes", auth_api_url=api.url)
    await give_nodes(bus, allocator, node_inventory("n1", count=2))
    for namespace in ("team-a", "team-b"):
        p = pod(f"{namespace}-pod", [container("main", mem=1000)], namespace=namespace)
        admit_to_cluster(allocator, p)
        status, result = await post(http, f"{allocator.url}/scheduler/filter",
                                    filter_args(p, ["n1"]))  # fmt: skip
        assert status == 200 and result["NodeNames"] == ["n1"], result
        status, answer = await post(http, f"{allocator.url}/scheduler/bind", bind_args(p, "n1"))
        assert status == 200 and not answer.get("Error"), answer
    return allocator


async def get(http: aiohttp.ClientSession, url: str, token: str | None) -> tuple[int, Any]:
    async with http.get(url, headers=bearer(token) if token else {}) as response:
        if response.content_type == "application/json":
            return response.status, await response.json()
        return response.status, await response.text()


async def test_tenants_see_only_their_namespace(
    guarded: Allocator, http: aiohttp.ClientSession
) -> None:
    for token, mine in ((ALICE, "team-a"), (BOB, "team-b")):
        status, allocations = await get(http, f"{guarded.url}/allocations", token)
        assert status == 200 and [a["namespace"] for a in allocations] == [mine]
        status, narrowed = await get(http, f"{guarded.url}/allocations?namespace={mine}", token)
        assert status == 200 and narrowed == allocations
    status, body = await get(http, f"{guarded.url}/allocations?namespace=team-b", ALICE)
    assert status == 403 and 'may not list pods in namespace "team-b"' in body["error"]
    status, everything = await get(http, f"{guarded.url}/allocations", ADMIN)
    assert status == 200 and sorted(a["namespace"] for a in everything) == ["team-a", "team-b"]


async def test_no_token_bad_token_and_no_rights(
    guarded: Allocator, http: aiohttp.ClientSession
) -> None:
    for token in (None, "forged"):
        for path in ("/allocations", "/metrics"):
            assert (await get(http, guarded.url + path, token))[0] == 401, (path, token)
    assert (await get(http, f"{guarded.url}/allocations", NOBODY))[0] == 403
    assert (await get(http, f"{guarded.url}/allocations", PROMETHEUS))[0] == 403
    for path in ("/healthz", "/readyz", "/livez"):
        assert (await get(http, guarded.url + path, None))[0] == 200, path


async def test_metrics_need_get_on_the_path(
    guarded: Allocator, http: aiohttp.ClientSession
) -> None:
    status, text = await get(http, f"{guarded.url}/metrics", PROMETHEUS)
    assert status == 200 and "vgpu_allocator_extender_requests_total" in text
    assert (await get(http, f"{guarded.url}/metrics", ALICE))[0] == 403
    status, text = await get(http, f"{guarded.url}/metrics", PROMETHEUS)
    assert 'vgpu_auth_requests_total{outcome="forbidden",service="allocator"}' in text


async def test_an_unreachable_api_server_is_503(
    guarded: Allocator, api: FakeApiServer, http: aiohttp.ClientSession
) -> None:
    await api.stop()
    status, body = await get(http, f"{guarded.url}/allocations", ADMIN)
    assert status == 503 and api.url in body["error"]
