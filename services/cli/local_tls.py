"""The serving certificate of `vgpu up`'s admission webhook.

A real API server calls mutating webhooks over HTTPS only, trusting the configuration's
caBundle; `vgpu up` does the same with a certificate for 127.0.0.1 from a CA made at start
(its key kept only in memory), all kept in the cluster's private work directory and removed
with it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from services.common.certs import CertificateAuthority

VALID_DAYS = 30


@dataclass(frozen=True)
class ServingCert:
    cert_file: str
    key_file: str
    ca_file: str  # the caBundle


def self_signed(directory: Path, common_name: str, host: str = "127.0.0.1") -> ServingCert:
    """Write ca.crt, tls.crt and tls.key (0600) for `host` into `directory`."""
    ca = CertificateAuthority.create(f"{common_name} CA", days=VALID_DAYS)
    cert_file, key_file = ca.server([host, "localhost", common_name], days=VALID_DAYS).write(
        directory, "tls"
    )
    ca_file = directory / "ca.crt"
    ca_file.write_bytes(ca.cert_pem)
    return ServingCert(str(cert_file), str(key_file), str(ca_file))
