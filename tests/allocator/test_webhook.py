"""The mutating admission webhook over HTTPS, AdmissionReview v1, with a self-signed cert."""

from __future__ import annotations

import base64
import datetime
import ipaddress
import json
import ssl
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from services.allocator import Allocator
from services.allocator.webhook import mutate
from services.common.resources import RequestConfig
from services.simulators.admission import MutatingAdmission, MutatingWebhook
from services.simulators.apiserver import FakeApiServer, json_patch

from .conftest import MakeAllocator


def self_signed(directory: Path) -> tuple[str, str]:
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "vgpu-allocator.vgpu-system.svc")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=1))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            critical=False,
        )
        .sign(key, hashes.SHA256())
    )
    cert_file, key_file = directory / "tls.crt", directory / "tls.key"
    cert_file.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_file.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return str(cert_file), str(key_file)


@pytest.fixture
async def webhook(
    make_allocator: MakeAllocator, tmp_path: Path
) -> tuple[Allocator, ssl.SSLContext]:
    cert, key = self_signed(tmp_path)
    allocator = await make_allocator(
        webhook_port=0, webhook_host="127.0.0.1", tls_cert_file=cert, tls_key_file=key
    )
    trust = ssl.create_default_context(cafile=cert)  # the caBundle of the configuration
    return allocator, trust


def review_of(pod: dict[str, Any], uid: str = "r-1") -> dict[str, Any]:
    return {
        "apiVersion": "admission.k8s.io/v1",
        "kind": "AdmissionReview",
        "request": {
            "uid": uid,
            "kind": {"group": "", "version": "v1", "kind": "Pod"},
            "resource": {"group": "", "version": "v1", "resource": "pods"},
            "namespace": "ml",
            "operation": "CREATE",
            "object": pod,
        },
    }


async def call(webhook: tuple[Allocator, ssl.SSLContext], body: Any) -> tuple[int, Any]:
    allocator, trust = webhook
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    async with (
        aiohttp.ClientSession() as http,
        http.post(f"{allocator.webhook_url}/mutate", data=data, ssl=trust) as response,
    ):
        return response.status, await response.json()


POD = {
    "apiVersion": "v1",
    "kind": "Pod",
    "metadata": {"name": "p", "namespace": "ml", "annotations": {"gpu-fraction": "0.5"}},
    "spec": {
        "containers": [
            {"name": "kai", "image": "x"},
            {
                "name": "web",
                "image": "nginx",
                "env": [{"name": "NVIDIA_VISIBLE_DEVICES", "value": "all"}],
            },
            {
                "name": "ali",
                "image": "x",
                "resources": {"limits": {"aliyun.com/gpu-mem": "2", "cpu": "1"}},
            },
        ],
        "initContainers": [
            {
                "name": "tencent",
                "image": "x",
                "resources": {
                    "limits": {"tencent.com/vcuda-core": "30"},
                    "requests": {"tencent.com/vcuda-core": "30"},
                },
            },
        ],
    },
}


async def test_patches_names_defaults_scheduler_and_void(webhook) -> None:
    status, answer = await call(webhook, review_of(POD))
    assert status == 200
    assert answer["apiVersion"] == "admission.k8s.io/v1" and answer["kind"] == "AdmissionReview"
    response = answer["response"]
    assert response["uid"] == "r-1" and response["allowed"] is True
    assert response["patchType"] == "JSONPatch"
    patched = json_patch(POD, json.loads(base64.b64decode(response["patch"])))
    spec = patched["spec"]
    assert spec["schedulerName"] == "vgpu-scheduler"
    kai, web, ali = spec["containers"]
    assert kai["resources"]["limits"] == {
        "nvidia.com/gpu": "1",
        "nvidia.com/gpumem-percentage": "50",
    }
    assert web["env"] == [{"name": "NVIDIA_VISIBLE_DEVICES", "value": "void"}]
    assert ali["resources"]["limits"] == {
        "cpu": "1",
        "nvidia.com/gpu": "1",
        "nvidia.com/gpumem": "2048",
    }
    (tencent,) = spec["initContainers"]
    assert tencent["resources"]["limits"] == {"nvidia.com/gpu": "1", "nvidia.com/gpucores": "30"}
    assert tencent["resources"]["requests"] == tencent["resources"]["limits"]
    assert "gpu-fraction" not in patched["metadata"]["annotations"]
    # gpushare's variables: the amounts known now, the GPU from the bind annotations.
    assert ali["env"] == [
        {"name": "ALIYUN_COM_GPU_MEM_IDX", "valueFrom": {"fieldRef": {
            "fieldPath": "metadata.annotations['ALIYUN_COM_GPU_MEM_IDX']"}}},
        {"name": "ALIYUN_COM_GPU_MEM_POD", "value": "2"},
        {"name": "ALIYUN_COM_GPU_MEM_CONTAINER", "value": "2"},
        {"name": "ALIYUN_COM_GPU_MEM_DEV", "valueFrom": {"fieldRef": {
            "fieldPath": "metadata.annotations['ALIYUN_COM_GPU_MEM_DEV']"}}},
    ]  # fmt: skip
    assert patched["metadata"]["annotations"] == {"ALIYUN_COM_GPU_MEM_POD": "2"}
    assert "env" not in kai and "env" not in tencent


