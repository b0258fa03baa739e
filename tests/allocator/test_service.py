"""The Allocator service's life cycle and settings."""

from __future__ import annotations

import socket

import aiohttp
import pytest

from services.allocator import Allocator, AllocatorSettings
from services.common import subjects
from services.common.bus import Bus
from services.common.config import ConfigError, load_settings
from services.common.embedded_nats import EmbeddedNats
from services.common.schemas import NodeInventory

from .helpers import (
    admit_to_cluster,
    bind_args,
    collect_events,
    container,
    eventually,
    filter_args,
    give_nodes,
    gpu,
    node_inventory,
    pod,
    post,
)


async def test_stop_is_idempotent_and_closes_the_port(nats_server: EmbeddedNats) -> None:
    allocator = Allocator(AllocatorSettings(nats_url=nats_server.url, http_port=0))
    await allocator.start()
    url = allocator.url
    await allocator.stop()
    await allocator.stop()
    with pytest.raises(RuntimeError, match="not started"):
        _ = allocator.url
    async with aiohttp.ClientSession() as http:
        with pytest.raises(aiohttp.ClientConnectionError):
            await http.get(f"{url}/healthz")


async def test_failed_start_leaves_nothing_behind(nats_server: EmbeddedNats) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        allocator = Allocator(AllocatorSettings(nats_url=nats_server.url, http_port=port))
        with pytest.raises(OSError):
            await allocator.start()
    assert allocator._bus is None and allocator._runner is None


def test_settings_are_validated_by_name() -> None:
    settings = load_settings(
        AllocatorSettings, section="allocator", environ={"VGPU_HTTP_PORT": "9090"}
    )
    assert settings.http_port == 9090 and settings.node_timeout_s == 15.0
    with pytest.raises(ConfigError, match="http_port"):
        load_settings(AllocatorSettings, section="allocator", environ={"VGPU_HTTP_PORT": "x"})
    with pytest.raises(ConfigError, match="node_timeout_s"):
        load_settings(AllocatorSettings, section="allocator", overrides={"node_timeout_s": 0})


async def test_release_frees_the_slices_and_announces_it(
    allocator: Allocator, bus: Bus, http
) -> None:
    await give_nodes(bus, allocator, node_inventory("n1", count=1))
    events = await collect_events(bus, "n1")
    p = pod("p", [container("main", cores=100)])
    admit_to_cluster(allocator, p)
    await post(http, f"{allocator.url}/scheduler/filter", filter_args(p, ["n1"]))
    assert (await post(http, f"{allocator.url}/scheduler/bind", bind_args(p, "n1")))[1] == {
        "Error": ""
    }
    released = await allocator.engine.release(p["metadata"]["uid"])
    assert released is not None and released.name == "p"
    assert await allocator.engine.release(p["metadata"]["uid"]) is None
    assert allocator.ledger.reserved("n1") == {}
    await eventually(lambda: [e.kind for e in events] == ["bound", "released"])


async def test_inventory_listing_a_gpu_twice_keeps_it_once(allocator: Allocator, bus: Bus) -> None:
    twice = NodeInventory(node="n1", gpus=[gpu("n1", 0), gpu("n1", 0, memory_mib=1)])
    await bus.publish(subjects.inventory("n1"), twice)
    await eventually(lambda: allocator.inventory.gpus("n1") == (gpu("n1", 0),))
