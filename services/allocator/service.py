"""The allocator service: inventory in over NATS, decisions out over HTTP and NATS."""

from __future__ import annotations

import logging
from typing import Any

from aiohttp import web

from services.common import subjects
from services.common.bus import Bus
from services.common.schemas import NodeInventory

from .backend import ClusterBackend, LocalClusterBackend
from .claims import ClaimHandlers
from .engine import PlacementEngine
from .extender import build_app
from .inventory import InventoryStore
from .ledger import Ledger
from .settings import AllocatorSettings

log = logging.getLogger("vgpu.allocator")


class Allocator:
    def __init__(self, settings: AllocatorSettings, backend: ClusterBackend | None = None) -> None:
        self.settings = settings
        self.backend: ClusterBackend = backend if backend is not None else LocalClusterBackend()
        self.inventory = InventoryStore(settings.node_timeout_s)
        self.ledger = Ledger()
        self.engine = PlacementEngine(self.inventory, self.ledger, self.backend)
        self._bus: Bus | None = None
        self._runner: web.AppRunner | None = None
        self._port: int | None = None

    @property
    def url(self) -> str:
        """Base URL of the HTTP API; the extender's urlPrefix is ``url + "/scheduler"``."""
        if self._port is None:
            raise RuntimeError("the allocator is not started")
        return f"http://{self.settings.http_host}:{self._port}"

    async def start(self) -> None:
        try:
            self._bus = await Bus.connect(self.settings.nats_url, "vgpu-allocator")
            self.engine.set_event_sink(self._bus)
            await self._bus.subscribe(subjects.INVENTORY_ALL, NodeInventory, self._on_inventory)
            await ClaimHandlers(self.engine).serve(self._bus)
            # Make sure the server has our subscriptions before anyone relies on them.
            await self._bus.client.flush()
            self._runner = web.AppRunner(build_app(self.engine, self._health))
            await self._runner.setup()
            site = web.TCPSite(self._runner, self.settings.http_host, self.settings.http_port)
            await site.start()
            self._port = int(self._runner.addresses[0][1])
        except BaseException:
            await self.stop()
            raise
        log.info("allocator started", extra={"url": self.url, "nats": self.settings.nats_url})

    async def stop(self) -> None:
        runner, self._runner = self._runner, None
        bus, self._bus = self._bus, None
        self._port = None
        if runner is not None:
            await runner.cleanup()
        if bus is not None:
            self.engine.set_event_sink(None)
            await bus.close()

    async def _on_inventory(self, inventory: NodeInventory) -> None:
        if self.inventory.update(inventory):
            log.info(
                "node inventory changed",
                extra={
                    "node": inventory.node,
                    "gpus": [g.uuid for g in inventory.gpus],
                    "unhealthy": [g.uuid for g in inventory.gpus if not g.healthy],
                },
            )

    def _health(self) -> tuple[bool, dict[str, Any]]:
        connected = self._bus is not None and self._bus.client.is_connected
        return connected, {
            "nats_connected": connected,
            "nodes": len(self.inventory.nodes()),
            "pods": len(self.ledger),
        }
