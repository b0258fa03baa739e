"""The read-API gate against the fake API server, through the real `kubernetes` client:
TokenReview, SubjectAccessReview, the bounded TTL cache, and an unreachable API server."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator

import pytest

from services.common.kube_auth import (
    AuthError,
    Gate,
    KubeReviews,
    PathCheck,
    ResourceCheck,
    TtlCache,
)
from services.simulators.apiserver import FakeApiServer
from tests.kubefake.tenants import ADMIN, ALICE, NOBODY, PROMETHEUS, tenant_api


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
async def api() -> AsyncIterator[FakeApiServer]:
    async with tenant_api() as server:
        yield server


@pytest.fixture
async def reviews(api: FakeApiServer) -> AsyncIterator[KubeReviews]:
    client = KubeReviews.connect(api_url=api.url)
    yield client
    await client.close()


async def test_a_token_names_its_user_and_a_bad_one_is_refused(reviews: KubeReviews) -> None:
    gate = Gate(reviews, "test")
    alice = await gate.authenticate(ALICE)
    assert alice.username == "alice" and "system:authenticated" in alice.groups
    with pytest.raises(AuthError) as refused:
        await gate.authenticate("forged")
    assert refused.value.status == 401 and "not valid" in refused.value.reason


async def test_rights_come_from_subject_access_reviews(reviews: KubeReviews) -> None:
    gate = Gate(reviews, "test")
    alice, admin = await gate.authenticate(ALICE), await gate.authenticate(ADMIN)
    nobody, prometheus = await gate.authenticate(NOBODY), await gate.authenticate(PROMETHEUS)
    assert await gate.allowed(alice, ResourceCheck("list", "pods", "team-a"))
    assert not await gate.allowed(alice, ResourceCheck("list", "pods", "team-b"))
    assert not await gate.allowed(alice, ResourceCheck("list", "pods"))  # cluster-wide
    assert await gate.allowed(admin, ResourceCheck("list", "pods"))
    assert not await gate.allowed(nobody, ResourceCheck("list", "pods", "team-a"))
    assert await gate.allowed(prometheus, PathCheck("get", "/metrics"))
    assert not await gate.allowed(prometheus, PathCheck("get", "/api/v1/picture"))
    assert not await gate.allowed(prometheus, ResourceCheck("list", "pods", "team-a"))
    assert not await gate.allowed(alice, PathCheck("get", "/metrics"))


async def test_answers_are_cached_until_the_ttl_ends(
    api: FakeApiServer, reviews: KubeReviews
) -> None:
    clock = Clock()
    gate = Gate(reviews, "test", ttl_s=10.0, clock=clock)
    alice = await gate.authenticate(ALICE)
    check = ResourceCheck("list", "pods", "team-a")
    assert await gate.allowed(alice, check)
    for _ in range(5):
        await gate.authenticate(ALICE)
        assert await gate.allowed(alice, check)
    assert (api.users.token_reviews, api.users.access_reviews) == (1, 1)

    # Revoked at the API server (rights gone, token rotated): still honoured until the TTL
    # ends, never after.
    user = api.users.by_name("alice")
    assert user is not None
    user.namespaces, user.token = {}, "rotated"
    clock.now += 9.0
    assert (await gate.authenticate(ALICE)).username == "alice"
    assert await gate.allowed(alice, check)
    clock.now += 1.5
    assert not await gate.allowed(alice, check)
    with pytest.raises(AuthError) as refused:
        await gate.authenticate(ALICE)
    assert refused.value.status == 401
    assert (api.users.token_reviews, api.users.access_reviews) == (2, 2)


async def test_the_same_token_asked_at_once_costs_one_review(
    api: FakeApiServer, reviews: KubeReviews
) -> None:
    gate = Gate(reviews, "test")
    callers = await asyncio.gather(*(gate.authenticate(ADMIN) for _ in range(20)))
    assert {c.username for c in callers} == {"admin"} and api.users.token_reviews == 1


def test_the_cache_is_bounded_and_drops_the_oldest() -> None:
    clock = Clock()
    cache = TtlCache(ttl_s=5.0, size=2, clock=clock)
    for key in ("a", "b", "c"):
        cache.put(key, key.upper())
    assert len(cache) == 2 and cache.get("a") == (False, None) and cache.get("c") == (True, "C")
    clock.now += 5.0
    assert cache.get("c") == (False, None) and len(cache) == 1


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


async def test_an_unreachable_api_server_is_503_never_open() -> None:
    url = f"http://127.0.0.1:{_closed_port()}"
    reviews = KubeReviews.connect(api_url=url, timeout_s=2.0)
    gate = Gate(reviews, "test")
    try:
        with pytest.raises(AuthError) as refused:
            await gate.authenticate(ADMIN)
        assert refused.value.status == 503
        assert url in refused.value.reason and "TokenReview" in refused.value.reason
        # Errors are not cached: the next request asks again (and fails again).
        with pytest.raises(AuthError):
            await gate.authenticate(ADMIN)
    finally:
        await reviews.close()
