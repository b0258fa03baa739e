"""Two tenants, a cluster-admin, a user without rights and Prometheus, as the fake API
server's users file knows them (TokenReview and SubjectAccessReview answer from it)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from services.simulators.apiserver import FakeApiServer
from services.simulators.kube_users import UserRights, Users

ADMIN = "admin-token"
ALICE = "alice-token"  # may list pods in team-a only
BOB = "bob-token"  # may list pods in team-b only
NOBODY = "nobody-token"  # authenticated, no rights
PROMETHEUS = "prometheus-token"  # get /metrics only
READ = ["get", "list", "watch"]


def tenants() -> Users:
    return Users([
        UserRights(name="admin", token=ADMIN, groups=["system:masters"], cluster_admin=True),
        UserRights(name="alice", token=ALICE, namespaces={"team-a": READ}),
        UserRights(name="bob", token=BOB, namespaces={"team-b": READ}),
        UserRights(name="nobody", token=NOBODY),
        UserRights(name="system:serviceaccount:monitoring:prometheus", token=PROMETHEUS,
                   non_resource_urls=["/metrics"]),
    ])  # fmt: skip


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


@asynccontextmanager
async def tenant_api() -> AsyncIterator[FakeApiServer]:
    api = FakeApiServer()
    api.users = tenants()
    await api.start()
    try:
        yield api
    finally:
        await api.stop()
