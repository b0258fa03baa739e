"""The certificate Job's extender_certs.py: what it writes is what the allocator's extender
and kube-scheduler's tlsConfig need, checked by a real mutual-TLS handshake."""

from __future__ import annotations

import importlib.util
import ssl
from pathlib import Path
from types import ModuleType

import aiohttp
from aiohttp import web

from services.common.mutual_tls import (
    MutualTls,
    ReloadingContext,
    ServerCertFiles,
    identity_middleware,
    serve_mutual_tls,
)
from tests.deploy.manifests import K8S

SCRIPT = K8S / "base" / "certs" / "extender_certs.py"


def certs_module() -> ModuleType:
    spec = importlib.util.spec_from_file_location("extender_certs", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _write(directory: Path, data: dict[str, str]) -> Path:
    directory.mkdir()
    for name, text in data.items():
        (directory / name).write_text(text)
    return directory


def test_both_secrets_have_the_keys_pods_mount_and_are_kept_when_complete() -> None:
    module = certs_module()
    server, client = module.make_pair(module.service_hosts("vgpu-allocator", "ns"), 30)
    assert set(server) == set(client) == {"ca.crt", "tls.crt", "tls.key"}
    assert server["ca.crt"] == client["ca.crt"]  # one CA, two keys: each side its own
    assert server["tls.key"] != client["tls.key"]
    assert module.complete(server) and module.complete(client)
    assert not module.complete(None) and not module.complete({**server, "tls.key": ""})


async def test_kube_scheduler_with_the_client_secret_reaches_the_extender(tmp_path: Path) -> None:
    module = certs_module()
    hosts = module.service_hosts("vgpu-allocator", "gpu-sharing")
    server_data, client_data = module.make_pair(hosts, 30)
    server = _write(tmp_path / "extender-tls", server_data)
    client = _write(tmp_path / "extender-client", client_data)
    refusals: list[str] = []
    tls = MutualTls(
        ReloadingContext(
            ServerCertFiles(
                str(server / "tls.crt"), str(server / "tls.key"), str(server / "ca.crt")
            )
        ),
        ("CN=vgpu-scheduler",),  # as deploy/k8s sets VGPU_EXTENDER_CLIENT_ALLOWED
        lambda reason, detail, peer: refusals.append(reason),
    )
    app = web.Application(middlewares=[identity_middleware(tls)])

    async def filter_verb(_: web.Request) -> web.Response:
        return web.json_response({"Error": ""})

    app.router.add_post("/scheduler/filter", filter_verb)
    runner, port = await serve_mutual_tls(app, "127.0.0.1", 0, tls)
    try:
        # kube-scheduler's tlsConfig: certFile, keyFile, caFile of its Secret; the URL names
        # the Service, which the serving certificate must carry.
        context = ssl.create_default_context(cafile=str(client / "ca.crt"))
        context.load_cert_chain(client / "tls.crt", client / "tls.key")
        async with (
            aiohttp.ClientSession() as http,
            http.post(
                f"https://127.0.0.1:{port}/scheduler/filter",
                json={},
                ssl=context,
                server_hostname="vgpu-allocator.gpu-sharing.svc",
            ) as response,
        ):
            assert response.status == 200
        assert refusals == []
    finally:
        await runner.cleanup()
