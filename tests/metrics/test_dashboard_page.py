"""What the dashboard shows, checked through its JSON API, its live stream and its page
(no browser here: the page's texts come from static/format.js, run under Node.js).

- the node agent's standing findings (over_limit, tampering) on each slice, with its reasons;
- namespace and container on every slice;
- one unit for every memory figure, chosen once by the service;
- a bounded pending list with the count of all pending pods.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import aiohttp
import pytest

from services.common import subjects
from services.common.bus import Bus
from services.common.embedded_nats import EmbeddedNats
from services.common.schemas import (
    AllocationEvent,
    ContainerDeviceUsage,
    ContainerRequest,
    ContainerUsage,
    PendingPod,
    SliceViolation,
)
from services.metrics.service import REJECTED, MetricsService
from services.metrics.views import SliceView
from tests.metrics.helpers import (
    ALLOCATION,
    CONTAINER_USAGE,
    INVENTORY,
    announce,
    get_json,
    settings,
    wait_for,
)
from tests.metrics.test_api_stream import next_event

STATIC = Path(__file__).resolve().parents[2] / "services" / "metrics" / "static"
OVER = "NVML shows 41960 MiB for the container's processes on the GPU, over its slice"
LIES = "the container's hooks report 8192 MiB on the GPU while NVML shows 41960 MiB"


def violation(kind: str, reason: str, pod: str = "half") -> SliceViolation:
    return SliceViolation(
        node="node-a", namespace="team", pod=pod, container="main", gpu="GPU-a0",
        kind=kind, reason=reason, limit_mib=20480, measured_mib=41960, tolerance_mib=1024,
    )  # fmt: skip


def usage_flagged(flags: str) -> ContainerUsage:
    device = CONTAINER_USAGE.devices[0]
    return ContainerUsage(
        node="node-a", namespace="team", pod="half", container="main", processes=2,
        devices=[ContainerDeviceUsage(
            uuid=device.uuid, index=0, memory_used_mib=device.memory_used_mib,
            memory_limit_mib=device.memory_limit_mib, cores_limit=device.cores_limit,
            measured_mib=41960, violation=flags)],
    )  # fmt: skip


def the_slice(metrics: MetricsService) -> SliceView:
    return metrics.view().nodes[0].gpus[0].slices[0]


async def bound_pod(bus: Bus, metrics: MetricsService) -> None:
    await announce(bus, metrics, INVENTORY)
    await bus.publish(subjects.alloc_events("node-a"),
                      AllocationEvent(kind="bound", allocation=ALLOCATION))  # fmt: skip
    await wait_for(lambda: metrics.picture.pods)


async def test_findings_of_the_node_agent_are_flags_on_the_slice(
    metrics: MetricsService, bus: Bus
) -> None:
    await bound_pod(bus, metrics)
    await bus.publish(subjects.violations("node-a"), violation("over_limit", OVER))
    await wait_for(lambda: the_slice(metrics).over_limit)
    # The agent's usage report names both findings: the second without a sentence yet.
    await bus.publish(subjects.container_usage("node-a"), usage_flagged("over_limit,tampering"))
    await wait_for(lambda: the_slice(metrics).tampering)
    await bus.publish(subjects.violations("node-a"), violation("tampering", LIES))
    await wait_for(lambda: len(the_slice(metrics).violation_reasons) == 2)

    status, body = await get_json(metrics, "/api/v1/picture")
    assert status == 200 and isinstance(body, dict)
    piece = body["nodes"][0]["gpus"][0]["slices"][0]
    assert (piece["namespace"], piece["pod"], piece["container"]) == ("team", "half", "main")
    assert (piece["over_limit"], piece["tampering"], piece["violation"]) == (
        True, True, "over_limit,tampering")  # fmt: skip
    assert piece["violation_reasons"] == [OVER, LIES]
    assert piece["measured_mib"] == 41960 and piece["violation_since"] > 0
    status, pod = await get_json(metrics, "/api/v1/pods/team/half")
    assert status == 200 and isinstance(pod, dict)
    device = pod["containers"][0]["devices"][0]
    assert (device["over_limit"], device["tampering"]) == (True, True)
    assert device["violation_reasons"] == [OVER, LIES]

    # A third kind, found from NVML's SM samples, is a flag of its own.
    await bus.publish(subjects.container_usage("node-a"),
                      usage_flagged("over_limit,tampering,over_compute"))  # fmt: skip
    await wait_for(lambda: the_slice(metrics).over_compute)
    assert the_slice(metrics).violation == "over_limit,tampering,over_compute"

    # The finding ends when the agent's report no longer names it.
    await bus.publish(subjects.container_usage("node-a"), usage_flagged("tampering"))
    await wait_for(lambda: not the_slice(metrics).over_limit)
    piece_now = the_slice(metrics)
    assert (piece_now.tampering, piece_now.violation, piece_now.violation_reasons) == (
        True, "tampering", [LIES])  # fmt: skip
    await bus.publish(subjects.container_usage("node-a"), usage_flagged(""))
    await wait_for(lambda: not the_slice(metrics).tampering)
    assert the_slice(metrics).violation == "" and metrics.picture.findings == {}


async def test_findings_go_with_their_pod_and_unknown_pods_are_refused(
    metrics: MetricsService, bus: Bus
) -> None:
    await bound_pod(bus, metrics)
    refused = REJECTED.labels(kind="violation", reason="unknown_pod")
    before = refused._value.get()
    await bus.publish(subjects.violations("node-a"), violation("over_limit", OVER, pod="ghost"))
    await wait_for(lambda: refused._value.get() == before + 1)
    assert metrics.picture.findings == {}

    await bus.publish(subjects.violations("node-a"), violation("over_limit", OVER))
    await wait_for(lambda: metrics.picture.findings)
    await bus.publish(subjects.alloc_events("node-a"),
                      AllocationEvent(kind="released", allocation=ALLOCATION))  # fmt: skip
    await wait_for(lambda: not metrics.picture.pods)
    assert metrics.picture.findings == {}


async def test_the_stream_carries_a_new_finding(metrics: MetricsService, bus: Bus) -> None:
    await bound_pod(bus, metrics)
    async with (
        aiohttp.ClientSession() as session,
        session.get(f"{metrics.url}/api/v1/events") as resp,
    ):
        name, snapshot = await next_event(resp.content)
        assert name == "snapshot" and snapshot["memory_unit"] == "GiB"
        await bus.publish(subjects.violations("node-a"), violation("over_limit", OVER))
        while True:
            name, batch = await next_event(resp.content)
            pieces = [s for n in batch["nodes"] for g in n["gpus"] for s in g["slices"]]
            if pieces and pieces[0]["over_limit"]:
                break
        assert pieces[0]["violation_reasons"] == [OVER]
        assert batch["pods"][0]["containers"][0]["devices"][0]["over_limit"] is True


def pending(number: int) -> PendingPod:
    return PendingPod(
        namespace="batch", name=f"job-{number:04d}", uid=f"uid-job-{number}",
        requests=[ContainerRequest(container="main", gpus=1, memory_mib=30000)],
    )  # fmt: skip


async def test_the_pending_list_is_bounded_and_counts_all(
    nats_server: EmbeddedNats, bus: Bus
) -> None:
    metrics = MetricsService(settings(nats_server.url, pending_shown=5))
    await metrics.start()
    try:
        await announce(bus, metrics, INVENTORY)
        async with (
            aiohttp.ClientSession() as session,
            session.get(f"{metrics.url}/api/v1/events") as resp,
        ):
            assert (await next_event(resp.content))[0] == "snapshot"
            for number in range(120):
                await bus.publish(subjects.alloc_pending(), pending(number))
            await wait_for(lambda: len(metrics.picture.pending) == 120)
            while True:  # every change batch lists at most 5 (the latest one counts all)
                _, batch = await next_event(resp.content)
                assert batch["pending"] is None or len(batch["pending"]) <= 5
                if batch["totals"]["pending_pods"] == 120:
                    break

        status, body = await get_json(metrics, "/api/v1/picture")
        assert status == 200 and isinstance(body, dict)
        assert body["totals"]["pending_pods"] == 120
        assert [p["name"] for p in body["pending"]] == [f"job-{n:04d}" for n in range(5)]

        async with aiohttp.ClientSession() as session:
            async with session.get(f"{metrics.url}/api/v1/pending") as resp:
                shown = await resp.json()
                assert resp.headers["X-Total-Count"] == "120" and len(shown) == 5
            async with session.get(f"{metrics.url}/api/v1/pending?limit=1000") as resp:
                every = await resp.json()
                assert resp.status == 200 and len(every) == 120
                assert every[-1]["name"] == "job-0119"  # the newest last
            for bad in ("0", "abc", "-3", "1e9", "\u0663", "100001"):
                async with session.get(f"{metrics.url}/api/v1/pending",
                                       params={"limit": bad}) as resp:  # fmt: skip
                    assert resp.status == 400, bad
                    assert "limit must be a whole number" in (await resp.json())["error"]
        # The exporter still counts every one of them.
        assert "vgpu_pending_pods" in {f.name for f in metrics._registry.collect()}
        waiting = [s.value for f in metrics._registry.collect() if f.name == "vgpu_pending_pods"
                   for s in f.samples if s.labels["unresolvable"] == "false"]  # fmt: skip
        assert waiting == [120]
    finally:
        await metrics.stop()


async def test_the_memory_unit_is_chosen_once_by_the_service(
    nats_server: EmbeddedNats, metrics: MetricsService
) -> None:
    status, body = await get_json(metrics, "/api/v1/picture")
    assert status == 200 and isinstance(body, dict) and body["memory_unit"] == "GiB"
    in_mib = MetricsService(settings(nats_server.url, memory_unit="MiB"))
    await in_mib.start()
    try:
        status, body = await get_json(in_mib, "/api/v1/picture")
        assert isinstance(body, dict) and body["memory_unit"] == "MiB"
    finally:
        await in_mib.stop()


async def test_the_page_loads_its_texts_and_has_a_place_for_the_pending_count(
    metrics: MetricsService,
) -> None:
    async with aiohttp.ClientSession() as session:
        async with session.get(metrics.url + "/") as resp:
            page = await resp.text()
        async with session.get(metrics.url + "/static/format.js") as resp:
            assert resp.status == 200 and "function memory(" in await resp.text()
    assert page.index('src="/static/format.js"') < page.index('src="/static/dashboard.js"')
    assert 'id="pending-count"' in page and 'id="pending-note"' in page
    script = (STATIC / "dashboard.js").read_text()
    # One formatter for memory on the whole page: no figure is written with its own unit.
    assert script.count("MiB") == 0 and script.count("GiB") == 0
    assert "memory(value, state.memoryUnit)" in script


NODE = shutil.which("node")


def run_format(expression: str) -> object:
    """Evaluate an expression over the page's format.js in Node.js; its JSON result."""
    assert NODE is not None
    program = (f"const f = require({json.dumps(str(STATIC / 'format.js'))});"
               f"process.stdout.write(JSON.stringify({expression}));")  # fmt: skip
    done = subprocess.run([NODE, "-e", program], capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


@pytest.mark.skipif(NODE is None, reason="no Node.js to run the page's format.js")
def test_the_pages_texts() -> None:
    figures = [0, 1, 100, 1024, 20480, 36000, 40960, 41960, 143360, None]
    assert run_format(f"{json.dumps(figures)}.map((v) => f.memory(v, 'GiB'))") == [
        "0 GiB", "<0.01 GiB", "0.1 GiB", "1 GiB", "20 GiB", "35.2 GiB", "40 GiB", "41 GiB",
        "140 GiB", "?",
    ]  # fmt: skip
    assert run_format(f"{json.dumps(figures)}.map((v) => f.memory(v, 'MiB'))") == [
        "0 MiB", "1 MiB", "100 MiB", "1,024 MiB", "20,480 MiB", "36,000 MiB", "40,960 MiB",
        "41,960 MiB", "143,360 MiB", "?",
    ]  # fmt: skip
    assert run_format("[f.pendingNote(50, 1234), f.pendingNote(3, 3)]") == [
        "showing 50 of 1,234 pending, longest waiting first", "",
    ]  # fmt: skip
    piece = {"namespace": "team", "pod": "half", "container": "main", "over_limit": True,
             "tampering": True, "measured_mib": 41960,
             "violation_reasons": [OVER, LIES]}  # fmt: skip
    assert run_format(f"f.sliceLabel({json.dumps(piece)})") == "team/half · main"
    assert run_format(f"f.violationFlags({json.dumps(piece)})") == [
        {"kind": "over-limit", "text": "over limit"}, {"kind": "tampering", "text": "tampering"},
    ]  # fmt: skip
    compute = {**piece, "over_limit": False, "tampering": False, "over_compute": True}
    assert run_format(f"f.violationFlags({json.dumps(compute)})") == [
        {"kind": "over-compute", "text": "over compute"}]  # fmt: skip
    assert run_format(f"f.violationText({json.dumps(piece)}, 'MiB')") == (
        f"OVER LIMIT + TAMPERING (NVML measures 41,960 MiB): {OVER}; {LIES}"
    )
    clean = {**piece, "over_limit": False, "tampering": False}
    assert run_format(f"[f.violationFlags({json.dumps(clean)}), "
                      f"f.violationText({json.dumps(clean)}, 'GiB')]") == [[], ""]  # fmt: skip


def render_page(snapshot: object, hash_: str = "") -> dict[str, str]:
    """The page's real scripts rendering a snapshot (tests/metrics/render_page.js): the
    outerHTML of each element index.html names by id."""
    assert NODE is not None
    harness = Path(__file__).with_name("render_page.js")
    done = subprocess.run([NODE, str(harness), hash_], input=json.dumps(snapshot),
                          capture_output=True, text=True, timeout=30)  # fmt: skip
    assert done.returncode == 0, done.stderr
    rendered: dict[str, str] = json.loads(done.stdout)
    return rendered


def text_of(html: str) -> str:
    return re.sub(r"<[^>]*>", " ", html)


@pytest.mark.skipif(NODE is None, reason="no Node.js to run the page's scripts")
@pytest.mark.parametrize("unit", ["GiB", "MiB"])
async def test_the_rendered_page(nats_server: EmbeddedNats, bus: Bus, unit: str) -> None:
    metrics = MetricsService(settings(nats_server.url, pending_shown=5, memory_unit=unit))
    await metrics.start()
    try:
        await bound_pod(bus, metrics)
        await bus.publish(subjects.container_usage("node-a"), usage_flagged("over_limit"))
        await bus.publish(subjects.violations("node-a"), violation("over_limit", OVER))
        for number in range(7):
            await bus.publish(subjects.alloc_pending(), pending(number))
        await wait_for(lambda: len(metrics.picture.pending) == 7
                       and the_slice(metrics).violation_reasons)  # fmt: skip
        status, snapshot = await get_json(metrics, "/api/v1/picture")
        assert status == 200
    finally:
        await metrics.stop()
    page = render_page(snapshot, "#pod/team/half")

    # The slice: whose, down to the container, and the agent's flag with its sentence.
    nodes = page["nodes"]
    assert re.search(r'<div class="slice selected violation over-limit" [^>]*'
                     r'data-namespace="team"'
                     r'[^>]*data-container="main"', nodes), nodes  # fmt: skip
    assert '<b class="flag over-limit">over limit</b>team/half · main' in nodes
    assert "OVER LIMIT (NVML measures" in nodes and OVER in nodes
    assert '<span class="badge violation over-limit"' in page["pod"]

    # The pending list: the longest waiting five, and how many there are in all.
    assert text_of(page["pending-count"]).strip() == "7"
    assert "showing 5 of 7 pending, longest waiting first" in page["pending-note"]
    assert len(re.findall(r"<li [^>]*data-pod=", page["pending"])) == 5
    assert "batch/job-0000" in page["pending"] and "batch/job-0005" not in page["pending"]

    # One unit for every memory figure on the page.
    shown = " ".join(text_of(html) for html in page.values())
    other = "MiB" if unit == "GiB" else "GiB"
    assert unit in shown and other not in shown, shown
    figure = "40 GiB" if unit == "GiB" else "40,960 MiB"
    assert f"20 GiB / {figure}" in shown if unit == "GiB" else f"20,480 MiB / {figure}" in shown
