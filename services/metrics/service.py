"""The metrics service: a NATS subscriber that serves Prometheus /metrics and a JSON picture."""

from __future__ import annotations

import logging

import msgspec
from aiohttp import web
from prometheus_client import REGISTRY, CollectorRegistry, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from services.common import subjects
from services.common.bus import Bus
from services.common.schemas import AllocationEvent, NodeInventory, NodeUsage
from services.metrics.exporter import PictureCollector
from services.metrics.picture import ClusterPicture
from services.metrics.settings import MetricsSettings

log = logging.getLogger("vgpu.metrics")


class MetricsService:
    def __init__(self, settings: MetricsSettings) -> None:
        self.settings = settings
        self.picture = ClusterPicture(settings.stale_after_s)
        self._registry = CollectorRegistry(auto_describe=False)
        self._registry.register(PictureCollector(self.picture))
        self._bus: Bus | None = None
        self._runner: web.AppRunner | None = None
        self._port = 0

    @property
    def url(self) -> str:
        return f"http://{self.settings.http_host}:{self._port}"

    async def start(self) -> None:
        self._bus = await Bus.connect(self.settings.nats_url, "vgpu-metrics")
        await self._bus.subscribe(subjects.INVENTORY_ALL, NodeInventory, self._on_inventory)
        await self._bus.subscribe(subjects.USAGE_ALL, NodeUsage, self._on_usage)
        await self._bus.subscribe(subjects.ALLOC_EVENTS_ALL, AllocationEvent, self._on_allocation)
        app = web.Application()
        app.add_routes(
            [
                web.get("/metrics", self._metrics),
                web.get("/healthz", self._healthz),
                web.get("/api/v1/picture", self._picture),
            ]
        )
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.settings.http_host, self.settings.http_port)
        await site.start()
        self._port = self._runner.addresses[0][1]
        log.info("metrics serving", extra={"url": self.url})

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        if self._bus is not None:
            await self._bus.close()
            self._bus = None

    async def _on_inventory(self, inventory: NodeInventory) -> None:
        self.picture.on_inventory(inventory)

    async def _on_usage(self, usage: NodeUsage) -> None:
        self.picture.on_usage(usage)

    async def _on_allocation(self, event: AllocationEvent) -> None:
        self.picture.on_allocation(event)

    async def _metrics(self, request: web.Request) -> web.Response:
        # Our picture plus the process-wide counters (bus errors, handler failures).
        body = generate_latest(self._registry) + generate_latest(REGISTRY)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def _healthz(self, request: web.Request) -> web.Response:
        return web.json_response({"ok": True})

    async def _picture(self, request: web.Request) -> web.Response:
        nodes = {
            name: {
                "up": self.picture.is_up(name),
                "last_seen": view.inventory.sent_at,
                "gpus": view.inventory.gpus,
                "usage": list(view.usage.values()),
            }
            for name, view in self.picture.nodes.items()
        }
        body = msgspec.json.encode({"nodes": nodes, "pods": list(self.picture.pods.values())})
        return web.Response(body=body, content_type="application/json")
