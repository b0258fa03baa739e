"""Bounded work for every input: a body limit (413), non-UTF-8 bodies refused naming the field,
and a 100,000-node filter that leaves /healthz answering and the lease renewing."""

from __future__ import annotations

import asyncio
import json
import logging
import re
import ssl
import threading
import time
import urllib.request
from pathlib import Path

import aiohttp
import msgspec
import pytest

from services.allocator import Allocator
from services.common.bus import Bus
from services.metrics.service import MetricsService
from services.metrics.settings import MetricsSettings

from .conftest import MakeAllocator
from .helpers import container, filter_args, give_nodes, node_inventory, pod, post
from .test_webhook import call, review_of, self_signed

GOOD_POD = pod("p", [container("main", gpus=1, mem=1000)])


async def test_a_body_over_the_limit_is_a_413_naming_the_limit(
    make_allocator: MakeAllocator, http: aiohttp.ClientSession
) -> None:
    allocator = await make_allocator(max_body_bytes=4096)
    body = msgspec.json.encode(filter_args(GOOD_POD, [f"node-{i}" for i in range(1000)]))
    assert len(body) > 4096
    status, answer = await post(http, f"{allocator.url}/scheduler/filter", body)
    assert status == 413
    assert "over the 4096-byte limit (setting max_body_bytes)" in answer["Error"], answer

    async def chunks() -> object:  # no Content-Length: found while reading
        for start in range(0, len(body), 1000):
            yield body[start : start + 1000]

    async with http.post(f"{allocator.url}/scheduler/filter", data=chunks()) as response:
        assert response.status == 413
        assert "4096-byte limit" in (await response.json())["Error"]
    async with http.get(f"{allocator.url}/metrics") as response:
        text = await response.text()
    assert 'vgpu_http_rejected_requests_total{reason="body_too_large",server="extender"}' in text
    small = msgspec.json.encode(filter_args(GOOD_POD, ["n1"]))
    status, answer = await post(http, f"{allocator.url}/scheduler/filter", small)
    assert status == 200, answer


@pytest.mark.parametrize(
    ("body", "field"),
    [
        (b'{"Pod":{"metadata":{"name":"\xff","uid":"u"},"spec":{}},"NodeNames":["n1"]}',
         "ExtenderArgs.Pod.metadata.name: not valid UTF-8 (byte 0xff"),
        (b'{"Pod":{"metadata":{"name":"p","uid":"u"},"spec":{}},"NodeNames":["n1","\xc3("]}',
         "ExtenderArgs.NodeNames[1]: not valid UTF-8 (byte 0xc3"),
        (b'{"Pod":{"metadata":{"name":"p","uid":"u","labels":{"a/\xe9":"x"}},"spec":{}},'
         b'"NodeNames":["n1"]}', "ExtenderArgs.Pod.metadata.labels[a/\\xe9] (a key)"),
        (b"\xfe\xff{}", "ExtenderArgs: not valid UTF-8 (byte 0xfe at offset 0)"),
    ],
)  # fmt: skip
@pytest.mark.parametrize("verb", ["filter", "prioritize"])
async def test_a_body_that_is_not_utf8_is_a_400_naming_the_field(
    allocator: Allocator, http: aiohttp.ClientSession, verb: str, body: bytes, field: str
) -> None:
    status, answer = await post(http, f"{allocator.url}/scheduler/{verb}", body)
    assert status == 400, answer
    assert field in answer["Error"], answer


async def test_a_binding_that_is_not_utf8_is_a_400_naming_the_field(
    allocator: Allocator, http: aiohttp.ClientSession
) -> None:
    body = b'{"PodName":"p","PodNamespace":"\x80","PodUID":"u","Node":"n"}'
    status, answer = await post(http, f"{allocator.url}/scheduler/bind", body)
    assert status == 400
    assert "ExtenderBindingArgs.PodNamespace: not valid UTF-8 (byte 0x80" in answer["Error"]


def _healthz_latencies(url: str, done: threading.Event) -> list[float]:
    """Probe from another thread: a client on the allocator's own event loop would be frozen
    with it and time nothing."""
    latencies = []
    while not done.is_set():
        started = time.monotonic()
        with urllib.request.urlopen(f"{url}/healthz", timeout=60) as response:
            assert response.status == 200
        latencies.append(time.monotonic() - started)
        time.sleep(0.02)
    return latencies


