"""The dashboard in a real headless Chromium, against the whole local system (`vgpu up`).

Set VGPU_DASHBOARD_PNG=docs/dashboard.png to refresh the screenshot in the docs; the test
always saves one under its tmp_path.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from services.cli.local_cluster import LocalCluster, LocalClusterSpec
from services.cli.submit import load_pod, submit
from services.common import subjects
from services.common.bus import Bus
from services.common.embedded_nats import EmbeddedNats
from services.common.schemas import (
    AllocationEvent,
    ContainerAllocation,
    ContainerDeviceUsage,
    ContainerRequest,
    ContainerUsage,
    GpuDevice,
    GpuSlice,
    NodeInventory,
    PendingPod,
    PendingReason,
    PodAllocation,
)
from services.metrics.service import MetricsService
from services.metrics.settings import MetricsSettings
from tests.metrics.helpers import announce

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


@pytest.fixture
async def cluster() -> AsyncIterator[LocalCluster]:
    system = LocalCluster(LocalClusterSpec(allocator_port=0, metrics_port=0, heartbeat_s=1.0))
    await system.start()
    try:
        yield system
    finally:
        await system.stop()


async def test_a_submitted_pod_appears_as_a_named_slice_live(
    cluster: LocalCluster, page: Any, tmp_path: Path
) -> None:
    state = cluster.state()
    await page.goto(state.metrics_url)  # sends the browser to the sign-in form
    await page.fill('input[name="token"]', cluster.admin_token)
    await page.click('button[type="submit"]')
    await page.wait_for_selector("#status.live")
    await page.wait_for_selector('.node[data-node="node-1"][data-state="up"] .gpu')
    await page.wait_for_selector('.node[data-node="node-2"] .gpu')
    assert await page.locator(".slice").count() == 0

    outcome = await submit(load_pod(EXAMPLES / "half-gpu.yaml"), state)
    assert outcome.node and not outcome.reason
    gpu = outcome.containers[0].gpus[0]
    # No reload: the slice arrives over the live stream, on the GPU it was given.
    on_gpu = f'.gpu[data-uuid="{gpu}"]'
    memory_slice = page.locator(f'{on_gpu} .bar.memory .slice[data-pod="default/half-gpu"]')
    await memory_slice.wait_for()
    # namespace/pod · container: two namespaces' pods of one name stay apart.
    assert await memory_slice.inner_text() == "default/half-gpu \u00b7 cuda"
    style = await memory_slice.get_attribute("style") or ""
    assert "width:50%" in style.replace(" ", "")  # 20480 of 40960 MiB
    compute = page.locator(f'{on_gpu} .bar.compute .slice[data-pod="default/half-gpu"]')
    await compute.wait_for()

    relay = await Bus.connect(state.nats_url, "test-relay")
    try:
        # What the node agent relays from the hook, and what the allocator says of a pod
        # that waits (docs/events.md); both are other services' publications.
        await relay.publish(subjects.container_usage(outcome.node), ContainerUsage(
            node=outcome.node, namespace="default", pod="half-gpu", container="cuda",
            devices=[ContainerDeviceUsage(uuid=gpu, index=0, memory_used_mib=12288,
                                          memory_limit_mib=20480, cores_limit=50,
                                          sm_util_percent=41.0)],
            processes=2, throttled_ms=1500,
        ))  # fmt: skip
        await relay.publish(subjects.alloc_pending(), PendingPod(
            namespace="research", name="big-model", uid="uid-big",
            requests=[ContainerRequest(container="train", gpus=2, memory_mib=36000, cores=80)],
            reasons=[PendingReason(message="container 'train' needs 2 GPUs each with 36000 MiB "
                                           "and 80% compute free; 1 of 4 GPUs have that room",
                                   nodes=["node-1", "node-2"], node_count=2)],
        ))  # fmt: skip

    finally:
        await relay.close()

    pending = page.locator('#pending li[data-pod="research/big-model"]')
    await pending.wait_for()
    assert "1 of 4 GPUs have that room" in await pending.inner_text()
    assert "train: 2 \u00d7 35.2 GiB, 80% compute" in await pending.inner_text()
    await page.wait_for_function("document.querySelector('#totals').innerText.includes('pending')")

    await memory_slice.click()
    view = page.locator("#pod [data-pod-view='default/half-gpu']")
    await view.wait_for()
    await page.wait_for_function("document.querySelector('#pod').innerText.includes('12 GiB')")
    text = await page.locator("#pod").inner_text()
    assert "container cuda" in text and "2 process(es)" in text and "throttled 1.5 s" in text
    assert "20 GiB" in text and "50%" in text and "41%" in text

    shot = tmp_path / "dashboard.png"
    await page.screenshot(path=str(shot), full_page=True)
    assert shot.stat().st_size > 10_000
    if target := os.environ.get("VGPU_DASHBOARD_PNG"):
        shutil.copyfile(shot, target)


async def test_a_silent_node_is_drawn_as_silent_not_idle(
    nats_server: EmbeddedNats, bus: Bus, page: Any
) -> None:
    service = MetricsService(MetricsSettings(nats_url=nats_server.url, http_port=0,
                                             stale_after_s=1.0, stream_interval_s=0.1))  # fmt: skip
    await service.start()
    try:
        gpu = GpuDevice(uuid="GPU-quiet", index=0, model="T4", memory_mib=15360)
        await announce(bus, service, NodeInventory(node="node-q", gpus=[gpu]))
        await page.goto(service.url)
        await page.wait_for_selector('.node[data-node="node-q"][data-state="up"]')
        # Nothing more is sent: within a second or two the page says the node went silent.
        card = page.locator('.node[data-node="node-q"][data-state="silent"]')
        await card.wait_for(timeout=10_000)
        assert "figures unknown" in await card.inner_text()
        assert "used unknown" in await card.inner_text()
    finally:
        await service.stop()


async def test_a_slice_the_node_agent_flags_is_marked(
    nats_server: EmbeddedNats, bus: Bus, page: Any
) -> None:
    """The node agent's verification flags a container in its usage: its slice is outlined
    and its pod view shows a badge and NVML's figure."""
    service = MetricsService(MetricsSettings(nats_url=nats_server.url, http_port=0,
                                             stream_interval_s=0.1))  # fmt: skip
    await service.start()
    try:
        gpu = GpuDevice(uuid="GPU-v", index=0, model="A100-40GB", memory_mib=40960)
        await announce(bus, service, NodeInventory(node="node-v", gpus=[gpu]))
        allocation = PodAllocation(
            namespace="ml", name="train", uid="uid-train", node="node-v",
            containers={"main": ContainerAllocation(container="main", claimed=True, slices=[
                GpuSlice(uuid="GPU-v", index=0, memory_mib=1024, cores=50)])},
        )  # fmt: skip
        await bus.publish(subjects.alloc_events("node-v"),
                          AllocationEvent(kind="bound", allocation=allocation))  # fmt: skip
        await bus.publish(subjects.container_usage("node-v"), ContainerUsage(
            node="node-v", namespace="ml", pod="train", container="main",
            devices=[ContainerDeviceUsage(uuid="GPU-v", index=0, memory_used_mib=1000,
                                          memory_limit_mib=1024, cores_limit=50,
                                          measured_mib=41960, violation="over_limit")],
        ))  # fmt: skip
        await page.goto(service.url)
        flagged = page.locator('.bar.memory .slice.violation.over-limit[data-pod="ml/train"]')
        await flagged.wait_for()
        assert "OVER LIMIT (NVML measures 41 GiB)" in (await flagged.get_attribute("title") or "")
        assert (await flagged.locator(".label").inner_text()).endswith("ml/train · main")
        await flagged.click()
        badge = page.locator("#pod .badge.violation.over-limit")
        await badge.wait_for()
        assert await badge.inner_text() == "over limit"
        assert await page.locator("#pod td.violation").inner_text() == "41 GiB"
    finally:
        await service.stop()
