"""The NATS bus: typed publish/subscribe and request/reply with trace context in headers.

Subscribers never crash on bad input: a message that does not decode is counted in
``vgpu_bus_undecodable_messages_total`` and logged, and the subscription carries on.
``vgpu_nats_connected{client}`` is 1 while a client is connected and 0 while it is not (it
keeps reconnecting, forever); ``Bus.down_since`` says since when, and callbacks given to
``Bus.on_reconnect`` run each time the bus comes back, so a service can resynchronise what
it may have missed meanwhile. Request handlers answer
every request: a domain error (``ReplyError``) or undecodable
request becomes ``{"error": "..."}``; an unexpected exception is logged and answered with a
generic message that leaks no internals.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import msgspec
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeoutError
from opentelemetry import context as otel_context
from opentelemetry.trace import SpanKind
from prometheus_client import Counter, Gauge

from services.common.schemas import ErrorReply
from services.common.tracing import context_from_headers, inject_headers, tracer

log = logging.getLogger("vgpu.bus")
_tracer = tracer("vgpu.bus")

UNDECODABLE = Counter(
    "vgpu_bus_undecodable_messages_total",
    "NATS messages that could not be decoded and were dropped",
    ["subject"],
)
HANDLER_ERRORS = Counter(
    "vgpu_bus_handler_errors_total",
    "NATS message handlers that raised an unexpected exception",
    ["subject"],
)
NATS_CONNECTED = Gauge(
    "vgpu_nats_connected",
    "1 while this NATS client is connected, 0 while the bus is down (it keeps reconnecting)",
    ["client"],
)

T = TypeVar("T", bound=msgspec.Struct)
R = TypeVar("R", bound=msgspec.Struct)

_encoder = msgspec.json.Encoder()


class BusError(RuntimeError):
    """A request could not be completed: no responder, timeout, or an error reply."""


class ReplyError(Exception):
    """Raised by a request handler to answer with a described error."""


def encode(message: msgspec.Struct) -> bytes:
    return _encoder.encode(message)


class _Link:
    """What the connection callbacks know: since when (wall clock) the bus has been down."""

    def __init__(self, url: str, name: str) -> None:
        self.url, self.name = url, name
        self.down_since: float | None = None
        self.on_back: list[Callable[[], Awaitable[None]]] = []
        self._resyncs: set[asyncio.Task[None]] = set()

    def back(self) -> None:
        """Run every resynchronisation callback (each in its own task: the client's
        callback must return for the connection to carry on)."""
        for callback in self.on_back:
            task = asyncio.create_task(self._resync(callback))
            self._resyncs.add(task)
            task.add_done_callback(self._resyncs.discard)

    async def _resync(self, callback: Callable[[], Awaitable[None]]) -> None:
        try:
            await callback()
        except Exception:
            log.exception("resynchronising after the bus came back failed",
                          extra={"client": self.name})  # fmt: skip

    def down(self) -> None:
        if self.down_since is None:
            self.down_since = time.time()
        NATS_CONNECTED.labels(client=self.name).set(0)

    def up(self) -> None:
        self.down_since = None
        NATS_CONNECTED.labels(client=self.name).set(1)


class Bus:
    def __init__(self, client: NatsClient, link: _Link | None = None) -> None:
        self._nc = client
        self._link = link
        self._subscriptions: list[Subscription] = []
        self._handler_slots = asyncio.Semaphore(64)
        self._tasks: set[asyncio.Task[None]] = set()

    @classmethod
    async def connect(cls, url: str, name: str, connect_timeout_s: float = 10.0) -> Bus:
        """Connect, retrying until `connect_timeout_s`; afterwards reconnect forever."""

        async def on_error(exc: Exception) -> None:
            log.debug("nats error", extra={"client": name, "error": str(exc)})

        link = _Link(url, name)

        async def on_disconnect() -> None:
            if not client.is_closed and not client.is_draining:
                link.down()
                log.warning(
                    "the bus is down: lost NATS at %s; reconnecting", url,
                    extra={"client": name, "nats": url},
                )  # fmt: skip

        async def on_reconnect() -> None:
            down_for = time.time() - link.down_since if link.down_since else 0.0
            link.up()
            log.warning(
                "the bus is back: reconnected to NATS at %s after %.1fs", url, down_for,
                extra={"client": name, "nats": url, "down_s": round(down_for, 1)},
            )  # fmt: skip
            link.back()

        client = NatsClient()
        connecting = client.connect(
            servers=[url],
            name=name,
            connect_timeout=2,
            reconnect_time_wait=0.5,
            max_reconnect_attempts=-1,  # also retries the first connection, until our deadline
            error_cb=on_error,
            disconnected_cb=on_disconnect,
            reconnected_cb=on_reconnect,
            allow_reconnect=True,
        )
        try:
            async with asyncio.timeout(connect_timeout_s):
                await connecting
        except Exception as exc:  # timeout, or whatever nats-py raised on the last attempt
            with contextlib.suppress(Exception):
                await client.close()
            raise BusError(f"cannot reach NATS at {url} within {connect_timeout_s}s") from exc
        link.up()
        return cls(client, link)

    def on_reconnect(self, callback: Callable[[], Awaitable[None]]) -> None:
        """Run `callback` each time the connection comes back after being lost."""
        if self._link is not None:
            self._link.on_back.append(callback)

    @property
    def connected(self) -> bool:
        return self._nc.is_connected

    @property
    def down_since(self) -> float | None:
        """When (Unix time) the connection was lost, or None while it is up."""
        return None if self._link is None else self._link.down_since

    @property
    def client(self) -> NatsClient:
        return self._nc

    async def publish(self, subject: str, message: msgspec.Struct) -> None:
        await self._nc.publish(subject, encode(message), headers=inject_headers())

    async def request(
        self, subject: str, message: msgspec.Struct, reply_type: type[R], timeout: float = 2.0
    ) -> R:
        try:
            reply = await self._nc.request(
                subject, encode(message), timeout=timeout, headers=inject_headers()
            )
        except NoRespondersError as exc:
            raise BusError(f"nobody serves {subject}") from exc
        except (NatsTimeoutError, TimeoutError) as exc:
            raise BusError(f"no reply on {subject} within {timeout}s") from exc
        try:
            decoded = msgspec.json.decode(reply.data, type=reply_type)
        except msgspec.DecodeError as exc:
            raise BusError(f"undecodable reply on {subject}: {exc}") from exc
        error = getattr(decoded, "error", "")
        if error:
            raise BusError(error)
        return decoded

    async def subscribe(
        self,
        subject: str,
        message_type: type[T],
        handler: Callable[[T], Awaitable[None]],
        queue: str = "",
    ) -> Subscription:
        """Deliver decoded messages to `handler`, in order, inside the sender's trace."""

        async def on_message(msg: Msg) -> None:
            decoded = self._decode(msg, message_type)
            if decoded is None:
                return
            token = otel_context.attach(context_from_headers(msg.headers))
            try:
                await handler(decoded)
            except Exception:
                HANDLER_ERRORS.labels(subject=subject).inc()
                log.exception("handler failed", extra={"subject": msg.subject})
            finally:
                otel_context.detach(token)

        sub = await self._nc.subscribe(subject, queue=queue, cb=on_message)
        self._subscriptions.append(sub)
        # A round trip makes the server register the interest before we return, so a message
        # published right after (from any connection) cannot miss it.
        await self._nc.flush()
        return sub

    async def serve(
        self,
        subject: str,
        request_type: type[T],
        handler: Callable[[T], Awaitable[msgspec.Struct]],
        queue: str = "",
    ) -> Subscription:
        """Answer requests on `subject`, several at once (bounded), each in its own span."""

        async def answer(msg: Msg) -> None:
            async with self._handler_slots:
                reply: msgspec.Struct
                decoded = self._decode(msg, request_type)
                if decoded is None:
                    reply = ErrorReply(error=f"undecodable {request_type.__name__} on {subject}")
                else:
                    parent = context_from_headers(msg.headers)
                    with _tracer.start_as_current_span(
                        f"serve {subject}", context=parent, kind=SpanKind.SERVER
                    ):
                        reply = await self._run_handler(subject, handler, decoded)
                if msg.reply:
                    await self._nc.publish(msg.reply, encode(reply), headers=inject_headers())

        async def on_message(msg: Msg) -> None:
            task = asyncio.create_task(answer(msg))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

        sub = await self._nc.subscribe(subject, queue=queue, cb=on_message)
        self._subscriptions.append(sub)
        # A round trip makes the server register the interest before we return, so a message
        # published right after (from any connection) cannot miss it.
        await self._nc.flush()
        return sub

    @staticmethod
    async def _run_handler(
        subject: str, handler: Callable[[Any], Awaitable[msgspec.Struct]], request: Any
    ) -> msgspec.Struct:
        try:
            return await handler(request)
        except ReplyError as exc:
            return ErrorReply(error=str(exc))
        except Exception:
            HANDLER_ERRORS.labels(subject=subject).inc()
            log.exception("request handler failed", extra={"subject": subject})
            return ErrorReply(error=f"internal error while handling {subject}")

    @staticmethod
    def _decode(msg: Msg, message_type: type[T]) -> T | None:
        try:
            return msgspec.json.decode(msg.data, type=message_type)
        except msgspec.DecodeError as exc:
            UNDECODABLE.labels(subject=msg.subject).inc()
            log.warning(
                "dropped undecodable message",
                extra={"subject": msg.subject, "type": message_type.__name__, "error": str(exc)},
            )
            return None

    async def close(self) -> None:
        """Stop taking messages, let in-flight handlers finish, then disconnect."""
        if self._link is not None:  # a client that is gone is no longer a series to watch
            with contextlib.suppress(KeyError):
                NATS_CONNECTED.remove(self._link.name)
        for sub in self._subscriptions:
            with contextlib.suppress(Exception):  # already gone with the connection
                await sub.unsubscribe()
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=2)
        if not self._nc.is_closed:
            try:
                await self._nc.drain()
            except Exception:
                await self._nc.close()