@pytest.mark.parametrize("verb", ["filter", "prioritize"])
async def test_a_100000_node_request_leaves_healthz_answering_and_the_lease_renewing(
    make_allocator: MakeAllocator, bus: Bus, verb: str
) -> None:
    allocator = await make_allocator(lease_ttl_s=1.2)  # renewed every 0.4 s
    await give_nodes(bus, allocator, *(node_inventory(f"real-{i}") for i in range(20)))
    assert allocator.leading
    names = [f"real-{i}" for i in range(20)] + [f"node-{i:06d}" for i in range(100_000)]
    body = msgspec.json.encode(filter_args(GOOD_POD, names))
    done, stop_watch = threading.Event(), asyncio.Event()
    lost: list[float] = []

    async def watch_lease() -> None:
        while not stop_watch.is_set():
            if not allocator.leading:
                lost.append(time.monotonic())
            await asyncio.sleep(0.05)

    timeout = aiohttp.ClientTimeout(total=120)
    async with aiohttp.ClientSession(timeout=timeout) as http:
        probe = asyncio.create_task(asyncio.to_thread(_healthz_latencies, allocator.url, done))
        lease = asyncio.create_task(watch_lease())
        await asyncio.sleep(0.1)
        started = time.monotonic()
        status, answer = await post(http, f"{allocator.url}/scheduler/{verb}", body)
        took = time.monotonic() - started
        await asyncio.sleep(0.5)  # a renewal missed during the filter shows by now
        done.set()
        stop_watch.set()
        latencies, _ = await asyncio.gather(probe, lease)
    assert status == 200, answer
    if verb == "filter":
        assert len(answer["NodeNames"]) == 20
        assert len(answer["FailedNodes"]) == 100_000
    else:
        scores = {entry["Host"]: entry["Score"] for entry in answer}
        assert len(scores) == 100_020 and not any(scores[f"node-{i:06d}"] for i in range(100_000))
        assert any(scores[f"real-{i}"] for i in range(20))
    # Relative, so the load of a shared machine scales both sides: a loop frozen for the
    # filter makes one probe wait most of it (measured 0.41-0.48 s of a 0.55-0.59 s filter
    # before slicing); sliced, no probe waits more than a slice (~0.1 s of ~0.9 s). A request
    # answered in well under half a second cannot starve a probe that matters, and the one
    # unsliced step (decoding the body) is then a large share of it (CI: 0.08 s of 0.13 s).
    allowed = max(took / 2, 0.25)
    assert max(latencies) < allowed, (max(latencies), took, len(latencies))
    assert len(latencies) >= 3, (latencies, took)
    assert not lost, f"the lease was lost during a {took:.1f}s {verb}"
    print(f"{verb} of {len(names)} nodes: {took:.2f}s; healthz max {max(latencies) * 1000:.0f} ms "
          f"over {len(latencies)} probes")  # fmt: skip


async def test_the_webhook_refuses_non_utf8_and_oversized_reviews(
    make_allocator: MakeAllocator, tmp_path: Path
) -> None:
    cert, key = self_signed(tmp_path)
    allocator = await make_allocator(
        webhook_port=0, webhook_host="127.0.0.1", tls_cert_file=cert, tls_key_file=key,
        webhook_max_body_bytes=8192,
    )  # fmt: skip
    trust = ssl.create_default_context(cafile=cert)
    review = review_of({"metadata": {"name": "p"}, "spec": {"containers": []}})
    body = json.dumps(review).encode().replace(b'"name": "p"', b'"name": "\xff"')
    status, answer = await call((allocator, trust), body)
    assert status == 400
    assert answer["error"].startswith(
        "AdmissionReview.request.object.metadata.name: not valid UTF-8 (byte 0xff"
    ), answer
    review["request"]["object"]["metadata"]["labels"] = {"big": "x" * 10_000}
    status, answer = await call((allocator, trust), review)
    assert status == 413
    assert "8192-byte limit (setting webhook_max_body_bytes)" in answer["error"]


async def test_the_metrics_service_refuses_bodies_past_its_limit(nats_server) -> None:
    metrics = MetricsService(
        MetricsSettings(nats_url=nats_server.url, http_port=0, max_body_bytes=1024)
    )
    await metrics.start()
    try:
        async with aiohttp.ClientSession() as http:
            async with http.get(f"{metrics.url}/healthz", data=b"x" * 2048) as response:
                assert response.status == 413
                assert "1024-byte limit" in (await response.json())["error"]
            async with http.get(f"{metrics.url}/healthz") as response:
                assert response.status == 200
    finally:
        await metrics.stop()


async def test_a_flood_of_bad_requests_is_counted_each_time_and_logged_once(
    allocator: Allocator, http: aiohttp.ClientSession, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="vgpu.allocator")
    for _ in range(200):
        status, _ = await post(http, f"{allocator.url}/scheduler/filter", b"{not json")
        assert status == 400
    lines = [r for r in caplog.records if r.getMessage() == "bad extender request"]
    assert len(lines) <= 1, len(lines)  # one a minute per verb (none if logged a moment ago)
    async with http.get(f"{allocator.url}/metrics") as response:
        text = await response.text()
    counted = re.search(
        r'vgpu_allocator_extender_requests_total\{outcome="bad_request",verb="filter"\} (\S+)', text
    )
    assert counted and float(counted.group(1)) >= 200
