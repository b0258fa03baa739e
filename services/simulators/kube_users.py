"""TokenReview and SubjectAccessReview answered from a small users file.

What a real API server decides with its authenticators and RBAC, the simulated ones (the fake
API server of the tests and the local API server behind `vgpu up`) decide from this file:

    {"users": [
      {"name": "admin", "token": "...", "cluster_admin": true},
      {"name": "alice", "token": "...", "groups": ["team-a"],
       "namespaces": {"team-a": ["get", "list", "watch"]}},
      {"name": "system:serviceaccount:monitoring:prometheus", "token": "...",
       "non_resource_urls": ["/metrics"]}
    ]}

- ``cluster_admin``: every verb on everything (the ``cluster-admin`` ClusterRole);
- ``namespaces``: these verbs on every resource of that namespace (a RoleBinding to a Role);
- ``cluster_verbs``: these verbs on every resource of every namespace and cluster-wide (a
  ClusterRoleBinding to, e.g., ``view``);
- ``non_resource_urls``: ``get`` on these paths (``/metrics``; a trailing ``*`` matches a
  prefix, as RBAC's nonResourceURLs do).

Every authenticated user is also in ``system:authenticated``, as on a real cluster.
"""

from __future__ import annotations

import hmac
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
from aiohttp import web


class UserRights(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    name: str
    token: str
    uid: str = ""
    groups: list[str] = []
    cluster_admin: bool = False
    namespaces: dict[str, list[str]] = {}
    cluster_verbs: list[str] = []
    non_resource_urls: list[str] = []


class UsersFile(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    users: list[UserRights] = []


class UsersError(ValueError):
    pass


def _verb_allowed(verbs: list[str], verb: str) -> bool:
    return "*" in verbs or verb in verbs


def _path_allowed(paths: list[str], path: str) -> bool:
    return any(path == p or (p.endswith("*") and path.startswith(p[:-1])) for p in paths)


class Users:
    def __init__(self, users: list[UserRights] | None = None) -> None:
        self.users = list(users or [])
        self.token_reviews = 0  # how many were asked (tests check the callers' caches)
        self.access_reviews = 0

    @classmethod
    def parse(cls, data: bytes, where: str = "users file") -> Users:
        try:
            parsed = msgspec.json.decode(data, type=UsersFile)
        except msgspec.DecodeError as exc:
            raise UsersError(f"{where} is not a valid users file: {exc}") from exc
        empty = [u.name for u in parsed.users if not u.token]
        if empty:
            raise UsersError(f"{where}: users without a token: {', '.join(empty)}")
        return cls(parsed.users)

    def encode(self) -> bytes:
        return msgspec.json.format(msgspec.json.encode(UsersFile(users=self.users)), indent=2)

    def find(self, token: str) -> UserRights | None:
        found = None
        for user in self.users:  # compare with every token, in constant time each
            if hmac.compare_digest(user.token.encode(), token.encode()):
                found = user
        return found

    def by_name(self, name: str) -> UserRights | None:
        return next((u for u in self.users if u.name == name), None)

    def token_review(self, body: Any) -> dict[str, Any]:
        self.token_reviews += 1
        spec = (body.get("spec") or {}) if isinstance(body, dict) else {}
        user = self.find(str(spec.get("token") or ""))
        if user is None:
            status: dict[str, Any] = {"authenticated": False, "user": {},
                                      "error": "invalid bearer token"}  # fmt: skip
        else:
            status = {
                "authenticated": True,
                "user": {"username": user.name, "uid": user.uid or f"uid-{user.name}",
                         "groups": [*user.groups, "system:authenticated"]},
            }  # fmt: skip
            if spec.get("audiences"):
                status["audiences"] = spec["audiences"]
        return {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenReview",
                "metadata": {}, "spec": spec, "status": status}  # fmt: skip

    def decide(self, spec: dict[str, Any]) -> tuple[bool, str]:
        user = self.by_name(str(spec.get("user") or ""))
        if user is None:
            return False, f'no such user "{spec.get("user")}"'
        if user.cluster_admin:
            return True, f'user "{user.name}" is cluster-admin'
        path = spec.get("nonResourceAttributes")
        if isinstance(path, dict):
            ok = path.get("verb") == "get" and _path_allowed(user.non_resource_urls,
                                                              str(path.get("path")))  # fmt: skip
            return ok, f"nonResourceURLs of {user.name}"
        attributes = spec.get("resourceAttributes") or {}
        verb = str(attributes.get("verb") or "")
        namespace = str(attributes.get("namespace") or "")
        if _verb_allowed(user.cluster_verbs, verb):
            return True, f'user "{user.name}" may {verb} in every namespace'
        if namespace and _verb_allowed(user.namespaces.get(namespace, []), verb):
            return True, f'user "{user.name}" may {verb} in namespace "{namespace}"'
        return False, ""

    def access_review(self, body: Any) -> dict[str, Any]:
        self.access_reviews += 1
        spec = (body.get("spec") or {}) if isinstance(body, dict) else {}
        allowed, reason = self.decide(spec)
        return {"apiVersion": "authorization.k8s.io/v1", "kind": "SubjectAccessReview",
                "metadata": {}, "spec": spec,
                "status": {"allowed": allowed, "reason": reason}}  # fmt: skip


class UsersFileSource:
    """A users file, read again when it changes (so tenants can be added while it runs)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._stamp: tuple[int, int] | None = None
        self._users = Users()
        self.current()  # a bad file is reported at start, not at the first request

    def current(self) -> Users:
        stat = os.stat(self.path)
        stamp = (stat.st_mtime_ns, stat.st_size)
        if stamp != self._stamp:
            users = Users.parse(self.path.read_bytes(), str(self.path))
            users.token_reviews = self._users.token_reviews
            users.access_reviews = self._users.access_reviews
            self._users, self._stamp = users, stamp
        return self._users


def write_users(users: Users, path: Path) -> None:
    """Write a users file only its owner can read (it holds tokens)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_suffix(".tmp")
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as handle:
        handle.write(users.encode())
    temporary.replace(path)


TOKEN_REVIEWS = "/apis/authentication.k8s.io/v1/tokenreviews"
ACCESS_REVIEWS = "/apis/authorization.k8s.io/v1/subjectaccessreviews"


def review_routes(users: Callable[[], Users]) -> list[web.RouteDef]:
    """POST tokenreviews and subjectaccessreviews, answered 201 as the API server does."""

    async def body(request: web.Request) -> Any:
        try:
            return json.loads(await request.read())
        except ValueError as exc:
            raise web.HTTPBadRequest(text=f"body is not JSON: {exc}") from exc

    async def token_review(request: web.Request) -> web.Response:
        return web.json_response(users().token_review(await body(request)), status=201)

    async def access_review(request: web.Request) -> web.Response:
        return web.json_response(users().access_review(await body(request)), status=201)

    return [web.post(TOKEN_REVIEWS, token_review), web.post(ACCESS_REVIEWS, access_review)]
