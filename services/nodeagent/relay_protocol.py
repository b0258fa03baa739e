"""The relay protocol, version 1 (libvgpu-hook/PROTOCOL.md): one JSON object per line.

Pure decoding and encoding, no sockets: `decode_line` turns one line from a hook into a typed
message or raises RelayProtocolError whose `reason` is the metric label (`oversized`,
`not_utf8` or `malformed`) and whose message says what was wrong.
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

VERSION = 1
MAX_LINE_BYTES = 4096  # including the newline

NonNegative = Annotated[int, msgspec.Meta(ge=0)]
Comm = Annotated[str, msgspec.Meta(max_length=64)]
Percent = Annotated[int, msgspec.Meta(ge=0, le=100)]


class RelayProtocolError(ValueError):
    def __init__(
        self,
        reason: Literal["oversized", "malformed", "not_utf8", "over_device_size"],
        message: str,
    ) -> None:
        super().__init__(message)
        self.reason = reason


class HelloDevice(msgspec.Struct, frozen=True):
    index: NonNegative
    uuid: str
    limit_mib: NonNegative
    cores: Percent


class UsageDevice(msgspec.Struct, frozen=True):
    index: NonNegative
    used_mib: NonNegative  # the container's total on that device, all its processes
    process_used_mib: NonNegative  # this process
    # Of used_mib: allocations spilled to managed memory (virtual device memory); sent only
    # for devices with virtual memory on.
    spilled_mib: NonNegative = 0


class Hello(msgspec.Struct, frozen=True, tag="hello", tag_field="type"):
    v: int
    pid: NonNegative
    comm: Comm
    devices: list[HelloDevice]


class Usage(msgspec.Struct, frozen=True, tag="usage", tag_field="type"):
    v: int
    pid: NonNegative
    ts_ms: NonNegative
    devices: list[UsageDevice]
    launches: NonNegative
    throttled_ms: NonNegative


class Exit(msgspec.Struct, frozen=True, tag="exit", tag_field="type"):
    v: int
    pid: NonNegative


HookMessage = Hello | Usage | Exit

_decoder = msgspec.json.Decoder(HookMessage)


def decode_line(line: bytes) -> HookMessage:
    """One line as read from the socket (with or without its newline)."""
    if len(line) > MAX_LINE_BYTES:
        raise RelayProtocolError(
            "oversized", f"line of {len(line)} bytes is over the {MAX_LINE_BYTES}-byte limit"
        )
    try:
        line.decode("utf-8")  # JSON is UTF-8; 4 KiB at most, so checking costs nothing
    except UnicodeDecodeError as exc:
        raise RelayProtocolError(
            "not_utf8", f"line is not UTF-8 (byte 0x{line[exc.start]:02x} at offset {exc.start})"
        ) from exc
    try:
        message = _decoder.decode(line)
    except msgspec.ValidationError as exc:
        raise RelayProtocolError("malformed", f"invalid message: {exc}") from exc
    except msgspec.DecodeError as exc:
        raise RelayProtocolError("malformed", f"not a JSON object: {exc}") from exc
    if message.v != VERSION:
        raise RelayProtocolError(
            "malformed", f"unsupported protocol version {message.v!r} (this agent speaks {VERSION})"
        )
    return message


class UtilDevice(msgspec.Struct, frozen=True):
    index: int
    sm_util_percent: float
    container_sm_util_percent: float  # -1 when unknown


class Util(msgspec.Struct, frozen=True, tag="util", tag_field="type"):
    v: int
    devices: list[UtilDevice]


_encoder = msgspec.json.Encoder()


def encode_util(devices: list[UtilDevice]) -> bytes:
    return _encoder.encode(Util(v=VERSION, devices=devices)) + b"\n"
