"""The allocator service: inventory in over NATS, decisions out over HTTP and NATS.

Start-up order matters for replicas: the journal loads every stored decision before the
extender answers, so a restarted or second replica never places on top of what is promised.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import inspect
import logging
import os
import socket
import time
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any

from aiohttp import web
from prometheus_client import Counter, Gauge

from services.common import subjects
from services.common.bus import Bus
from services.common.http_server import serve
from services.common.kube_auth import Gate, close_gate, gate_from
from services.common.mutual_tls import identity_middleware, serve_mutual_tls
from services.common.schemas import NodeInventory, PendingPod, PendingReason
from services.common.tasks import stop_task
from services.common.vitals import Vitals

from .backend import ClusterBackend, LocalClusterBackend
from .bind_guard import BindGuard, FilterPasses
from .claims import ClaimHandlers
from .cluster import CapacityConfig, ClusterState
from .cluster_watch import BoundPodHandler, NodeHandler, UnboundPodHandler
from .core import FilterOutcome, PlacementCore, PodRef, pod_ref
from .engine import PlacementEngine
from .extender import FILTER_SLICE, build_app
from .extender_edge import FilterPassPeers, mutual_tls
from .fragmentation import WorkloadMix
from .journal import Journal
from .lease import Lease
from .ledger import Ledger
from .reconcile import RELEASES, TERMINAL_PHASES
from .settings import AllocatorSettings

log = logging.getLogger("vgpu.allocator")

NODES = Gauge(
    "vgpu_allocator_nodes", "Nodes known to the allocator by availability", ["replica", "state"]
)
LEADER = Gauge("vgpu_allocator_leader", "1 when this replica holds the lease", ["replica"])
EVENT_INTERVAL_S = 30.0  # at most one "unschedulable" Event per pod this often
PENDING_REMEMBERED = 10000  # pods announced as pending, to say when they stop waiting
DEFERRED_REPORTS = 1024  # refusals of pods the API server does not list (yet) as pending
FILTERED_UNKNOWN = Counter(
    "vgpu_allocator_filtered_unknown_pods_total",
    "Refused filters of pods the API server does not list as pending (not shown as pending)",
)


def pending_report(ref: PodRef, requests: Any, outcome: FilterOutcome) -> tuple[PendingPod, str]:
    """The PendingPod to publish for a refused pod and the Event message: reasons grouped,
    at most 20 node names each."""
    by_reason: dict[str, list[str]] = {}
    for node, reason in {**outcome.failed, **outcome.unresolvable}.items():
        by_reason.setdefault(
            reason.replace(f"node {node!r}: ", "").replace(f"node {node!r} ", "node "), []
        ).append(node)
    pending = PendingPod(
        namespace=ref.namespace,
        name=ref.name,
        uid=ref.uid,
        requests=list(requests),
        reasons=[
            PendingReason(message=m, nodes=n[:20], node_count=len(n)) for m, n in by_reason.items()
        ],
        unresolvable=bool(outcome.unresolvable) and not outcome.failed,
    )
    message = "; ".join(f"{len(n)} node(s): {m}" for m, n in list(by_reason.items())[:5])
    return pending, message


def _replica_id(settings: AllocatorSettings) -> str:
    return settings.replica_id or f"{socket.gethostname()}-{os.getpid()}-{id(settings) % 10000}"


class Allocator:
    def __init__(self, settings: AllocatorSettings, backend: ClusterBackend | None = None) -> None:
        self.settings = settings
        self.replica = _replica_id(settings)
        self.backend: ClusterBackend = backend if backend is not None else self._make_backend()
        self.cluster = ClusterState(
            settings.node_timeout_s,
            CapacityConfig(
                memory_reserve_mib=settings.memory_reserve_mib,
                split_count=settings.split_count,
                memory_scaling=settings.memory_scaling,
                node_memory_scaling=dict(settings.node_memory_scaling),
                cores_scaling=settings.cores_scaling,
            ),
        )
        self.inventory = self.cluster  # the name earlier callers know
        self.ledger = Ledger(self.cluster)
        self.core = PlacementCore(
            self.cluster,
            self.ledger,
            node_policy=settings.node_policy,
            gpu_policy=settings.gpu_policy,
            request_config=settings.request_config(),
            mix=WorkloadMix(window=settings.mix_window),
        )
        self.journal = Journal(
            self.ledger,
            connected=lambda: self._bus is not None and self._bus.client.is_connected,
        )
        self.passes = FilterPasses(keep_s=settings.bind_window_s)
        self.guard = BindGuard(settings.scheduler_name, settings.bind_window_s, self.passes)
        self.engine = PlacementEngine(
            self.core, self.backend, journal=self.journal, guard=self.guard
        )
        self.lease: Lease | None = None
        self._bus: Bus | None = None
        self._runner: web.AppRunner | None = None
        self._extender_runner: web.AppRunner | None = None
        self._extender_port: int | None = None
        self._webhook: Any = None
        self._port: int | None = None
        self._tasks: list[asyncio.Task[None]] = []
        # Its loops (heartbeat watch, cluster watch, lease): one ending unasked is a crash
        # that whoever runs it in-process (`vgpu up`) restarts it for.
        self.vitals = Vitals("allocator")
        self._leader_tasks: list[asyncio.Task[None]] = []
        self._followups: set[asyncio.Task[None]] = set()  # releases a follower may owe
        self._last_event: dict[str, float] = {}
        self._unavailable: set[str] = set()
        self._unbound: UnboundPodHandler | None = None  # pending pods, per the API server
        self._announced: OrderedDict[str, PodRef] = OrderedDict()  # published as pending
        self._deferred: OrderedDict[str, tuple[PendingPod, str]] = OrderedDict()
        self.gate: Gate | None = None

    def _make_backend(self) -> ClusterBackend:
        if self.settings.cluster == "kubernetes":
            from .kube import KubernetesBackend

            return KubernetesBackend.from_settings(self.settings)
        return LocalClusterBackend()

    @property
    def url(self) -> str:
        """Base URL of the HTTP API; the extender's urlPrefix is ``url + "/scheduler"``."""
        if self._port is None:
            raise RuntimeError("the allocator is not started")
        return f"http://{self.settings.http_host}:{self._port}"

    @property
    def extender_url(self) -> str:
        """kube-scheduler's urlPrefix: https with client certificates when extender_port is set."""
        if self._extender_port is None:
            return f"{self.url}/scheduler"
        return f"https://{self.settings.extender_host}:{self._extender_port}/scheduler"

    @property
    def webhook_url(self) -> str:
        if self._webhook is None:
            raise RuntimeError("the admission webhook is not serving")
        return str(self._webhook.url)

    @property
    def leading(self) -> bool:
        return self.lease is None or self.lease.leading

    async def start(self) -> None:
        try:
            await self._start()
        except BaseException:
            await self.stop()
            raise
        log.info(
            "allocator started",
            extra={"url": self.url, "nats": self.settings.nats_url, "replica": self.replica},
        )

    async def _start(self) -> None:
        settings = self.settings
        if settings.gc_threshold:
            # Process-wide, on purpose: fewer, larger collections (see the setting).
            gc.set_threshold(settings.gc_threshold, 50, 1000)
        self._bus = await Bus.connect(settings.nats_url, f"vgpu-allocator-{self.replica}")
        self.engine.set_event_sink(self._bus)
        self._bus.on_reconnect(self._resync)
        js = self._bus.client.jetstream(timeout=5)
        if settings.state_bucket:
            try:
                await self.journal.open(js, settings.state_bucket, settings.state_replicas)
            except Exception as exc:
                raise RuntimeError(
                    f"cannot open the JetStream KV bucket {settings.state_bucket!r} at "
                    f"{settings.nats_url} (is JetStream enabled?): {exc}"
                ) from exc
        gc.freeze()  # what start-up loaded lives on: keep it out of every later collection
        await self._bus.subscribe(subjects.INVENTORY_ALL, NodeInventory, self._on_inventory)
        await ClaimHandlers(self.engine).serve(self._bus)
        peers = FilterPassPeers(self._bus, self.passes)
        await peers.serve()
        self.guard.ask_peers = peers.ask
        await self._bus.client.flush()  # the server has our subscriptions before we answer
        await self._serve_http()
        if settings.webhook_port >= 0:
            from .webhook import WebhookServer

            self._webhook = WebhookServer(settings, self.core)
            await self._webhook.start()
        self._tasks.append(
            self.vitals.watch("the heartbeat watch", asyncio.create_task(self._watch_heartbeats()))
        )
        await self._start_cluster_watch()
        if settings.lease_bucket:
            self.lease = Lease(self.replica, settings.lease_ttl_s, self._on_role)
            await self.lease.start(js, settings.lease_bucket)
            if self.lease.task is not None:
                self.vitals.watch("the leader lease", self.lease.task)
        else:
            self._on_role(True)

    async def _serve_http(self) -> None:
        """Health, metrics and allocations on http_port; the scheduler verbs on extender_port
        over mutual TLS, or (no extender_port) on http_port without authentication."""
        settings = self.settings
        apart = settings.extender_port >= 0
        self.gate = gate_from(
            settings.read_auth, "allocator",
            api_url=settings.auth_api_url or settings.kube_api_url,
            kubeconfig=settings.kubeconfig, ttl_s=settings.auth_cache_ttl_s,
            cache_size=settings.auth_cache_size,
        )  # fmt: skip
        self._runner, self._port = await serve(
            build_app(
                self.engine,
                self._health,
                self._ready,
                self._on_filtered,
                verbs=not apart,
                max_body_bytes=settings.max_body_bytes,
                gate=self.gate,
            ),
            settings.http_host,
            settings.http_port,
        )
        if not apart:
            log.warning(
                "the scheduler extender is served without authentication: set extender_port "
                "and its certificates so that only kube-scheduler can place and bind pods",
                extra={"url": self.extender_url},
            )
            return
        tls = mutual_tls(settings)
        app = build_app(
            self.engine,
            self._health,
            self._ready,
            self._on_filtered,
            endpoints=False,
            middlewares=(identity_middleware(tls),),
            max_body_bytes=self.settings.max_body_bytes,
        )
        self._extender_runner, self._extender_port = await serve_mutual_tls(
            app, settings.extender_host, settings.extender_port, tls
        )
        log.info(
            "scheduler extender serving over mutual TLS",
            extra={"url": self.extender_url, "clients": settings.extender_client_allowed or "any"},
        )

    async def _start_cluster_watch(self) -> None:
        """Node allocatable and every bound pod's requests (every replica), as kube-scheduler
        sees them; waits (bounded) for the first lists so early answers count them."""
        watch = getattr(self.backend, "run_cluster_watch", None)
        if watch is None:
            return
        nodes = NodeHandler(self.cluster)
        pods = BoundPodHandler(self.ledger.host, on_gone=self._bound_pod_gone)
        handlers: list[Any] = [nodes, pods]
        if "unbound" in inspect.signature(watch).parameters:
            self._unbound = UnboundPodHandler(self._left_pending, self._became_pending)
            handlers.append(self._unbound)
        task = asyncio.create_task(self._run_cluster_watch(watch, *handlers))
        self._tasks.append(self.vitals.watch("the cluster watch", task))
        try:
            async with asyncio.timeout(self.settings.cluster_sync_timeout_s):
                for handler in handlers:
                    await handler.listed.wait()
        except TimeoutError:
            log.warning(
                "the cluster's nodes and pods are not listed yet; answering without them",
                extra={"waited_s": self.settings.cluster_sync_timeout_s},
            )

    async def _bound_pod_gone(self, pod: Mapping[str, Any]) -> None:
        """A bound pod was deleted or ended. The leader's pod watch frees its slices; a
        replica that does not lead frees them itself if they are still booked a moment
        later (the write is compare-and-set: two replicas freeing one pod is harmless, only
        wasted writes, hence the wait). Without this, a delete that came while no replica
        led (the leader died, or lost its lease in a bus outage) held its room until the
        new leader's relist."""
        uid = str((pod.get("metadata") or {}).get("uid") or "")
        if self.leading or uid not in self.ledger:
            return
        ended = (pod.get("status") or {}).get("phase") in TERMINAL_PHASES
        task = asyncio.create_task(self._release_unless_freed(uid, "ended" if ended else "deleted"))
        self._followups.add(task)
        task.add_done_callback(self._followups.discard)

    async def _release_unless_freed(self, uid: str, reason: str) -> None:
        await asyncio.sleep(self.settings.follower_release_after_s)
        if uid in self.ledger and await self.engine.release(uid, reason) is not None:
            RELEASES.labels(reason=reason).inc()

    async def _run_cluster_watch(self, watch: Any, *handlers: Any) -> None:
        try:
            await watch(*handlers)
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("the cluster watch stopped")

    def _on_role(self, leading: bool) -> None:
        LEADER.labels(replica=self.replica).set(1 if leading else 0)
        for task in self._leader_tasks:
            task.cancel()
        self._leader_tasks = []
        watch = getattr(self.backend, "run_pod_watch", None)
        if leading and watch is not None:
            self._leader_tasks.append(asyncio.create_task(self._run_pod_watch(watch)))

    async def _run_pod_watch(self, watch: Any) -> None:
        """Rebuild from pod annotations, release pods that end, and reconcile every booking
        with the pods the API server has (leader only; reconcile.py)."""
        from .reconcile import PodWatchHandler

        handler = PodWatchHandler(self.engine, self.settings.release_unbound_after_s)

        async def reconcile() -> None:
            while True:
                await asyncio.sleep(self.settings.reconcile_interval_s)
                try:
                    await handler.reconcile()
                except Exception:
                    log.exception("reconciling bookings failed")

        try:
            await asyncio.gather(watch(handler), reconcile())
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("the pod watch stopped")

    async def wait_died(self) -> str:
        """Until one of its loops ends unasked (it crashed); what ended and how."""
        return await self.vitals.died()

    async def stop(self) -> None:
        self.vitals.stop()
        tasks, self._tasks = self._tasks + self._leader_tasks + list(self._followups), []
        self._leader_tasks = []
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(Exception):
                await stop_task(task, task.get_name(), fields={"replica": self.replica})
        lease, self.lease = self.lease, None
        if lease is not None:
            await lease.stop()
        webhook, self._webhook = self._webhook, None
        if webhook is not None:
            await webhook.stop()
        for runner in (self._extender_runner, self._runner):
            if runner is not None:
                await runner.cleanup()
        self._runner = self._extender_runner = None
        self._port = self._extender_port = None
        await self.journal.close()
        gate, self.gate = self.gate, None
        await close_gate(gate)
        bus, self._bus = self._bus, None
        if bus is not None:
            self.engine.set_event_sink(None)
            await bus.close()
        close = getattr(self.backend, "close", None)
        if close is not None:
            await close()

    async def _on_inventory(self, inventory: NodeInventory) -> None:
        changed = self.engine.on_inventory(inventory)
        if changed:
            log.info(
                "node inventory changed",
                extra={
                    "node": inventory.node,
                    "gpus": [g.uuid for g in inventory.gpus],
                    "unhealthy": [g.uuid for g in inventory.gpus if not g.healthy],
                },
            )
        returned = inventory.node in self._unavailable
        if returned:
            self._unavailable.discard(inventory.node)
            log.info("node available again", extra={"node": inventory.node})
        if changed or returned:  # not at every heartbeat: counting walks every node
            self._count_nodes()

    def _count_nodes(self) -> None:
        """The node gauges, at once when a node comes or returns, else at each heartbeat check."""
        known = sum(1 for _ in self.cluster.states())
        NODES.labels(replica=self.replica, state="unavailable").set(len(self._unavailable))
        NODES.labels(replica=self.replica, state="available").set(known - len(self._unavailable))

    async def _watch_heartbeats(self) -> None:
        """Say when a node's agent falls silent (it keeps its allocations, takes no new ones)."""
        interval = max(0.2, self.settings.node_timeout_s / 3)
        while True:
            await asyncio.sleep(interval)
            states = list(self.cluster.states())
            for state in states:
                if not self.cluster.is_fresh(state) and state.name not in self._unavailable:
                    self._unavailable.add(state.name)
                    log.warning(
                        "node unavailable: its agent stopped sending heartbeats",
                        extra={
                            "node": state.name,
                            "silent_s": round(self.cluster.silent_s(state), 1),
                            "pods_kept": len(self.ledger.on_node(state.name)),
                        },
                    )
            self._count_nodes()

    async def _on_filtered(self, pod: dict[str, Any], outcome: FilterOutcome) -> None:
        """A pod no node can take: tell NATS listeners and, as the leader, the cluster, once
        the API server lists it as pending (a filter may come before the watch says so)."""
        if outcome.passed or self._bus is None:
            return
        ref = pod_ref(pod)
        try:
            requests = self.core.parse(pod).containers
        except ValueError:
            requests = ()
        nodes = len(outcome.failed) + len(outcome.unresolvable)
        if nodes > FILTER_SLICE:  # grouping 100,000 reasons: off the loop (the data is ours)
            report = await asyncio.to_thread(pending_report, ref, requests, outcome)
        else:
            report = pending_report(ref, requests, outcome)
        unbound = self._unbound
        if unbound is not None and unbound.listed.is_set() and ref.uid not in unbound:
            # Not (yet) a pod the API server has waiting: a made-up body, or a watch a moment
            # behind. Kept (bounded) until the watch lists it; else never shown.
            FILTERED_UNKNOWN.inc()
            self._deferred[ref.uid] = report
            while len(self._deferred) > DEFERRED_REPORTS:
                self._deferred.popitem(last=False)
            return
        await self._announce(report)

    async def _became_pending(self, uid: str) -> None:
        report = self._deferred.pop(uid, None)
        if report is not None:
            await self._announce(report)

    async def _announce(self, report: tuple[PendingPod, str]) -> None:
        pending, message = report
        ref = PodRef(pending.namespace, pending.name, pending.uid)
        if self._bus is None:
            return
        with contextlib.suppress(Exception):
            await self._bus.publish(subjects.alloc_pending(), pending)
            self._announced[ref.uid] = ref
            self._announced.move_to_end(ref.uid)
            while len(self._announced) > PENDING_REMEMBERED:
                self._announced.popitem(last=False)
        now = time.monotonic()
        if not self.leading or now - self._last_event.get(ref.uid, -1e9) < EVENT_INTERVAL_S:
            return
        self._last_event[ref.uid] = now
        if len(self._last_event) > 10000:
            self._last_event.clear()
        try:
            await self.backend.emit_event(
                ref.namespace, ref.name, ref.uid, "VgpuUnschedulable", message[:1000]
            )
        except Exception as exc:
            log.warning(
                "cannot emit a scheduling event",
                extra={"pod": str(ref), "reason": message[:200], "error": str(exc)},
            )

    async def _resync(self) -> None:
        """The bus is back: read the decision store again (another replica's writes meanwhile
        may never have reached our watch). Inventory comes back with the agents' heartbeats,
        which they re-send as soon as they reconnect."""
        await self.journal.resync()
        log.info("decisions re-read after the bus came back", extra={"pods": len(self.ledger)})

    async def _left_pending(self, uid: str) -> None:
        """A pod announced as pending was bound or deleted: say it no longer waits."""
        self._deferred.pop(uid, None)
        ref = self._announced.pop(uid, None)
        if ref is None or self._bus is None:
            return
        done = PendingPod(namespace=ref.namespace, name=ref.name, uid=uid, waiting=False)
        with contextlib.suppress(Exception):
            await self._bus.publish(subjects.alloc_pending(), done)

    def _health(self) -> tuple[bool, dict[str, Any]]:
        connected = self._bus is not None and self._bus.client.is_connected
        down_since = None if self._bus is None else self._bus.down_since
        return connected, {
            "nats_connected": connected,
            "nats_down_since": down_since,
            "nodes": len(self.cluster.nodes()),
            "pods": len(self.ledger),
            "leader": self.leading,
            "replica": self.replica,
            "durable": self.journal.durable,
        }

    def _ready(self) -> tuple[bool, dict[str, Any]]:
        ok, details = self._health()
        return ok and self.leading, {**details, "role": "leader" if self.leading else "standby"}
