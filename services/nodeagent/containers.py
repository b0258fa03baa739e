"""Containers this agent has resolved: whose each per-container directory is, with what limits.

The agent learns a directory's owner once (PodResources + claim) and records it, with the
limits it wrote, in its own state directory (`state_dir`, never mounted into a container).
A restarted agent rebuilds from those records alone: it never reads back anything from a
container directory (`limits`, the region, the relay socket), which the container can write.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from pathlib import Path

import msgspec

from services.nodeagent import limits_file
from services.nodeagent.files import atomic_write
from services.nodeagent.limits_file import ContainerLimits, LimitsError

log = logging.getLogger("vgpu.nodeagent")

RECORDS_DIR = "containers"
_KEY = re.compile(r"^[0-9a-f]{16}$")


@dataclass(frozen=True)
class ResolvedContainer:
    key: str
    host_dir: Path
    limits: ContainerLimits
    pod_uid: str = ""

    @property
    def name(self) -> str:
        return f"{self.limits.namespace}/{self.limits.pod}/{self.limits.container}"

    @property
    def gpu_uuids(self) -> tuple[str, ...]:
        return tuple(device.uuid for device in self.limits.devices)


class _Record(msgspec.Struct):
    key: str
    host_dir: str
    limits: str  # the limit file's text, as the agent wrote it
    pod_uid: str = ""


class ContainerRecords:
    """`<state_dir>/containers/<key>.json`, one per resolved container directory."""

    def __init__(self, state_dir: Path) -> None:
        self._dir = state_dir / RECORDS_DIR

    def save(self, container: ResolvedContainer) -> None:
        self._dir.mkdir(parents=True, exist_ok=True)
        record = _Record(
            key=container.key,
            host_dir=str(container.host_dir),
            limits=limits_file.render(container.limits),
            pod_uid=container.pod_uid,
        )
        atomic_write(self._dir / f"{container.key}.json", msgspec.json.encode(record).decode())

    def drop(self, key: str) -> None:
        if _KEY.match(key):
            (self._dir / f"{key}.json").unlink(missing_ok=True)

    def load(self) -> list[ResolvedContainer]:
        """Every record this agent can read, in key order; a bad one is logged and skipped."""
        found: list[ResolvedContainer] = []
        if not self._dir.is_dir():
            return found
        for path in sorted(self._dir.glob("*.json")):
            try:
                record = msgspec.json.decode(path.read_bytes(), type=_Record)
                if not _KEY.match(record.key) or path.stem != record.key:
                    raise LimitsError(f"record names key {record.key!r}")
                limits = limits_file.parse(record.limits)
            except (OSError, msgspec.DecodeError, LimitsError) as exc:
                log.warning(
                    "cannot restore a container record",
                    extra={"file": str(path), "error": str(exc)},
                )
                continue
            found.append(
                ResolvedContainer(record.key, Path(record.host_dir), limits, record.pod_uid)
            )
        return found
