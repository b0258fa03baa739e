"""Structured logs: one JSON object per line, extra= fields merged in; or, for people at a
terminal (`vgpu up`), one text line with the same fields as key=value after the message."""

from __future__ import annotations

import json
import logging
import sys
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from types import MappingProxyType

_STANDARD = set(vars(logging.makeLogRecord({}))) | {"message", "asctime"}


# Fields every line logged from this context carries unless it names them itself: a node
# agent's lines name its node even where the code that logs has no node at hand (several
# agents share one process under `vgpu up`). Tasks and to_thread calls inherit the context.
_CONTEXT_FIELDS: ContextVar[Mapping[str, object]] = ContextVar(
    "vgpu_log_fields", default=MappingProxyType({})
)


@contextmanager
def log_fields(**fields: object) -> Iterator[None]:
    """Within this block (and the tasks it starts), log records carry these fields."""
    token = _CONTEXT_FIELDS.set({**_CONTEXT_FIELDS.get(), **fields})
    try:
        yield
    finally:
        _CONTEXT_FIELDS.reset(token)


class ContextFields(logging.Filter):
    """Adds the context's fields (log_fields) to records that lack them."""

    def filter(self, record: logging.LogRecord) -> bool:
        for key, value in _CONTEXT_FIELDS.get().items():
            if not hasattr(record, key):
                setattr(record, key, value)
        return True


def add_context_fields(logger: logging.Logger) -> None:
    if not any(isinstance(f, ContextFields) for f in logger.filters):
        logger.addFilter(ContextFields())


def fields_of(record: logging.LogRecord) -> dict[str, object]:
    """The extra= fields of a record (pod, node, gpu, reason, ...), in the order given."""
    return {key: value for key, value in vars(record).items()
            if key not in _STANDARD and not key.startswith("_")}  # fmt: skip


def _text_value(value: object) -> str:
    if not isinstance(value, str):
        return json.dumps(value, default=str, separators=(",", ":"))  # lists, numbers, null
    if value == "" or any(c.isspace() or c in '"=' for c in value):
        return json.dumps(value)  # quoted, so that key=value pairs stay one token each
    return value


class TextFormatter(logging.Formatter):
    """`time LEVEL logger: message key=value ...`: the fields a JSON line would carry, so a
    line about a pod names the pod, its node, GPU and reason at a terminal too."""

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s: %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        fields = fields_of(record)
        if not fields:
            return line
        head, newline, rest = line.partition("\n")  # a traceback stays below the fields
        pairs = " ".join(f"{key}={_text_value(value)}" for key, value in fields.items())
        return f"{head} {pairs}{newline}{rest}"


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, object] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        entry.update(fields_of(record))
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return json.dumps(entry, default=str)


def configure_logging(level: str = "info", json_format: bool = True) -> None:
    handler = logging.StreamHandler(sys.stderr)
    if json_format:
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(TextFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    # nats-py and aiohttp are chatty at INFO about every reconnect attempt and request.
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)
