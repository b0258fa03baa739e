"""HTTPS with client-certificate authentication for an aiohttp application.

Three things the plain ``TCPSite(ssl_context=...)`` cannot do, which a shared cluster needs:

* every refused handshake is reported with its reason (no client certificate, a certificate
  from another CA, an expired one, not TLS at all, ...) so it can be counted: the TLS
  handshake runs in a small gate protocol that hands the connection to aiohttp only once it
  succeeded;
* the certificate, key and client CA are re-read when their files change (Secret volumes,
  cert-manager renewals): each new handshake uses the newest context; a half-written pair is
  ignored until it is whole again, and established connections keep theirs;
* the client's identity (CN, DNS/URI SANs, O) can be limited to a list (``client_allowed``).
"""

from __future__ import annotations

import asyncio
import logging
import os
import ssl
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

log = logging.getLogger("vgpu.tls")

HANDSHAKE_TIMEOUT_S = 10.0

# OpenSSL X509_V_ERR_* codes a client certificate is refused with, as reasons to count.
_VERIFY_REASONS = {
    2: "unknown_ca",  # unable to get issuer certificate
    9: "not_yet_valid",
    10: "expired",
    18: "unknown_ca",  # self-signed leaf
    19: "unknown_ca",  # self-signed certificate in chain
    20: "unknown_ca",  # unable to get local issuer certificate
    21: "unknown_ca",  # unable to verify the first certificate
    23: "revoked",
    24: "bad_certificate",  # invalid CA certificate
    26: "wrong_purpose",  # not a client certificate (extended key usage)
}
_SSL_REASONS = {
    "PEER_DID_NOT_RETURN_A_CERTIFICATE": "no_client_cert",
    "HTTP_REQUEST": "not_tls",
    "WRONG_VERSION_NUMBER": "not_tls",
    "UNSUPPORTED_PROTOCOL": "old_protocol",
    "NO_SHARED_CIPHER": "handshake_failed",
}

Refused = Callable[[str, str, str], None]  # (reason, detail, peer address)


def refusal_reason(exc: BaseException) -> str:
    """The counted reason of a failed server-side handshake."""
    if isinstance(exc, ssl.SSLCertVerificationError):
        return _VERIFY_REASONS.get(exc.verify_code, "bad_certificate")
    if isinstance(exc, ssl.SSLError):
        return _SSL_REASONS.get(exc.reason or "", "handshake_failed")
    if isinstance(exc, TimeoutError):
        return "handshake_timeout"
    return "handshake_aborted"  # the client closed the connection during the handshake


@dataclass(frozen=True)
class ServerCertFiles:
    cert_file: str
    key_file: str
    client_ca_file: str

    def paths(self) -> tuple[str, str, str]:
        return (self.cert_file, self.key_file, self.client_ca_file)


def _stamp(paths: Iterable[str]) -> tuple[tuple[int, int, int], ...]:
    """What changes when a file is replaced or rewritten (Secret volumes swap a symlink)."""
    stamps = []
    for path in paths:
        info = os.stat(path)
        stamps.append((info.st_ino, info.st_size, info.st_mtime_ns))
    return tuple(stamps)