def patched_by(answer: dict[str, Any], pod: dict[str, Any]) -> dict[str, Any]:
    return json_patch(pod, json.loads(base64.b64decode(answer["response"]["patch"])))


async def test_pod_without_gpu_only_gets_the_gpu_aware_scheduler(webhook) -> None:
    plain = {"metadata": {"name": "web"}, "spec": {"containers": [{"name": "nginx"}]}}
    _, answer = await call(webhook, review_of(plain, uid="r-2"))
    assert answer["response"]["uid"] == "r-2" and answer["response"]["allowed"] is True
    assert patched_by(answer, plain) == {
        **plain,
        "spec": {**plain["spec"], "schedulerName": "vgpu-scheduler"},
    }

    own = {
        "metadata": {"name": "web"},
        "spec": {"schedulerName": "volcano", "containers": [{"name": "nginx"}]},
    }
    _, answer = await call(webhook, review_of(own, uid="r-4"))
    assert answer["response"] == {"uid": "r-4", "allowed": True}  # its own scheduler: kept


async def test_pod_without_gpu_is_left_alone_when_cpu_pods_are_not_scheduled(
    make_allocator: MakeAllocator, tmp_path: Path
) -> None:
    cert, key = self_signed(tmp_path)
    allocator = await make_allocator(webhook_port=0, webhook_host="127.0.0.1",
                                     tls_cert_file=cert, tls_key_file=key,
                                     schedule_cpu_pods=False)  # fmt: skip
    plain = {"metadata": {"name": "web"}, "spec": {"containers": [{"name": "nginx"}]}}
    _, answer = await call((allocator, ssl.create_default_context(cafile=cert)),
                           review_of(plain, uid="r-2"))  # fmt: skip
    assert answer["response"] == {"uid": "r-2", "allowed": True}


@pytest.mark.parametrize(
    ("given", "written"),
    [("4k", "4000"), ("1Ki", "1024"), ("1e3", "1000"), ("1E3", "1000"), ("4000m", "4"),
     ("+8", "8"), ("0.5", "1"), ("2.5k", "2500")],
)  # fmt: skip
async def test_quantities_in_any_form_are_written_as_whole_numbers(
    webhook, given: str, written: str
) -> None:
    """The webhook sees pods before validation; it writes Quantity.Value() (rounded up)."""
    quantity_pod = {
        "metadata": {"name": "q"},
        "spec": {"containers": [{"name": "m", "resources": {
            "limits": {"nvidia.com/gpumem": given},
            "requests": {"nvidia.com/gpumem": given}}}]},
    }  # fmt: skip
    _, answer = await call(webhook, review_of(quantity_pod))
    (patched,) = patched_by(answer, quantity_pod)["spec"]["containers"]
    assert patched["resources"]["limits"] == {"nvidia.com/gpu": "1", "nvidia.com/gpumem": written}


@pytest.mark.parametrize(
    ("given", "problem"),
    [("٤", "not ASCII"), ("4x", "unknown suffix 'x'"), ("", "empty"), ("1.2.3", "unknown suffix"),
     ("-4", "must not be negative")],
)  # fmt: skip
async def test_malformed_quantities_are_denied_naming_the_field(
    webhook, given: str, problem: str
) -> None:
    bad = {
        "metadata": {"name": "b"},
        "spec": {"containers": [{"name": "m", "resources": {
            "limits": {"nvidia.com/gpumem": given}}}]},
    }  # fmt: skip
    _, answer = await call(webhook, review_of(bad, uid="r-5"))
    response = answer["response"]
    assert response["allowed"] is False and response["status"]["code"] == 400
    message = response["status"]["message"]
    assert "spec.containers 'm' resources.limits[nvidia.com/gpumem]" in message
    assert problem in message


async def test_malformed_gpu_request_is_denied_with_the_reason(webhook) -> None:
    bad = {
        "metadata": {"name": "b"},
        "spec": {
            "containers": [{"name": "m", "resources": {"limits": {"nvidia.com/gpucores": "150"}}}]
        },
    }
    _, answer = await call(webhook, review_of(bad, uid="r-3"))
    response = answer["response"]
    assert response["allowed"] is False and response["uid"] == "r-3"
    assert "gpucores: must be 0-100" in response["status"]["message"]


@pytest.mark.parametrize(
    "body",
    [b"{", {"kind": "Pod"}, {"apiVersion": "admission.k8s.io/v1beta1", "kind": "AdmissionReview"}],
)
async def test_malformed_reviews_get_400(webhook, body: Any) -> None:
    status, answer = await call(webhook, body)
    assert status == 400 and answer["error"]


