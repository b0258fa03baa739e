"""TokenReview and SubjectAccessReview on the fake API server, as the `kubernetes` client's
own models send and read them, and the users file they are answered from."""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from kubernetes import client as k8s

from services.simulators.apiserver import FakeApiServer
from services.simulators.kube_users import Users, UsersError, UsersFileSource, write_users
from tests.kubefake.tenants import ALICE, tenant_api, tenants


@pytest.fixture
async def api() -> AsyncIterator[FakeApiServer]:
    async with tenant_api() as server:
        yield server


def apis(api: FakeApiServer) -> tuple[k8s.AuthenticationV1Api, k8s.AuthorizationV1Api]:
    configuration = k8s.Configuration()
    configuration.host = api.url
    client = k8s.ApiClient(configuration)
    return k8s.AuthenticationV1Api(client), k8s.AuthorizationV1Api(client)


async def test_token_review_with_the_clients_models(api: FakeApiServer) -> None:
    authn, _ = apis(api)
    review = k8s.V1TokenReview(spec=k8s.V1TokenReviewSpec(token=ALICE, audiences=["vgpu"]))
    answer = await asyncio.to_thread(authn.create_token_review, review)
    assert answer.status.authenticated and answer.status.user.username == "alice"
    assert "system:authenticated" in answer.status.user.groups
    assert answer.status.audiences == ["vgpu"]
    bad = k8s.V1TokenReview(spec=k8s.V1TokenReviewSpec(token="nope"))
    answer = await asyncio.to_thread(authn.create_token_review, bad)
    assert not answer.status.authenticated and answer.status.error


@pytest.mark.parametrize(("user", "namespace", "allowed"), [
    ("alice", "team-a", True), ("alice", "team-b", False), ("alice", None, False),
    ("admin", None, True), ("nobody", "team-a", False), ("mallory", "team-a", False),
])  # fmt: skip
async def test_subject_access_review_with_the_clients_models(
    api: FakeApiServer, user: str, namespace: str | None, allowed: bool
) -> None:
    _, authz = apis(api)
    attributes = k8s.V1ResourceAttributes(verb="list", resource="pods", namespace=namespace)
    review = k8s.V1SubjectAccessReview(
        spec=k8s.V1SubjectAccessReviewSpec(user=user, resource_attributes=attributes)
    )
    answer = await asyncio.to_thread(authz.create_subject_access_review, review)
    assert answer.status.allowed is allowed


async def test_non_resource_urls(api: FakeApiServer) -> None:
    _, authz = apis(api)

    async def may_get(user: str, path: str) -> bool:
        spec = k8s.V1SubjectAccessReviewSpec(
            user=user, non_resource_attributes=k8s.V1NonResourceAttributes(path=path, verb="get")
        )
        review = k8s.V1SubjectAccessReview(spec=spec)
        return bool(
            (await asyncio.to_thread(authz.create_subject_access_review, review)).status.allowed
        )

    prometheus = "system:serviceaccount:monitoring:prometheus"
    assert await may_get(prometheus, "/metrics")
    assert not await may_get(prometheus, "/metrics/extra")
    assert not await may_get("alice", "/metrics")
    assert await may_get("admin", "/anything")


def test_the_users_file_is_read_again_when_it_changes(tmp_path: Path) -> None:
    path = tmp_path / "users.json"
    write_users(tenants(), path)
    assert oct(path.stat().st_mode & 0o777) == "0o600"
    source = UsersFileSource(path)
    assert source.current().find(ALICE) is not None
    users = source.current()
    users.users = [u for u in users.users if u.name != "alice"]
    write_users(users, path)
    os.utime(path, ns=(1, 1))  # a different mtime, even within the clock's resolution
    assert source.current().find(ALICE) is None


@pytest.mark.parametrize(("text", "named"), [
    (b"not json", "not a valid users file"),
    (b'{"users": [{"name": "x", "token": ""}]}', "without a token: x"),
    (b'{"users": [{"name": "x", "token": "t", "admin": true}]}', "admin"),
])  # fmt: skip
def test_a_bad_users_file_is_named(text: bytes, named: str) -> None:
    with pytest.raises(UsersError, match=named):
        Users.parse(text, "users.json")