def server_context(files: ServerCertFiles) -> ssl.SSLContext:
    """TLS 1.2+, our certificate, and a client certificate signed by the client CA required."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.load_cert_chain(files.cert_file, files.key_file)
    context.load_verify_locations(cafile=files.client_ca_file)
    context.verify_mode = ssl.CERT_REQUIRED
    return context


class ReloadingContext:
    """The server context, rebuilt when the files change (checked at most every interval)."""

    def __init__(self, files: ServerCertFiles, check_interval_s: float = 1.0) -> None:
        for what, path in zip(("certificate", "key", "client CA"), files.paths(), strict=True):
            if not path:
                raise ValueError(f"mutual TLS needs a {what} file")
        self.files = files
        self.check_interval_s = check_interval_s
        try:
            self._stamp = _stamp(files.paths())
            self._context = server_context(files)
        except (OSError, ssl.SSLError) as exc:
            raise ValueError(f"cannot load the TLS files {list(files.paths())}: {exc}") from exc
        self._checked = time.monotonic()
        self._failed_stamp: tuple[tuple[int, int, int], ...] | None = None
        self.reloads = 0

    def current(self) -> ssl.SSLContext:
        now = time.monotonic()
        if now - self._checked >= self.check_interval_s:
            self._checked = now
            self._reload_if_changed()
        return self._context

    def _reload_if_changed(self) -> None:
        try:
            stamp = _stamp(self.files.paths())
        except OSError as exc:  # mid-rotation a file may be missing for a moment
            log.warning(
                "a TLS file cannot be read; keeping the loaded one", extra={"error": str(exc)}
            )
            return
        if stamp == self._stamp or stamp == self._failed_stamp:
            return
        try:
            context = server_context(self.files)
        except (OSError, ssl.SSLError) as exc:
            # A certificate written before its key: try again when the files change again.
            self._failed_stamp = stamp
            log.warning(
                "new TLS files do not load; keeping the previous ones",
                extra={"files": list(self.files.paths()), "error": str(exc)},
            )
            return
        self._context, self._stamp, self._failed_stamp = context, stamp, None
        self.reloads += 1
        log.info("TLS files reloaded", extra={"files": list(self.files.paths())})


@dataclass(frozen=True)
class ClientIdentity:
    common_name: str = ""
    organizations: tuple[str, ...] = ()
    dns_names: tuple[str, ...] = ()
    uris: tuple[str, ...] = ()

    @classmethod
    def from_peercert(cls, peercert: dict[str, Any] | None) -> ClientIdentity:
        if not peercert:
            return cls()
        names: dict[str, list[str]] = {}
        for rdn in peercert.get("subject", ()):
            for key, value in rdn:
                names.setdefault(key, []).append(value)
        sans = peercert.get("subjectAltName", ())
        return cls(
            common_name=(names.get("commonName") or [""])[0],
            organizations=tuple(names.get("organizationName", ())),
            dns_names=tuple(v for k, v in sans if k == "DNS"),
            uris=tuple(v for k, v in sans if k == "URI"),
        )

    def matches(self, allowed: str) -> bool:
        """``CN=x``, ``O=x``, ``DNS:x``, ``URI:x``, or a bare name (the CN or a DNS SAN)."""
        if allowed.startswith("CN="):
            return self.common_name == allowed[3:]
        if allowed.startswith("O="):
            return allowed[2:] in self.organizations
        if allowed.startswith("DNS:"):
            return allowed[4:] in self.dns_names
        if allowed.startswith("URI:"):
            return allowed[4:] in self.uris
        return allowed == self.common_name or allowed in self.dns_names

    def __str__(self) -> str:
        parts = [f"CN={self.common_name}"] + [f"O={o}" for o in self.organizations]
        return ",".join(parts + [f"DNS:{d}" for d in self.dns_names])


@dataclass
class MutualTls:
    """What a mutual-TLS site needs: the files, who may call, and whom to tell of refusals."""

    context: ReloadingContext
    client_allowed: tuple[str, ...] = ()  # empty: any certificate the client CA signed
    on_refused: Refused = field(default=lambda reason, detail, peer: None)

    def allows(self, identity: ClientIdentity) -> bool:
        return not self.client_allowed or any(identity.matches(a) for a in self.client_allowed)


def identity_middleware(tls: MutualTls) -> Any:
    """403 for a verified client whose identity is not in ``client_allowed`` (counted)."""

    @web.middleware
    async def check(request: web.Request, handler: Any) -> web.StreamResponse:
        transport = request.transport
        peercert = transport.get_extra_info("peercert") if transport is not None else None
        identity = ClientIdentity.from_peercert(peercert)
        if not tls.allows(identity):
            peer = str(request.remote or "")
            tls.on_refused("client_not_allowed", str(identity), peer)
            raise web.HTTPForbidden(
                text=f"client certificate {identity} is not allowed to call this endpoint "
                f"(allowed: {', '.join(tls.client_allowed)})"
            )
        return await handler(request)

    return check


class _TlsGate(asyncio.Protocol):
    """Runs the server-side handshake, then hands the connection to aiohttp's handler."""

    def __init__(self, tls: MutualTls, make_handler: Callable[[], asyncio.Protocol]) -> None:
        self._tls = tls
        self._make_handler = make_handler
        self._raw: asyncio.Transport | None = None
        self._task: asyncio.Task[None] | None = None
        self._early: bytearray = bytearray()  # decrypted bytes that came before the hand-over
        self._eof = False
        self._lost = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self._raw = transport
        transport.pause_reading()  # nothing may be read before the TLS layer is in place
        self._task = asyncio.get_running_loop().create_task(self._handshake())

    async def _handshake(self) -> None:
        raw = self._raw
        assert raw is not None
        peername = raw.get_extra_info("peername")
        peer = f"{peername[0]}:{peername[1]}" if peername else ""
        try:
            tls = await asyncio.get_running_loop().start_tls(
                raw,
                self,
                self._tls.context.current(),
                server_side=True,
                ssl_handshake_timeout=HANDSHAKE_TIMEOUT_S,
            )
        except (OSError, TimeoutError, ssl.SSLError, ConnectionError) as exc:
            self._tls.on_refused(refusal_reason(exc), str(exc), peer)
            raw.close()  # after the TLS alert that tells the client why
            return
        if tls is None or self._lost:
            return
        handler = self._make_handler()
        tls.set_protocol(handler)
        handler.connection_made(tls)
        if self._early:
            handler.data_received(bytes(self._early))
        if self._eof:
            handler.eof_received()

    # Decrypted data that arrives between the handshake and the hand-over is kept for aiohttp.
    def data_received(self, data: bytes) -> None:
        self._early.extend(data)

    def eof_received(self) -> bool | None:
        self._eof = True
        return True

    def connection_lost(self, exc: Exception | None) -> None:
        self._lost = True


class MutualTlsSite(web.BaseSite):
    """A site like ``TCPSite`` whose connections pass the gate first."""

    __slots__ = ("_host", "_port", "_tls")

    def __init__(self, runner: web.BaseRunner, host: str, port: int, tls: MutualTls) -> None:
        super().__init__(runner)
        self._host = host
        self._port = port
        self._tls = tls

    @property
    def name(self) -> str:
        return f"https://{self._host}:{self._port}"

    async def start(self) -> None:
        await super().start()
        server = self._runner.server
        assert server is not None
        self._server = await asyncio.get_running_loop().create_server(
            lambda: _TlsGate(self._tls, server),
            self._host,
            self._port,
            backlog=self._backlog,
            reuse_address=True,
        )


async def serve_mutual_tls(
    app: web.Application, host: str, port: int, tls: MutualTls, shutdown_timeout: float = 60.0
) -> tuple[web.AppRunner, int]:
    """Like http_server.serve, over HTTPS with client certificates; the app should have
    ``identity_middleware(tls)`` when ``tls.client_allowed`` is set."""
    runner = web.AppRunner(app, access_log=None, shutdown_timeout=shutdown_timeout)
    await runner.setup()
    try:
        await MutualTlsSite(runner, host, port, tls).start()
    except BaseException:
        await runner.cleanup()
        raise
    return runner, int(runner.addresses[0][1])
