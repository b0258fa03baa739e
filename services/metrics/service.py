"""The metrics service: a NATS subscriber that keeps the cluster's picture and shows it.

Start-up order matters for a correct picture after a restart: subscribe to allocation events
first, then read the decisions already made from the allocator's KV bucket (events applied
meanwhile win over older records), so nothing falls between the two. Inventory and usage
need no rebuild: node agents re-send them every few seconds.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

import msgspec
from aiohttp import web
from prometheus_client import CollectorRegistry, Counter

from services.common import subjects
from services.common.bus import Bus
from services.common.http_server import serve
from services.common.kube_auth import Gate, close_gate, gate_from
from services.common.schemas import (
    AllocationEvent,
    ContainerUsage,
    NodeInventory,
    NodeUsage,
    PendingPod,
    SliceViolation,
)
from services.common.tracing import tracer
from services.common.vitals import Vitals
from services.metrics.exporter import ViewCollector, vgpu_families
from services.metrics.hami import hami_families
from services.metrics.http import MetricsHttp
from services.metrics.picture import ClusterPicture, EventRejected
from services.metrics.rebuild import DecisionSource, KvDecisionSource
from services.metrics.settings import MetricsSettings
from services.metrics.stream import ChangeStream, frame
from services.metrics.views import ClusterView, change_view, cluster_view

log = logging.getLogger("vgpu.metrics")
_tracer = tracer("vgpu.metrics")

EVENTS = Counter(
    "vgpu_metrics_events_total",
    "Events the metrics service received, by kind and outcome (applied or rejected)",
    ["kind", "outcome"],
)
REJECTED = Counter(
    "vgpu_metrics_rejected_events_total",
    "Events that decoded but could not be applied, by kind and reason",
    ["kind", "reason"],
)
REBUILT = Counter(
    "vgpu_metrics_rebuilt_pods_total", "Pod decisions read back from the allocator's KV state"
)

M = TypeVar("M", bound=msgspec.Struct)


def _about(message: msgspec.Struct) -> dict[str, str]:
    """The node, pod and GPU an event names, for its log line (those it has)."""
    subject = getattr(message, "allocation", message)
    node, gpu = getattr(subject, "node", ""), getattr(subject, "gpu", "")
    namespace = getattr(subject, "namespace", "")
    pod = getattr(subject, "pod", "") or getattr(subject, "name", "")
    fields = {"node": node, "pod": f"{namespace}/{pod}" if namespace else pod, "gpu": gpu}
    return {key: value for key, value in fields.items() if isinstance(value, str) and value}


class MetricsService:
    def __init__(self, settings: MetricsSettings, decisions: DecisionSource | None = None) -> None:
        self.settings = settings
        self.picture = ClusterPicture(settings.stale_after_s, settings.pending_ttl_s)
        self.stream = ChangeStream(settings.stream_queue)
        self._decisions = decisions
        self._registry = CollectorRegistry(auto_describe=False)
        families = [vgpu_families]
        if settings.hami_metrics:
            legacy = settings.hami_legacy_metrics
            families.append(lambda view: hami_families(view, legacy=legacy))
        self._registry.register(ViewCollector(self.view, *families))
        self._bus: Bus | None = None
        self._runner: web.AppRunner | None = None
        self._flusher: asyncio.Task[None] | None = None
        self.vitals = Vitals("metrics")  # the flusher ending unasked is a crash (`vgpu up`)
        self._http: MetricsHttp | None = None
        self._bus_shown: bool | None = None  # connected, as the stream clients last heard
        self._seq = 0
        self._port = 0
        self.gate: Gate | None = None

    @property
    def url(self) -> str:
        return f"http://{self.settings.http_host}:{self._port}"

    def view(self) -> ClusterView:
        return cluster_view(self.picture, memory_unit=self.settings.memory_unit)

    async def start(self) -> None:
        try:
            await self._start()
        except BaseException:
            await self.stop()
            raise

    async def _start(self) -> None:
        self._bus = await Bus.connect(self.settings.nats_url, "vgpu-metrics")
        bus = self._bus
        await bus.subscribe(subjects.ALLOC_EVENTS_ALL, AllocationEvent,
                            self._apply("allocation", self.picture.on_allocation))  # fmt: skip
        await bus.client.flush()  # subscribed before reading KV, so no decision falls between
        await self._rebuild(bus)
        await bus.subscribe(subjects.INVENTORY_ALL, NodeInventory,
                            self._apply("inventory", self.picture.on_inventory))  # fmt: skip
        await bus.subscribe(subjects.USAGE_ALL, NodeUsage,
                            self._apply("usage", self.picture.on_usage))  # fmt: skip
        on_container = self._apply("container_usage", self.picture.on_container_usage)
        await bus.subscribe(subjects.CONTAINER_USAGE_ALL, ContainerUsage, on_container)
        await bus.subscribe(subjects.ALLOC_PENDING_ALL, PendingPod,
                            self._apply("pending", self.picture.on_pending))  # fmt: skip
        await bus.subscribe(subjects.VIOLATIONS_ALL, SliceViolation,
                            self._apply("violation", self.picture.on_violation))  # fmt: skip
        await bus.client.flush()  # the server holds every subscription before we say we started
        nats_url = self.settings.nats_url
        settings = self.settings
        self.gate = gate_from(settings.read_auth, "metrics", api_url=settings.auth_api_url,
                              kubeconfig=settings.auth_kubeconfig,
                              ttl_s=settings.auth_cache_ttl_s,
                              cache_size=settings.auth_cache_size)  # fmt: skip
        http = MetricsHttp(
            self.view, self.stream, self._registry, lambda: bus.client.is_connected,
            lambda: {"nats_url": nats_url, "nats_down_since": bus.down_since},
            self.settings.max_body_bytes,
            gate=self.gate, pending_shown=self.settings.pending_shown,
        )  # fmt: skip
        self._runner, self._port = await serve(
            http.app(), self.settings.http_host, self.settings.http_port, shutdown_timeout=2.0
        )
        self._http = http
        bus.on_reconnect(self._resync)
        self._flusher = asyncio.create_task(self._flush_changes(), name="metrics-flush")
        self.vitals.watch("the change flusher", self._flusher)
        log.info("metrics serving", extra={"url": self.url})

    async def wait_died(self) -> str:
        """Until its flusher ends unasked (it crashed); what ended and how."""
        return await self.vitals.died()

    async def stop(self) -> None:
        self.vitals.stop()
        self.stream.close()  # end the live streams first, or the HTTP server waits on them
        if self._flusher is not None:
            self._flusher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._flusher
            self._flusher = None
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        if self._bus is not None:
            await self._bus.close()
            self._bus = None
        gate, self.gate = self.gate, None
        await close_gate(gate)

    def _apply(self, kind: str, apply: Callable[[M], None]) -> Callable[[M], Awaitable[None]]:
        """A bus handler: apply the event, count it; a senseless event is counted, not fatal."""

        async def handle(message: M) -> None:
            try:
                apply(message)
            except EventRejected as exc:
                EVENTS.labels(kind=kind, outcome="rejected").inc()
                REJECTED.labels(kind=kind, reason=exc.reason).inc()
                log.warning("rejected event", extra={"kind": kind, **_about(message),
                                                     "reason": exc.reason,
                                                     "error": str(exc)})  # fmt: skip
                return
            EVENTS.labels(kind=kind, outcome="applied").inc()

        return handle

    async def _rebuild(self, bus: Bus) -> None:
        source = self._decisions or KvDecisionSource(
            bus.client, self.settings.kv_bucket, self.settings.kv_timeout_s
        )
        with _tracer.start_as_current_span("metrics rebuild") as span:
            decisions = await source.load()
            loaded = 0
            for allocation in decisions.allocations:
                try:
                    loaded += self.picture.load_decisions([allocation])
                except EventRejected as exc:
                    REJECTED.labels(kind="kv_record", reason=exc.reason).inc()
                    log.warning("rejected decision record",
                                extra={**_about(allocation), "reason": exc.reason,
                                       "error": str(exc)})  # fmt: skip
            for _ in decisions.malformed:
                REJECTED.labels(kind="kv_record", reason="undecodable").inc()
            REBUILT.inc(loaded)
            span.set_attribute("vgpu.pods", loaded)
        if decisions.found:
            log.info("picture rebuilt from KV", extra={"bucket": self.settings.kv_bucket,
                     "pods": loaded, "malformed": len(decisions.malformed)})  # fmt: skip

    def _send_bus_status(self) -> None:
        """A `bus` frame to every stream client when NATS went or came back: the dashboard
        shows "bus down since ..." instead of "live" meanwhile."""
        if self._http is None or self._bus is None:
            return
        connected = self._bus.client.is_connected
        if not connected and self._bus.down_since is None:
            return  # the client noticed before its callback noted since when: next round
        if connected == self._bus_shown:
            return
        self._bus_shown = connected
        self.stream.publish(frame("bus", msgspec.json.encode(self._http.bus_status())))

    async def _resync(self) -> None:
        """The bus is back: decisions made or undone while we could not hear them are read
        from the allocator's KV state (inventory and usage come back with the agents'
        re-sends)."""
        assert self._bus is not None
        source = self._decisions or KvDecisionSource(
            self._bus.client, self.settings.kv_bucket, self.settings.kv_timeout_s
        )
        started = time.time()
        decisions = await source.load()
        if not decisions.found:
            return
        added, removed = self.picture.resync_decisions(decisions.allocations, started)
        log.info("picture resynchronised after the bus came back",
                 extra={"added": added, "released": removed})  # fmt: skip

    async def _flush_changes(self) -> None:
        """Age the picture and send what changed to stream clients, at most every interval."""
        interval = self.settings.stream_interval_s
        while True:
            await asyncio.sleep(interval)
            try:
                self._send_bus_status()
                self.picture.sweep()
                changes = self.picture.take_changes()
                if not changes or not self.stream.has_clients:
                    continue
                if changes.pending:  # stranded memory may move on every GPU
                    changes.nodes.update(self.picture.nodes)
                self._seq += 1
                batch = change_view(self.picture, self._seq, changes.nodes, changes.pods,
                                    changes.pending,
                                    pending_shown=self.settings.pending_shown)  # fmt: skip
                self.stream.publish(frame("change", msgspec.json.encode(batch), self._seq))
            except Exception:
                log.exception("sending changes failed")
