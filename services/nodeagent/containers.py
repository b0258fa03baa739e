"""Containers this agent has resolved: whose each per-container directory is.

The agent learns a directory's owner once (PodResources + claim) and records it next to the
limit file in `owner.json` (agent-private), so a restarted agent can serve the directory's
relay socket again without asking anyone.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import msgspec

from services.nodeagent import limits_file
from services.nodeagent.files import atomic_write
from services.nodeagent.limits_file import ContainerLimits, LimitsError

log = logging.getLogger("vgpu.nodeagent")

OWNER_FILE = "owner.json"


class _Owner(msgspec.Struct):
    pod_uid: str = ""


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


def record_owner(container: ResolvedContainer) -> None:
    atomic_write(
        container.host_dir / OWNER_FILE, msgspec.json.encode(_Owner(container.pod_uid)).decode()
    )


def restore(container_root: Path) -> list[ResolvedContainer]:
    """Every directory under `container_root` with a limit file this agent can read."""
    found: list[ResolvedContainer] = []
    if not container_root.is_dir():
        return found
    for directory in sorted(container_root.iterdir()):
        limits_path = directory / limits_file.FILE_NAME
        if not directory.is_dir() or not limits_path.is_file():
            continue
        try:
            limits = limits_file.parse(limits_path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, LimitsError) as exc:
            log.warning(
                "cannot restore container directory",
                extra={"dir": str(directory), "error": str(exc)},
            )
            continue
        try:
            owner = msgspec.json.decode((directory / OWNER_FILE).read_bytes(), type=_Owner)
        except (OSError, msgspec.DecodeError):
            owner = _Owner()
        found.append(ResolvedContainer(directory.name, directory, limits, owner.pod_uid))
    return found
