"""Write the Secret that holds vgpu's NATS passwords and client URLs, once.

Run by the Job vgpu-nats-credentials with the services image (it has the `kubernetes`
client). Missing entries are added; existing ones are never changed, so running it again is
harmless and a password an operator set stays. Passwords are never printed.

Keys: ``<user>-password`` for each NATS user (read by the NATS servers, see nats.conf) and
``<service>-url`` for each vgpu service (its VGPU_NATS_URL, credentials included). With an
existing NATS server, an operator writes the ``-url`` keys alone (docs/install.md).
"""

from __future__ import annotations

import base64
import os
import secrets
import sys
from collections.abc import Mapping

# Secret key prefix -> NATS user name (nats.conf). "system" is for operators only.
SERVICE_USERS = {
    "allocator": "vgpu-allocator",
    "nodeagent": "vgpu-node-agent",
    "metrics": "vgpu-metrics",
}
PASSWORD_KEYS = tuple(f"{name}-password" for name in (*SERVICE_USERS, "system"))


def new_password() -> str:
    # A letter first: the NATS config reads a variable's value as a number or a size when it
    # looks like one ("1e5", "64MB"). Hex is safe in a URL's user information.
    return "p" + secrets.token_hex(24)


def missing_entries(existing: Mapping[str, str], nats_address: str) -> dict[str, str]:
    """The entries to add so that every password and URL key exists (never a changed one)."""
    added: dict[str, str] = {}
    for key in PASSWORD_KEYS:
        if not existing.get(key):
            added[key] = new_password()
    for service, user in SERVICE_USERS.items():
        key = f"{service}-url"
        if not existing.get(key):
            password = existing.get(f"{service}-password") or added[f"{service}-password"]
            added[key] = f"nats://{user}:{password}@{nats_address}"
    return added


def _decode(data: Mapping[str, str] | None) -> dict[str, str]:
    return {key: base64.b64decode(value).decode() for key, value in (data or {}).items()}


def main() -> int:
    from kubernetes import client, config
    from kubernetes.client.exceptions import ApiException

    namespace = os.environ["POD_NAMESPACE"]
    name = os.environ.get("SECRET_NAME", "vgpu-nats-credentials")
    address = os.environ.get("NATS_ADDRESS", "vgpu-nats:4222")
    config.load_incluster_config()
    api = client.CoreV1Api()
    for _attempt in range(3):  # another run may create it between our read and our create
        try:
            existing: dict[str, str] | None = _decode(
                api.read_namespaced_secret(name, namespace).data
            )
        except ApiException as exc:
            if exc.status != 404:
                raise
            existing = None
        added = missing_entries(existing or {}, address)
        if not added:
            print(f"secret {namespace}/{name} is complete")
            return 0
        body = {"stringData": added}
        try:
            if existing is None:
                metadata = {"name": name, "labels": {"app.kubernetes.io/part-of": "vgpu"}}
                api.create_namespaced_secret(namespace, {**body, "metadata": metadata})
            else:
                api.patch_namespaced_secret(name, namespace, body)
        except ApiException as exc:
            if exc.status == 409:
                continue
            raise
        print(f"secret {namespace}/{name}: added {', '.join(sorted(added))}")
        return 0
    print(f"secret {namespace}/{name}: gave up after repeated conflicts", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
