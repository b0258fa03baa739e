"""The extender over HTTPS with client certificates: real TLS handshakes against a running
allocator (valid, none, another CA, expired, not allowed), counted refusals, and certificate
rotation while serving."""

from __future__ import annotations

import asyncio
import datetime
import shutil
import ssl
from pathlib import Path

import aiohttp
import pytest
from prometheus_client import REGISTRY

from services.allocator import Allocator
from services.common.certs import CertificateAuthority

from .conftest import MakeAllocator
from .helpers import (
    admit_to_cluster,
    bind_args,
    container,
    filter_args,
    give_nodes,
    node_inventory,
    pod,
)

SCHEDULER = "vgpu-scheduler"


class Pki:
    """A CA, the extender's serving certificate, and client certificates to call it with."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.ca = CertificateAuthority.create("vgpu test CA")
        self.ca_file = root / "ca.crt"
        self.ca_file.write_bytes(self.ca.cert_pem)
        self.ca.server(["localhost", "127.0.0.1"]).write(root, "server")
        self.ca.client(SCHEDULER, ("vgpu:schedulers",)).write(root, "scheduler")
        self.ca.client("tenant-a").write(root, "tenant")
        expired_at = datetime.datetime.now(datetime.UTC) - datetime.timedelta(days=30)
        self.ca.client(SCHEDULER, days=1, not_before=expired_at).write(root, "expired")
        CertificateAuthority.create("another CA").client(SCHEDULER).write(root, "stranger")

    def settings(self) -> dict:
        return {
            "extender_port": 0,
            "extender_cert_file": str(self.root / "server.crt"),
            "extender_key_file": str(self.root / "server.key"),
            "extender_client_ca_file": str(self.ca_file),
            "extender_client_allowed": f"CN={SCHEDULER}, O=vgpu:operators",
            "tls_reload_s": 0.05,
        }

    def client(self, stem: str | None, ca_file: Path | None = None) -> ssl.SSLContext:
        context = ssl.create_default_context(cafile=str(ca_file or self.ca_file))
        if stem is not None:
            context.load_cert_chain(self.root / f"{stem}.crt", self.root / f"{stem}.key")
        return context


def refused(reason: str) -> float:
    value = REGISTRY.get_sample_value("vgpu_allocator_extender_refused_total", {"reason": reason})
    return value or 0.0


@pytest.fixture
def pki(tmp_path: Path) -> Pki:
    return Pki(tmp_path)


@pytest.fixture
async def secure(make_allocator: MakeAllocator, pki: Pki) -> Allocator:
    return await make_allocator(**pki.settings())


async def _call(url: str, context: ssl.SSLContext, body: dict) -> tuple[int, dict | str]:
    timeout = aiohttp.ClientTimeout(total=5)
    async with (
        aiohttp.ClientSession(timeout=timeout) as http,
        http.post(url, json=body, ssl=context) as response,
    ):
        if response.content_type == "application/json":
            return response.status, await response.json()
        return response.status, await response.text()


async def test_only_the_scheduler_certificate_is_accepted(
    secure: Allocator, pki: Pki, bus, http
) -> None:
    await give_nodes(bus, secure, node_inventory("n1"))
    p = pod("p", [container("main", mem=1000)])
    admit_to_cluster(secure, p)
    url = secure.extender_url
    assert url.startswith("https://127.0.0.1:")

    status, answer = await _call(f"{url}/filter", pki.client("scheduler"), filter_args(p, ["n1"]))
    assert status == 200 and answer["NodeNames"] == ["n1"]

    for stem, reason in (
        (None, "no_client_cert"),
        ("stranger", "unknown_ca"),
        ("expired", "expired"),
    ):
        before = refused(reason)
        with pytest.raises(aiohttp.ClientError):
            await _call(f"{url}/bind", pki.client(stem), bind_args(p, "n1"))
        assert refused(reason) > before, reason

    # Signed by the CA, but not kube-scheduler's identity: 403 naming it, counted.
    before = refused("client_not_allowed")
    status, text = await _call(f"{url}/bind", pki.client("tenant"), bind_args(p, "n1"))
    assert status == 403 and "CN=tenant-a" in str(text)
    assert refused("client_not_allowed") == before + 1
    backend = secure.backend
    assert backend.node_of("default", "p") is None  # type: ignore[attr-defined]

    # Plain HTTP to the TLS port is refused; the plain port no longer serves the verbs.
    before = refused("not_tls")
    with pytest.raises(aiohttp.ClientError):
        async with http.post(url.replace("https", "http") + "/bind", json=bind_args(p, "n1")):
            pass
    assert refused("not_tls") > before
    async with http.post(f"{secure.url}/scheduler/bind", json=bind_args(p, "n1")) as response:
        assert response.status == 404

    status, answer = await _call(f"{url}/bind", pki.client("scheduler"), bind_args(p, "n1"))
    assert (status, answer) == (200, {"Error": ""})
    assert backend.node_of("default", "p") == "n1"  # type: ignore[attr-defined]


async def test_health_and_metrics_stay_on_the_plain_port(secure: Allocator, http) -> None:
    async with http.get(f"{secure.url}/healthz") as response:
        assert response.status == 200
    async with http.get(f"{secure.url}/metrics") as response:
        assert "vgpu_allocator_extender_refused_total" in await response.text()


async def test_rotated_certificates_are_used_without_a_restart(
    secure: Allocator, pki: Pki, bus, tmp_path: Path
) -> None:
    await give_nodes(bus, secure, node_inventory("n1"))
    p = pod("p", [container("main", mem=1000)])
    url = f"{secure.extender_url}/filter"
    status, _ = await _call(url, pki.client("scheduler"), filter_args(p, ["n1"]))
    assert status == 200

    # A new CA signs a new serving certificate and a new scheduler certificate; the files
    # are replaced in place as a Secret volume or cert-manager would.
    new = CertificateAuthority.create("vgpu rotated CA")
    staging = tmp_path / "staging"
    new.server(["localhost", "127.0.0.1"]).write(staging, "server")
    new.client(SCHEDULER).write(staging, "scheduler")
    (staging / "ca.crt").write_bytes(new.cert_pem)
    for name in ("server.key", "server.crt", "ca.crt", "scheduler.crt", "scheduler.key"):
        shutil.copy(staging / name, pki.root / f".{name}")
        (pki.root / f".{name}").replace(pki.root / name)
    await asyncio.sleep(0.2)  # more than tls_reload_s

    # New handshakes present the new certificate and ask for clients of the new CA.
    status, answer = await _call(url, pki.client("scheduler"), filter_args(p, ["n1"]))
    assert status == 200 and answer["NodeNames"] == ["n1"]
    old_ca = tmp_path / "old-ca.crt"
    old_ca.write_bytes(pki.ca.cert_pem)
    with pytest.raises(aiohttp.ClientError):  # the old CA no longer vouches for the server
        await _call(url, pki.client("scheduler", ca_file=old_ca), filter_args(p, ["n1"]))

    # A half-written rotation (certificate without its key) is ignored: serving goes on.
    other = CertificateAuthority.create("half").server(["127.0.0.1"])
    (pki.root / "server.crt").write_bytes(other.cert_pem)
    await asyncio.sleep(0.2)
    status, _ = await _call(url, pki.client("scheduler"), filter_args(p, ["n1"]))
    assert status == 200


async def test_missing_certificate_settings_are_named(make_allocator: MakeAllocator) -> None:
    with pytest.raises(ValueError, match="extender_client_ca_file"):
        await make_allocator(
            extender_port=0, extender_cert_file="/x.crt", extender_key_file="/x.key"
        )
