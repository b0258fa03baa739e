"""The 4paradigm vGPU device plugin's flags on `vgpu node-agent`, as its DaemonSet passes
them (`--device-split-count=10 --device-memory-scaling=1 --device-cores-scaling=1
--fail-on-init-error=true`), through the real agent: the command line, the kubelet simulator
over gRPC and the inventory on a real NATS server."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

import pytest

from services.common import subjects
from services.common.bus import Bus
from services.common.config import load_settings
from services.common.embedded_nats import EmbeddedNats
from services.common.schemas import NodeInventory
from services.nodeagent.gpus import NvmlGpuBackend, NvmlInitError
from services.nodeagent.service import NodeAgent
from services.nodeagent.settings import NodeAgentSettings
from services.simulators.kubelet import KubeletSimulator
from tests.nodeagent.fake_nvml import FakeNvml
from tests.nodeagent.harness import (
    NODE,
    RESOURCE,
    NodeDirs,
    agent_settings,
    kubelet_settings,
    running_node,
    wait_until,
)

PARADIGM_ARGS = [
    "--device-split-count=10",
    "--device-memory-scaling=1",
    "--device-cores-scaling=1",
    "--fail-on-init-error=true",
]


def _nvml_starts() -> bool:
    """Whether this machine has a working NVML (then "no GPU" cannot be provoked here)."""
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception:
        return False
    pynvml.nvmlShutdown()
    return True


def agent_command(nats_url: str, dirs: NodeDirs, *args: str) -> list[str]:
    return [
        sys.executable, "-m", "services.cli.main", "node-agent",
        "--node-name", NODE, "--nats-url", nats_url,
        "--plugin-dir", str(dirs.plugin_dir),
        "--pod-resources-socket", str(dirs.pod_resources_socket),
        "--container-root", str(dirs.container_root),
        "--state-dir", str(dirs.state_dir),
        *args,
    ]  # fmt: skip


async def inventories(nats_url: str) -> tuple[Bus, list[NodeInventory]]:
    bus = await Bus.connect(nats_url, "test-inventory")
    seen: list[NodeInventory] = []

    async def on_inventory(inventory: NodeInventory) -> None:
        seen.append(inventory)

    await bus.subscribe(subjects.inventory(NODE), NodeInventory, on_inventory)
    return bus, seen


def test_flags_and_yaml_keys_reach_the_settings(tmp_path: Path) -> None:
    from click.testing import CliRunner

    from services.cli import main as cli

    captured: dict[str, NodeAgentSettings] = {}

    def capture(service: object, *_: object) -> None:
        captured["settings"] = service._settings  # type: ignore[attr-defined]

    original = cli._serve
    cli._serve = capture  # type: ignore[assignment]
    try:
        args = ["node-agent", "--node-name", "n", "--simulate", "1xT4", *PARADIGM_ARGS[:3]]
        result = CliRunner().invoke(
            cli.main, [*args, "--device-memory-scaling=1.5", "--fail-on-init-error=false"]
        )
        assert result.exit_code == 0, result.output
        settings = captured["settings"]
        assert (settings.split_count, settings.memory_scaling, settings.cores_scaling) == (
            10,
            1.5,
            1.0,
        )
        assert settings.fail_on_init_error is False
        result = CliRunner().invoke(cli.main, [*args, "--fail-on-init-error"])  # Go's bare form
        assert result.exit_code == 0, result.output
        assert captured["settings"].fail_on_init_error is True
        result = CliRunner().invoke(cli.main, [*args, "--fail-on-init-error=maybe"])
        assert result.exit_code != 0 and "maybe" in result.output
    finally:
        cli._serve = original  # type: ignore[assignment]

    config = tmp_path / "agent.yaml"
    config.write_text(
        "nodeagent:\n  node_name: n\n  split_count: 4\n  memory_scaling: 2\n"
        "  cores_scaling: 1.5\n  fail_on_init_error: false\n"
    )
    settings = load_settings(NodeAgentSettings, section="nodeagent", file=config, environ={})
    assert (settings.split_count, settings.memory_scaling, settings.cores_scaling) == (4, 2, 1.5)
    assert settings.fail_on_init_error is False


@pytest.mark.parametrize(
    ("field", "value"), [("memory_scaling", -1.0), ("cores_scaling", float("inf"))]
)
def test_bad_scaling_is_refused_by_name(field: str, value: float) -> None:
    with pytest.raises(ValueError, match=field):
        NodeAgent(NodeAgentSettings(node_name="n", simulate="1xT4", **{field: value}))


async def test_the_inventory_states_each_gpus_sharing(
    nats_server: EmbeddedNats, dirs: NodeDirs
) -> None:
    bus, seen = await inventories(nats_server.url)
    try:
        async with running_node(
            nats_server.url, dirs, split_count=4, memory_scaling=1.5, cores_scaling=2.0
        ) as (kubelet, _):
            assert len(kubelet.devices(RESOURCE)) == 8  # 2 GPUs x split count 4
            await wait_until(lambda: seen, what="an inventory")
            gpus = seen[-1].gpus
            assert [(g.memory_scaling, g.cores_scaling, g.split_count) for g in gpus] == [
                (1.5, 2.0, 4),
                (1.5, 2.0, 4),
            ]
    finally:
        await bus.close()


@pytest.mark.skipif(_nvml_starts(), reason="NVML works here: no GPU-less node to try")
async def test_fail_on_init_error_true_exits_non_zero_with_the_reason(
    nats_server: EmbeddedNats, dirs: NodeDirs
) -> None:
    done = await asyncio.to_thread(
        subprocess.run,
        agent_command(nats_server.url, dirs, *PARADIGM_ARGS),
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "VGPU_LOG_LEVEL": "warning"},
    )
    assert done.returncode != 0
    assert "cannot start NVML" in done.stderr, done.stderr
    assert "fail_on_init_error=false" in done.stderr


@pytest.mark.skipif(_nvml_starts(), reason="NVML works here: no GPU-less node to try")
async def test_fail_on_init_error_false_stays_up_registered_with_nothing(
    nats_server: EmbeddedNats, dirs: NodeDirs
) -> None:
    kubelet = KubeletSimulator(kubelet_settings(dirs))
    await kubelet.start()
    bus, seen = await inventories(nats_server.url)
    args = [*PARADIGM_ARGS[:3], "--fail-on-init-error=false"]
    process = await asyncio.create_subprocess_exec(
        *agent_command(nats_server.url, dirs, *args),
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        assert await kubelet.wait_for_resource(RESOURCE, timeout=30) == []  # registered, empty
        await wait_until(lambda: seen, timeout_s=15, what="an inventory without GPUs")
        assert seen[-1].gpus == []
        await asyncio.sleep(1.0)
        assert process.returncode is None  # still alive
    finally:
        if process.returncode is None:
            process.terminate()
        _, stderr = await asyncio.wait_for(process.communicate(), 30)
        await bus.close()
        await kubelet.stop()
    assert b"NVML unavailable" in stderr
    assert process.returncode == 0  # stopped by SIGTERM, cleanly


async def test_no_gpu_found_follows_fail_on_init_error(
    nats_server: EmbeddedNats, dirs: NodeDirs, tmp_path: Path
) -> None:
    """NVML starts but lists no GPU: an init error too (true: refuse; false: serve nothing)."""
    empty = NvmlGpuBackend(FakeNvml([]), tmp_path)
    empty.open()
    failing = NodeAgent(agent_settings(nats_server.url, dirs, simulate=""), gpu_backend=empty)
    with pytest.raises(NvmlInitError, match="no GPUs found"):
        await failing.start()
    assert not failing.socket_path.exists()

    kubelet = KubeletSimulator(kubelet_settings(dirs))
    await kubelet.start()
    backend = NvmlGpuBackend(FakeNvml([]), tmp_path)
    backend.open()
    idle = NodeAgent(
        agent_settings(nats_server.url, dirs, simulate="", fail_on_init_error=False),
        gpu_backend=backend,
    )
    try:
        await idle.start()
        await idle.wait_registered(10)
        assert await kubelet.wait_for_resource(RESOURCE, timeout=10) == []
        assert idle.idle_reason == "no GPUs found"
    finally:
        await idle.stop()
        await kubelet.stop()
