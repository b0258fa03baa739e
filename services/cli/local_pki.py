"""`vgpu up`'s own CA for the extender's mutual TLS, as deploy/k8s's certificate Job makes it.

At every start: a CA (its key kept only in memory, so no one can sign more), a serving
certificate for the extender on 127.0.0.1, and a client certificate (CN ``vgpu-scheduler``)
that `vgpu up`'s scheduler emulation and `vgpu submit` present. The files live in a private
directory (0700) beside the state file, which records their paths.
"""

from __future__ import annotations

import os
import ssl
from dataclasses import dataclass
from pathlib import Path

from services.common.certs import CertificateAuthority

CLIENT_NAME = "vgpu-scheduler"  # the identity the extender accepts (extender_client_allowed)
CLIENT_GROUP = "vgpu:schedulers"
VALID_DAYS = 30


@dataclass(frozen=True)
class LocalPki:
    ca_file: str
    server_cert_file: str
    server_key_file: str
    client_cert_file: str
    client_key_file: str


def make_local_pki(directory: Path) -> LocalPki:
    directory.mkdir(parents=True, exist_ok=True)
    os.chmod(directory, 0o700)
    ca = CertificateAuthority.create("vgpu up CA", days=VALID_DAYS)
    ca_file = directory / "ca.crt"
    ca_file.write_bytes(ca.cert_pem)
    server_cert, server_key = ca.server(["127.0.0.1", "localhost"], days=VALID_DAYS).write(
        directory, "extender"
    )
    client_cert, client_key = ca.client(CLIENT_NAME, (CLIENT_GROUP,), days=VALID_DAYS).write(
        directory, "client"
    )
    return LocalPki(
        str(ca_file), str(server_cert), str(server_key), str(client_cert), str(client_key)
    )


def client_context(ca_file: str, cert_file: str, key_file: str) -> ssl.SSLContext:
    """What a caller of the extender presents: the client certificate, and the CA it trusts."""
    context = ssl.create_default_context(cafile=ca_file)
    context.load_cert_chain(cert_file, key_file)
    return context
