"""How the extender is reached: mutual TLS from the settings, refusals counted and logged,
and the filter-pass question between replicas over NATS (bind_guard.py)."""

from __future__ import annotations

import logging
import time

import msgspec
from nats.aio.msg import Msg

from services.common import subjects
from services.common.bus import Bus
from services.common.mutual_tls import MutualTls, ReloadingContext, ServerCertFiles
from services.common.schemas import FilterPassAnswer, FilterPassQuery

from .bind_guard import FilterPasses
from .extender import EXTENDER_REFUSED
from .settings import AllocatorSettings

log = logging.getLogger("vgpu.allocator")

LOG_EVERY_S = 10.0  # per reason: a flood of bad handshakes must not flood the log
PEER_TIMEOUT_S = 0.5  # a bind no replica filtered waits this long before it is refused


class _Refusals:
    def __init__(self) -> None:
        self._logged: dict[str, float] = {}

    def __call__(self, reason: str, detail: str, peer: str) -> None:
        EXTENDER_REFUSED.labels(reason=reason).inc()
        now = time.monotonic()
        if now - self._logged.get(reason, -1e9) >= LOG_EVERY_S:
            self._logged[reason] = now
            log.warning(
                "extender call refused",
                extra={"reason": reason, "peer": peer, "error": detail[:300]},
            )


def allowed_clients(settings: AllocatorSettings) -> tuple[str, ...]:
    return tuple(a.strip() for a in settings.extender_client_allowed.split(",") if a.strip())


def mutual_tls(settings: AllocatorSettings) -> MutualTls:
    """The extender's TLS from the settings; ValueError naming what is missing or unreadable."""
    missing = [
        name
        for name in ("extender_cert_file", "extender_key_file", "extender_client_ca_file")
        if not getattr(settings, name)
    ]
    if missing:
        raise ValueError(
            f"extender_port {settings.extender_port} serves HTTPS with client certificates: "
            f"set {', '.join(missing)}"
        )
    files = ServerCertFiles(
        settings.extender_cert_file, settings.extender_key_file, settings.extender_client_ca_file
    )
    return MutualTls(
        ReloadingContext(files, settings.tls_reload_s),
        allowed_clients(settings),
        _Refusals(),
    )


class FilterPassPeers:
    """Answer peers from our filter passes; ask peers when we have none."""

    def __init__(self, bus: Bus, passes: FilterPasses) -> None:
        self._bus = bus
        self._passes = passes

    async def serve(self) -> None:
        # Every replica hears every question (no queue group); only one with a record answers.
        await self._bus.client.subscribe(subjects.ALLOC_FILTER_PASS, cb=self._answer)

    async def _answer(self, msg: Msg) -> None:
        try:
            query = msgspec.json.decode(msg.data, type=FilterPassQuery)
        except msgspec.DecodeError:
            return
        age = self._passes.age(query.uid, query.node)
        if age is not None and msg.reply:
            await self._bus.client.publish(
                msg.reply, msgspec.json.encode(FilterPassAnswer(age_s=age))
            )

    async def ask(self, uid: str, node: str) -> float | None:
        query = msgspec.json.encode(FilterPassQuery(uid=uid, node=node))
        try:
            reply = await self._bus.client.request(
                subjects.ALLOC_FILTER_PASS, query, timeout=PEER_TIMEOUT_S
            )
            return msgspec.json.decode(reply.data, type=FilterPassAnswer).age_s
        except Exception:  # nobody passed it (timeout), or the bus is away: not passed
            return None