async def test_no_container_chooses_its_own_gpus(webhook) -> None:
    """The kubelet appends the pod's env after the device plugin's: `=all` in a GPU
    container would widen its slice to every GPU of the node, so it is removed there and
    voided in containers that get no GPU, of GPU pods and CPU-only pods alike."""
    own_choice = [
        {"name": "A", "value": "1"},
        {"name": "NVIDIA_VISIBLE_DEVICES", "value": "all"},
    ]
    gpu_pod = {
        "metadata": {"name": "greedy", "namespace": "ml"},
        "spec": {
            "containers": [
                {
                    "name": "train",
                    "env": own_choice,
                    "resources": {"limits": {"nvidia.com/gpumem": "1000"}},
                },
                {"name": "side", "env": own_choice},
            ]
        },
    }
    _, answer = await call(webhook, review_of(gpu_pod, uid="r-9"))
    train, side = patched_by(answer, gpu_pod)["spec"]["containers"]
    assert train["env"] == [{"name": "A", "value": "1"}]
    assert side["env"] == [
        {"name": "A", "value": "1"},
        {"name": "NVIDIA_VISIBLE_DEVICES", "value": "void"},
    ]

    cpu_pod = {
        "metadata": {"name": "sneaky", "namespace": "ml"},
        "spec": {"containers": [{"name": "c", "env": own_choice}, {"name": "d"}]},
    }
    _, answer = await call(webhook, review_of(cpu_pod, uid="r-10"))
    c, d = patched_by(answer, cpu_pod)["spec"]["containers"]
    assert c["env"] == [
        {"name": "A", "value": "1"},
        {"name": "NVIDIA_VISIBLE_DEVICES", "value": "void"},
    ]
    assert "env" not in d  # a container that does not name it is left as it is


async def test_the_fake_api_server_runs_the_webhook_on_create(webhook, tmp_path: Path) -> None:
    """The in-process API server calls the webhook as a real one does: the stored pod is the
    patched one, and a denial is the pod's refusal, in the API server's words."""
    allocator, _ = webhook
    hook = MutatingWebhook(
        name="pods.allocator.vgpu.io",
        url=f"{allocator.webhook_url}/mutate",
        ca_file=str(tmp_path / "tls.crt"),
    )
    server = FakeApiServer(admission=MutatingAdmission([hook]))
    await server.start()
    pods = f"{server.url}/api/v1/namespaces/ml/pods"
    pod = {"metadata": {"name": "v"}, "spec": {"containers": [
        {"name": "c", "resources": {"limits": {"docker.com/vcuda-core": "25"}}}]}}  # fmt: skip
    bad = {"metadata": {"name": "b"}, "spec": {"containers": [
        {"name": "c", "resources": {"limits": {"docker.com/vcuda-core": "250"}}}]}}  # fmt: skip
    try:
        async with aiohttp.ClientSession() as http:
            async with http.post(pods, json=pod) as created:
                assert created.status == 201
            async with http.post(pods, json=bad) as refused:
                status = await refused.json()
                assert refused.status == 400, status
    finally:
        await server.stop()
    stored = server.pods[("ml", "v")]
    assert stored["spec"]["containers"][0]["resources"]["limits"] == {
        "nvidia.com/gpu": "1", "nvidia.com/gpucores": "25"}  # fmt: skip
    assert stored["spec"]["schedulerName"] == "vgpu-scheduler"
    assert ("ml", "b") not in server.pods
    assert status["message"].startswith(
        'admission webhook "pods.allocator.vgpu.io" denied the request: invalid GPU request'
    )
    assert "docker.com/vcuda-core: above 100 it must be a multiple of 100" in status["message"]


def test_gpu_pods_naming_an_adopted_peer_scheduler_move_to_vgpus() -> None:
    volcano = {"metadata": {"name": "v"}, "spec": {"schedulerName": "volcano", "containers": [
        {"name": "c", "resources": {"limits": {"volcano.sh/vgpu-number": "1"}}}]}}  # fmt: skip
    kai_cpu = {"metadata": {"name": "k"}, "spec": {"schedulerName": "kai-scheduler",
                                                   "containers": [{"name": "c"}]}}  # fmt: skip
    adopt = frozenset({"volcano", "kai-scheduler"})
    config = RequestConfig()
    moved = json_patch(volcano, mutate(volcano, config, "vgpu-scheduler", True, adopt))
    assert moved["spec"]["schedulerName"] == "vgpu-scheduler"
    kept = json_patch(volcano, mutate(volcano, config, "vgpu-scheduler", True))
    assert kept["spec"]["schedulerName"] == "volcano"  # not adopted: Volcano keeps it
    # Pods asking for no GPU stay with the scheduler they name.
    assert mutate(kai_cpu, config, "vgpu-scheduler", True, adopt) == []


async def test_hamis_scheduler_is_adopted_by_default(webhook) -> None:
    hami = {"metadata": {"name": "h"}, "spec": {"schedulerName": "hami-scheduler", "containers": [
        {"name": "c", "resources": {"limits": {"nvidia.com/gpu": "1"}}}]}}  # fmt: skip
    _, answer = await call(webhook, review_of(hami, uid="r-h"))
    assert patched_by(answer, hami)["spec"]["schedulerName"] == "vgpu-scheduler"
