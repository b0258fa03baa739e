"""`vgpu kubelet-sim`: a kubelet simulator for one node, as a process of its own.

The docker-compose stack runs one beside each node agent, sharing the directories of the
device-plugin and PodResources sockets through a volume, as a real kubelet shares them with
the agent through host paths.
"""

from __future__ import annotations

import asyncio
import signal
from typing import TYPE_CHECKING, Any

import click

from services.common.config import ConfigError, load_settings
from services.common.logs import configure_logging

if TYPE_CHECKING:
    from services.simulators.kubelet import KubeletSimulator


async def _run_until_signalled(simulator: KubeletSimulator) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stop.set)
    await simulator.start()
    try:
        await stop.wait()
    finally:
        await simulator.stop()


@click.command("kubelet-sim")
@click.option(
    "--config", "config_file", type=click.Path(dir_okay=False), default=None,
    envvar="VGPU_CONFIG", help="YAML settings file (section kubeletsim).",
)  # fmt: skip
@click.option("--node-name", default=None, envvar="NODE_NAME")
@click.option("--plugin-dir", default=None, help="Directory of kubelet.sock and plugin sockets.")
@click.option("--pod-resources-socket", default=None)
@click.option("--http-host", default=None)
@click.option("--http-port", type=int, default=None)
@click.option(
    "--device-resource", "device_resources", multiple=True,
    help="A resource served by device plugins (repeat for several; default nvidia.com/gpu).",
)  # fmt: skip
@click.option("--log-level", default="info", show_default=True)
def kubelet_sim(
    config_file: str | None, device_resources: tuple[str, ...], log_level: str, **flags: Any
) -> None:
    """Run a kubelet simulator (device-plugin registration, PodResources, admission)."""
    from services.simulators.kubelet import KubeletSimSettings, KubeletSimulator

    if device_resources:
        flags["device_resources"] = device_resources
    try:
        settings = load_settings(
            KubeletSimSettings, section="kubeletsim", file=config_file, overrides=flags
        )
        simulator = KubeletSimulator(settings)
    except (ConfigError, ValueError) as exc:
        raise click.ClickException(str(exc)) from exc
    configure_logging(log_level)
    try:
        asyncio.run(_run_until_signalled(simulator))
    except OSError as exc:
        raise click.ClickException(str(exc)) from exc
