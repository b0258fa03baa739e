"""Name where a JSON body stops being UTF-8, so a bad request is a 400 that names the field.

JSON is UTF-8 (RFC 8259); a decoder that meets other bytes only says "invalid start byte".
``utf8_problem`` says which field holds them: the body is read again with the bad bytes kept
as lone surrogates (Python's ``surrogateescape``), and the first key or string holding one is
the field at fault. Only called on the error path, so its cost does not matter.
"""

from __future__ import annotations

import json
from typing import Any

_ESCAPED = range(0xDC80, 0xDD00)  # where surrogateescape puts the bytes 0x80-0xFF


def _bad(text: str) -> bool:
    return any(ord(ch) in _ESCAPED for ch in text)


def _segment(key: str) -> str:
    if _bad(key):  # shown as \xNN: the bytes themselves cannot be printed
        key = key.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")
    return f".{key}" if key.replace("_", "").isalnum() else f"[{key}]"


def _find(value: Any, path: str) -> str | None:
    if isinstance(value, str):
        return path if _bad(value) else None
    if isinstance(value, dict):
        for key, item in value.items():
            where = path + _segment(key)
            if _bad(key):
                return where + " (a key)"
            found = _find(item, where)
            if found is not None:
                return found
    if isinstance(value, list):
        for index, item in enumerate(value):
            found = _find(item, f"{path}[{index}]")
            if found is not None:
                return found
    return None


def utf8_problem(body: bytes, root: str) -> str | None:
    """None for valid UTF-8; else '<field>: not valid UTF-8 (byte 0xNN at offset N)'."""
    try:
        body.decode("utf-8")
    except UnicodeDecodeError as exc:
        offset, byte = exc.start, body[exc.start]
    else:
        return None
    where = root
    try:
        found = _find(json.loads(body.decode("utf-8", "surrogateescape")), root)
    except ValueError:
        found = None  # not JSON either: the offset is all there is to say
    if found is not None:
        where = found
    # The field's text is not echoed back: it is exactly what cannot be printed safely.
    return f"{where}: not valid UTF-8 (byte 0x{byte:02x} at offset {offset})"
