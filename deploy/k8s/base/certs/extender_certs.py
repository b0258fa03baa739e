"""Write the scheduler extender's certificates once: a CA, the allocator's serving certificate
and kube-scheduler's client certificate, in two Secrets so that each side holds only its own
key.

Run by the Job vgpu-webhook-certgen (container extender-certs) with the services image. Both
Secrets have the keys ``ca.crt``, ``tls.crt`` and ``tls.key`` (as cert-manager writes them,
so the components/cert-manager alternative mounts the same way):

* ``vgpu-extender-tls``: the allocator's serving certificate for its Service names; its
  ``ca.crt`` is the CA whose client certificates the extender accepts;
* ``vgpu-scheduler-extender-client``: kube-scheduler's client certificate (CN
  ``vgpu-scheduler``, O ``vgpu:schedulers``); its ``ca.crt`` verifies the allocator.

When both exist nothing changes, so the Job can run on every apply. When one is missing both
are made again from a new CA (the CA's key is never stored): delete both to renew, and the
allocator picks the new files up without a restart (docs/security.md, "Rotation").
"""

from __future__ import annotations

import base64
import os
import sys
from collections.abc import Mapping

from services.common.certs import CertificateAuthority

SERVER_SECRET = "vgpu-extender-tls"
CLIENT_SECRET = "vgpu-scheduler-extender-client"
CLIENT_NAME = "vgpu-scheduler"
CLIENT_GROUP = "vgpu:schedulers"
KEYS = ("ca.crt", "tls.crt", "tls.key")


def service_hosts(service: str, namespace: str) -> list[str]:
    return [
        f"{service}.{namespace}.svc",
        f"{service}.{namespace}.svc.cluster.local",
        f"{service}.{namespace}",
        service,
    ]


def complete(data: Mapping[str, str] | None) -> bool:
    return data is not None and all(data.get(key) for key in KEYS)


def make_pair(hosts: list[str], days: int) -> tuple[dict[str, str], dict[str, str]]:
    """(server Secret data, client Secret data), both signed by one new CA."""
    ca = CertificateAuthority.create("vgpu extender CA", days=days)
    server = ca.server(hosts, days=days)
    client = ca.client(CLIENT_NAME, (CLIENT_GROUP,), days=days)
    ca_pem = ca.cert_pem.decode()
    return (
        {"ca.crt": ca_pem, "tls.crt": server.cert_pem.decode(), "tls.key": server.key_pem.decode()},
        {"ca.crt": ca_pem, "tls.crt": client.cert_pem.decode(), "tls.key": client.key_pem.decode()},
    )


def _decode(data: Mapping[str, str] | None) -> dict[str, str] | None:
    if data is None:
        return None
    return {key: base64.b64decode(value).decode() for key, value in data.items()}


def main() -> int:
    from kubernetes import client, config
    from kubernetes.client.exceptions import ApiException

    namespace = os.environ["POD_NAMESPACE"]
    service = os.environ.get("SERVICE_NAME", "vgpu-allocator")
    days = int(os.environ.get("VALID_DAYS", "3650"))
    config.load_incluster_config()
    api = client.CoreV1Api()

    def read(name: str) -> tuple[bool, dict[str, str] | None]:
        try:
            return True, _decode(api.read_namespaced_secret(name, namespace).data or {})
        except ApiException as exc:
            if exc.status == 404:
                return False, None
            raise

    server_exists, server = read(SERVER_SECRET)
    client_exists, client_data = read(CLIENT_SECRET)
    if complete(server) and complete(client_data):
        print(f"secrets {SERVER_SECRET} and {CLIENT_SECRET} are complete: kept")
        return 0
    server_data, new_client = make_pair(service_hosts(service, namespace), days)
    for name, exists, data in (
        (SERVER_SECRET, server_exists, server_data),
        (CLIENT_SECRET, client_exists, new_client),
    ):
        body = {
            "metadata": {"name": name, "labels": {"app.kubernetes.io/part-of": "vgpu"}},
            "type": "kubernetes.io/tls",
            "stringData": data,
        }
        if exists:
            api.replace_namespaced_secret(name, namespace, body)
        else:
            api.create_namespaced_secret(namespace, body)
        print(f"secret {namespace}/{name}: written")
    return 0


if __name__ == "__main__":
    sys.exit(main())
