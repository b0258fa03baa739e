"""`vgpu inspect` against a real metrics service holding a known picture."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from click.testing import CliRunner, Result

from services.cli.inspect import inspect_command, kubectl_main
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
    GpuUsage,
    NodeInventory,
    NodeUsage,
    PendingPod,
    PendingReason,
    PodAllocation,
)
from services.metrics.service import MetricsService
from services.metrics.settings import MetricsSettings
from tests.metrics.helpers import announce, wait_for

ROOT = Path(__file__).resolve().parents[2]
GPUS = [GpuDevice(uuid=f"GPU-{i}", index=i, model="A100-40GB", memory_mib=40960) for i in (0, 1)]
HALF = PodAllocation(
    namespace="default", name="half-gpu", uid="uid-half", node="node-1",
    containers={"cuda": ContainerAllocation(container="cuda", claimed=True, slices=[
        GpuSlice(uuid="GPU-0", index=0, memory_mib=20480, cores=50)])},
)  # fmt: skip
QUARTER = PodAllocation(
    namespace="team", name="notebook", uid="uid-nb", node="node-1",
    containers={"lab": ContainerAllocation(container="lab", slices=[
        GpuSlice(uuid="GPU-0", index=0, memory_mib=10240, cores=0)])},
)  # fmt: skip

EXPECTED_TABLE = """\
NODE    STATE  GPU  MODEL      MEMORY MiB (ALLOC/TOTAL)  COMPUTE (ALLOC/TOTAL)  USED MiB  SM   PODS
node-1  up     0    A100-40GB  30720/40960 (75%)         50/100%                16000     62%  default/half-gpu,team/notebook
               1    A100-40GB  0/40960 (0%)              0/100%                 0         0%   -
