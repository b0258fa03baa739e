"""`vgpu up` runs the extender as a cluster does: HTTPS that takes only the client certificate
of its own CA, which its scheduler emulation and `vgpu submit` present (issue 20)."""

from __future__ import annotations

import ssl
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest
from prometheus_client import REGISTRY

from services.cli.local_cluster import LocalCluster, LocalClusterSpec
from services.cli.submit import load_pod, submit
from services.common.certs import CertificateAuthority

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


@pytest.fixture
async def cluster(tmp_path: Path) -> AsyncIterator[LocalCluster]:
    local = LocalCluster(
        LocalClusterSpec(
            allocator_port=0, metrics_port=0, extender_port=0, tls_dir=str(tmp_path / "tls")
        )
    )
    await local.start()
    yield local
    await local.stop()


def refused(reason: str) -> float:
    value = REGISTRY.get_sample_value("vgpu_allocator_extender_refused_total", {"reason": reason})
    return value or 0.0


async def _post(url: str, context: ssl.SSLContext, body: dict) -> dict:
    async with (
        aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as http,
        http.post(url, json=body, ssl=context) as response,
    ):
        assert response.status == 200
        answer: dict = await response.json()
        return answer


async def test_submit_goes_through_the_mutual_tls_extender(
    cluster: LocalCluster, tmp_path: Path
) -> None:
    state = cluster.state()
    assert state.extender_url.startswith("https://127.0.0.1:")
    for path in (state.ca_file, state.client_cert_file, state.client_key_file):
        assert Path(path).parent == tmp_path / "tls"
    assert Path(state.client_key_file).stat().st_mode & 0o077 == 0
    assert (tmp_path / "tls").stat().st_mode & 0o077 == 0

    outcome = await submit(load_pod(EXAMPLES / "half-gpu.yaml"), state)
    assert outcome.node in cluster.agents and not outcome.reason, outcome

    # Without a client certificate, or with one of another CA: refused at the handshake.
    body = {"Pod": load_pod(EXAMPLES / "half-gpu.yaml"), "NodeNames": ["node-1"]}
    anonymous = ssl.create_default_context(cafile=state.ca_file)
    stranger = ssl.create_default_context(cafile=state.ca_file)
    other = CertificateAuthority.create("not vgpu up's").client("vgpu-scheduler")
    cert, key = other.write(tmp_path / "other", "client")
    stranger.load_cert_chain(cert, key)
    for context, reason in ((anonymous, "no_client_cert"), (stranger, "unknown_ca")):
        before = refused(reason)
        with pytest.raises(aiohttp.ClientError):
            await _post(f"{state.extender_url}/filter", context, body)
        assert refused(reason) > before

    # With the right certificate, a bind still needs the filter's pass for that node.
    trusted = state.extender_ssl()
    assert trusted is not None
    pod = load_pod(EXAMPLES / "two-whole-gpus.yaml")
    assert cluster.allocator is not None
    cluster.allocator.backend.add_pod(pod)  # type: ignore[attr-defined]
    binding = {
        "PodName": pod["metadata"]["name"],
        "PodNamespace": pod["metadata"]["namespace"],
        "PodUID": pod["metadata"]["uid"],
        "Node": "node-2",
    }
    answer = await _post(f"{state.extender_url}/bind", trusted, binding)
    assert "not passed by this extender's filter for node 'node-2'" in answer["Error"]

    await cluster.stop()
    assert not (tmp_path / "tls").exists()  # the keys go with the system
