"""Reader of the kubelet's device-manager checkpoint: which container holds which device IDs.

The kubelet writes `<plugin_dir>/kubelet_internal_checkpoint` (temporary file + rename) right
after every Allocate. Unlike the PodResources API it lists plain init containers too, but it
names a pod only by UID. Shape (Go's encoding/json of the device manager's checkpoint):

    {"Data": {"PodDeviceEntries": [{"PodUID", "ContainerName", "ResourceName",
                                    "DeviceIDs", "AllocResp"}, ...],
              "RegisteredDevices": {"<resource>": ["<id>", ...]}},
     "Checksum": <uint32 as a number>}

`DeviceIDs` is an object keyed by NUMA node id as a string (`{"-1": [...], "0": [...]}`) since
Kubernetes 1.20, a plain list before. Go writes nil slices as `null`. Fields this reader does not
use (`AllocResp`, `RegisteredDevices`, `BootID`, anything newer) are ignored, and the checksum is
not verified: it hashes Go type names that have changed between kubelet versions, and the
kubelet checks it itself when it loads the file.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

CHECKPOINT_FILE = "kubelet_internal_checkpoint"


class CheckpointError(ValueError):
    """The checkpoint file cannot be read as a kubelet checkpoint; the message says why."""


@dataclass(frozen=True)
class CheckpointEntry:
    pod_uid: str
    container: str
    resource: str
    device_ids: frozenset[str]  # every NUMA node's IDs joined


def _kind(value: Any) -> str:
    if value is None:
        return "null"
    return {dict: "an object", list: "a list", str: "a string", bool: "a boolean"}.get(
        type(value), "a number"
    )


def _json(data: bytes, source: str) -> Any:
    if not data.strip():
        raise CheckpointError(f"kubelet checkpoint {source} is empty")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise CheckpointError(f"kubelet checkpoint {source} is not UTF-8: {exc}") from exc
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        # Running out of input mid-document (a string never closed, a value or bracket
        # missing at the very end) is a truncated file rather than a garbled one.
        if exc.pos >= len(text.rstrip()) or exc.msg.startswith("Unterminated string"):
            raise CheckpointError(
                f"kubelet checkpoint {source} is truncated: the JSON ends after "
                f"{len(data)} bytes ({exc.msg})"
            ) from exc
        raise CheckpointError(
            f"kubelet checkpoint {source} is not valid JSON: {exc.msg} at line {exc.lineno} "
            f"column {exc.colno}"
        ) from exc


def _text(raw: Mapping[str, Any], field: str, where: str) -> str:
    value = raw.get(field)
    if not isinstance(value, str):
        raise CheckpointError(f"{where}: {field} must be a string, got {_kind(value)}")
    return value


def _id_list(value: Any, where: str) -> list[str]:
    if value is None:
        return []
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise CheckpointError(f"{where} must be a list of strings, got {_kind(value)}")
    return value


def _device_ids(value: Any, where: str) -> frozenset[str]:
    """Both forms: per-NUMA object (Kubernetes >= 1.20) and plain list (older)."""
    if isinstance(value, dict):
        found: set[str] = set()
        for numa, ids in value.items():
            try:
                int(numa)
            except ValueError:
                raise CheckpointError(
                    f"{where}: DeviceIDs key {numa!r} is not a NUMA node id"
                ) from None
            found.update(_id_list(ids, f"{where}: DeviceIDs[{numa!r}]"))
        return frozenset(found)
    if value is None or isinstance(value, list):
        return frozenset(_id_list(value, f"{where}: DeviceIDs"))
    raise CheckpointError(
        f"{where}: DeviceIDs must be an object keyed by NUMA node or a list, got {_kind(value)}"
    )


def parse_checkpoint(data: bytes, source: str = CHECKPOINT_FILE) -> tuple[CheckpointEntry, ...]:
    """The checkpoint's entries; CheckpointError (naming `source`) when the file is not one."""
    document = _json(data, source)
    if not isinstance(document, dict):
        raise CheckpointError(
            f"kubelet checkpoint {source}: expected a JSON object, got {_kind(document)}"
        )
    body = document.get("Data")
    if not isinstance(body, dict):
        raise CheckpointError(
            f"kubelet checkpoint {source}: Data must be an object, got {_kind(body)}"
        )
    checksum = document.get("Checksum")
    if checksum is not None and (isinstance(checksum, bool) or not isinstance(checksum, int)):
        raise CheckpointError(
            f"kubelet checkpoint {source}: Checksum must be a number, got {_kind(checksum)}"
        )
    raw_entries = body.get("PodDeviceEntries")
    if raw_entries is None:  # Go's nil slice: nothing allocated yet
        return ()
    if not isinstance(raw_entries, list):
        raise CheckpointError(
            f"kubelet checkpoint {source}: Data.PodDeviceEntries must be a list, "
            f"got {_kind(raw_entries)}"
        )
    entries: list[CheckpointEntry] = []
    for position, raw in enumerate(raw_entries):
        where = f"kubelet checkpoint {source}: PodDeviceEntries[{position}]"
        if not isinstance(raw, dict):
            raise CheckpointError(f"{where} must be an object, got {_kind(raw)}")
        entries.append(
            CheckpointEntry(
                pod_uid=_text(raw, "PodUID", where),
                container=_text(raw, "ContainerName", where),
                resource=_text(raw, "ResourceName", where),
                device_ids=_device_ids(raw.get("DeviceIDs"), where),
            )
        )
    return tuple(entries)


def holders_in(
    entries: tuple[CheckpointEntry, ...], resource: str, device_ids: set[str] | frozenset[str]
) -> list[CheckpointEntry]:
    """Entries of `resource` whose devices are exactly `device_ids`, in file order."""
    wanted = frozenset(device_ids)
    return [e for e in entries if e.resource == resource and e.device_ids == wanted]


class KubeletCheckpoint:
    """The checkpoint file, parsed again only when it changed (the kubelet replaces it by a
    rename, so a new inode, size or mtime means new content). Cheap enough to ask per poll."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._stamp: tuple[int, int, int] | None = None
        self._entries: tuple[CheckpointEntry, ...] = ()
        self._error = ""  # why the current file is not a checkpoint

    def entries(self) -> tuple[CheckpointEntry, ...]:
        """No file: no entries. A file that is not a checkpoint: CheckpointError, raised again
        on every call until the file changes."""
        try:
            handle = open(self.path, "rb")  # noqa: SIM115 - fstat of the very file read
        except FileNotFoundError:
            self._stamp, self._entries, self._error = None, (), ""
            return ()
        except OSError as exc:
            raise CheckpointError(f"cannot read kubelet checkpoint {self.path}: {exc}") from exc
        with handle:
            stat = os.fstat(handle.fileno())
            stamp = (stat.st_ino, stat.st_size, stat.st_mtime_ns)
            if stamp != self._stamp:
                try:
                    self._entries = parse_checkpoint(handle.read(), str(self.path))
                    self._error = ""
                except CheckpointError as exc:
                    self._entries, self._error = (), str(exc)
                except OSError as exc:
                    raise CheckpointError(
                        f"cannot read kubelet checkpoint {self.path}: {exc}"
                    ) from exc
                self._stamp = stamp
        if self._error:
            raise CheckpointError(self._error)
        return self._entries

    def holders(self, resource: str, device_ids: set[str]) -> list[CheckpointEntry]:
        return holders_in(self.entries(), resource, device_ids)