------------------------------------------------------------------------
Allocated/Total GPU memory in cluster: 30720/81920 MiB (38%)
Allocated/Total compute in cluster:    50/200% (25%)
Nodes up: 1/1  GPUs: 2 (2 healthy)  Slices: 2  Pods: 2  Stranded memory: 51200 MiB of 51200 MiB free
"""  # noqa: E501


@pytest.fixture
async def known(nats_server: EmbeddedNats, bus: Bus) -> AsyncIterator[MetricsService]:
    """One node, two GPUs: two pods share GPU 0, one pod waits for 2 x 16 GiB."""
    service = MetricsService(MetricsSettings(nats_url=nats_server.url, http_port=0))
    await service.start()
    await announce(bus, service, NodeInventory(node="node-1", gpus=GPUS))
    await bus.publish(subjects.usage("node-1"), NodeUsage(node="node-1", gpus=[
        GpuUsage(uuid="GPU-0", memory_used_mib=16000, sm_util_percent=62.4),
        GpuUsage(uuid="GPU-1", memory_used_mib=0, sm_util_percent=0.0)]))  # fmt: skip
    for allocation in (HALF, QUARTER):
        await bus.publish(subjects.alloc_events("node-1"),
                          AllocationEvent(kind="bound", allocation=allocation))  # fmt: skip
    await bus.publish(subjects.container_usage("node-1"), ContainerUsage(
        node="node-1", namespace="default", pod="half-gpu", container="cuda",
        devices=[ContainerDeviceUsage(uuid="GPU-0", index=0, memory_used_mib=12288,
                                      memory_limit_mib=20480, cores_limit=50,
                                      sm_util_percent=41.0)]))  # fmt: skip
    await bus.publish(subjects.alloc_pending(), PendingPod(
        namespace="research", name="pair", uid="uid-pair",
        requests=[ContainerRequest(container="train", gpus=2, memory_mib=16384, cores=30)],
        reasons=[PendingReason(message="needs 2 GPUs each with 16384 MiB free; 1 of 2 have it",
                               nodes=["node-1"], node_count=1)]))  # fmt: skip
    picture = service.picture
    await wait_for(lambda: len(picture.pods) == 2 and picture.containers and picture.pending
                   and picture.nodes["node-1"].usage)  # fmt: skip
    yield service
    await service.stop()


async def run(*args: str) -> Result:
    """The command in a worker thread: it blocks on HTTP while this loop serves it."""
    return await asyncio.to_thread(CliRunner().invoke, inspect_command, list(args))


async def test_table_for_a_known_state(known: MetricsService) -> None:
    result = await run("--metrics-url", known.url)
    assert result.exit_code == 0, result.output
    table, pending = result.output.split("\n\n", 1)
    assert table + "\n" == EXPECTED_TABLE
    lines = pending.splitlines()
    assert lines[0] == "Pending pods (1):"
    assert lines[1].split() == ["POD", "WAITING", "ASKS", "REASON"]
    assert lines[2].startswith("research/pair")
    assert "train: 2x 16384 MiB, 30%" in lines[2]
    assert lines[2].endswith("1 node: needs 2 GPUs each with 16384 MiB free; 1 of 2 have it")


async def test_a_long_pending_list_says_how_much_it_shows(
    nats_server: EmbeddedNats, bus: Bus
) -> None:
    service = MetricsService(MetricsSettings(nats_url=nats_server.url, http_port=0,
                                             pending_shown=2))  # fmt: skip
    await service.start()
    try:
        for number in range(3):
            waiting = PendingPod(
                namespace="batch",
                name=f"job-{number}",
                uid=f"uid-{number}",
                requests=[ContainerRequest(container="main", gpus=1)],
            )
            await bus.publish(subjects.alloc_pending(), waiting)
        await wait_for(lambda: len(service.picture.pending) == 3)
        result = await run("--metrics-url", service.url)
        assert result.exit_code == 0, result.output
        pending = result.output.split("\n\n", 1)[1].splitlines()
        assert pending[0] == "Pending pods (showing 2 of 3, longest waiting first):"
        assert [line.split()[0] for line in pending[2:]] == ["batch/job-0", "batch/job-1"]
    finally:
        await service.stop()


async def test_details_show_each_slice_and_every_reason(known: MetricsService) -> None:
    result = await run("--metrics-url", known.url, "-d")
    assert result.exit_code == 0, result.output
    slices = [line.split(None, 1)[0:1] + line.split()[1:] for line in result.output.splitlines()
              if line.startswith(" ") and "/" in line and "asked" in line]  # fmt: skip
    assert slices == [
        ["default/half-gpu/cuda", "20480", "asked,", "20480", "limit", "50%", "asked", "12288",
         "41%"],
        ["team/notebook/lab", "10240", "asked,", "10240", "limit", "none", "asked", "?", "?"],
    ]  # fmt: skip
    assert "  needs 2 GPUs each with 16384 MiB free; 1 of 2 have it (1 node(s): node-1)" in (
        result.output
    )


async def test_json_output_is_the_metrics_picture(known: MetricsService) -> None:
    result = await run("--metrics-url", known.url, "-o", "json", "--node", "node-1")
    assert result.exit_code == 0, result.output
    body = json.loads(result.output)
    assert body["totals"]["memory_allocated_mib"] == 30720
    assert [p["name"] for p in body["pods"]] == ["half-gpu", "notebook"]
    assert body["pending"][0]["name"] == "pair"
    assert body["nodes"][0]["gpus"][0]["stranded_memory_mib"] == 10240


async def test_a_silent_node_and_an_unknown_node(known: MetricsService) -> None:
    known.picture.nodes["node-1"].seen -= 3600  # as if it had said nothing for an hour
    result = await run("--metrics-url", known.url)
    assert "node-1  silent 3600s  0" in result.output.replace("   ", "  ")
    assert "?" in result.output.splitlines()[1]  # used memory unknown, not 0
    missing = await run("--metrics-url", known.url, "--node", "node-9")
    assert missing.exit_code == 1
    assert "no such node in the picture: node-9" in missing.output


def test_errors_name_what_is_wrong(tmp_path: Path) -> None:
    with socket.socket() as unused:
        unused.bind(("127.0.0.1", 0))
        port = unused.getsockname()[1]
    result = CliRunner().invoke(inspect_command, ["--metrics-url", f"http://127.0.0.1:{port}"])
    assert result.exit_code == 1
    assert f"cannot reach the metrics service at http://127.0.0.1:{port}" in result.output
    absent = tmp_path / "absent.json"
    result = CliRunner().invoke(inspect_command, ["--state-file", str(absent)])
    assert result.exit_code == 1
    assert "no running `vgpu up` found" in result.output and "--metrics-url" in result.output


def test_kubectl_plugin_and_vgpu_both_offer_inspect() -> None:
    assert "inspect" in CliRunner().invoke(kubectl_main, ["--help"]).output
    result = subprocess.run([sys.executable, "-m", "services.cli.main", "inspect", "--help"],
                            cwd=ROOT, capture_output=True, text=True, timeout=60)  # fmt: skip
    assert result.returncode == 0 and "--metrics-url" in result.stdout
    plugin = Path(sys.executable).parent / "kubectl-vgpu"
    if plugin.exists():  # installed by `pip install -e .`
        env = {**os.environ, "VGPU_METRICS_URL": "http://127.0.0.1:1"}
        done = subprocess.run([str(plugin), "inspect"], capture_output=True, text=True,
                              env=env, timeout=60)  # fmt: skip
        assert done.returncode == 1 and "cannot reach the metrics service" in done.stderr


async def test_a_slice_the_node_agent_flags_is_shown(known: MetricsService, bus: Bus) -> None:
    """The agent's verification flags the container in its usage (over its slice by NVML,
    and its hook's figure disagrees): the table and the JSON say so without -d."""
    await bus.publish(subjects.container_usage("node-1"), ContainerUsage(
        node="node-1", namespace="default", pod="half-gpu", container="cuda",
        devices=[ContainerDeviceUsage(uuid="GPU-0", index=0, memory_used_mib=12288,
                                      memory_limit_mib=20480, cores_limit=50,
                                      sm_util_percent=41.0, measured_mib=30000,
                                      violation="over_limit,tampering")]))  # fmt: skip
    picture = known.picture
    await wait_for(lambda: any(s.usage.devices[0].violation for s in picture.containers.values()))
    result = await run("--metrics-url", known.url)
    assert result.exit_code == 0, result.output
    assert "default/half-gpu (!),team/notebook" in result.output
    lines = result.output.splitlines()
    at = lines.index("Slice violations (1):")
    assert lines[at + 1].split() == [
        "CONTAINER", "NODE", "GPU", "VIOLATION", "NVML", "MiB", "SLICE", "MiB", "HOOK", "MiB"
    ]  # fmt: skip
    assert lines[at + 2].split() == [
        "default/half-gpu/cuda", "node-1", "0", "over_limit,tampering", "30000", "20480", "12288"
    ]  # fmt: skip
    detailed = await run("--metrics-url", known.url, "-d")
    assert "VIOLATION: over_limit,tampering" in detailed.output
    body = json.loads((await run("--metrics-url", known.url, "-o", "json")).output)
    piece = body["nodes"][0]["gpus"][0]["slices"][0]
    assert (piece["violation"], piece["measured_mib"]) == ("over_limit,tampering", 30000)
    device = body["pods"][0]["containers"][0]["devices"][0]
    assert (device["violation"], device["measured_mib"]) == ("over_limit,tampering", 30000)
