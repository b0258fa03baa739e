"""Who may read what under `vgpu up`: the users file its local API server answers
TokenReview and SubjectAccessReview from (format: services/simulators/kube_users.py).

Made once, beside the state file, readable by its owner only, and kept across restarts (the
tokens stay valid); add tenants by editing it while `vgpu up` runs (it is read again when it
changes). It starts with two users:

- ``admin`` (cluster-admin): the token `vgpu up` prints, writes to its state file and that
  `vgpu inspect` sends;
- ``system:serviceaccount:monitoring:prometheus``: ``get /metrics`` only, for a scraper.
"""

from __future__ import annotations

import secrets
from pathlib import Path

from services.simulators.kube_users import UserRights, Users, UsersError, write_users

ADMIN = "admin"
PROMETHEUS = "system:serviceaccount:monitoring:prometheus"


def default_users_file(state_file: Path) -> Path:
    return state_file.with_name(f"{state_file.stem}-users.json")


def _token() -> str:
    return secrets.token_urlsafe(32)


def ensure_users_file(path: Path) -> Users:
    """The users in `path`, made with a fresh admin and Prometheus token if it is missing.
    A file that exists but is not a users file is an error (never silently replaced)."""
    if path.exists():
        users = Users.parse(path.read_bytes(), str(path))
    else:
        users = Users([
            UserRights(name=ADMIN, token=_token(), groups=["system:masters"],
                       cluster_admin=True),
            UserRights(name=PROMETHEUS, token=_token(), non_resource_urls=["/metrics"]),
        ])  # fmt: skip
        write_users(users, path)
    admin_token(users, path)
    return users


def admin_token(users: Users, where: Path) -> str:
    for user in users.users:
        if user.cluster_admin:
            return user.token
    raise UsersError(f"{where} has no cluster-admin user (needed for vgpu inspect)")
