"""What the runtime is asked to run: one process tree with its root, mounts and credentials."""

from __future__ import annotations

from dataclasses import dataclass, field

# Kept when running as root (--root): podman's default set. CAP_SYS_ADMIN (mount, unmount,
# remount, namespaces), CAP_MKNOD (no device cgroup here), CAP_SYS_PTRACE, CAP_NET_ADMIN,
# CAP_SYS_MODULE and every other capability are dropped from all sets and the bounding set.
ROOT_CAPABILITIES = {
    "CAP_CHOWN": 0,
    "CAP_DAC_OVERRIDE": 1,
    "CAP_FOWNER": 3,
    "CAP_FSETID": 4,
    "CAP_KILL": 5,
    "CAP_SETGID": 6,
    "CAP_SETUID": 7,
    "CAP_SETPCAP": 8,
    "CAP_NET_BIND_SERVICE": 10,
    "CAP_SYS_CHROOT": 18,
    "CAP_SETFCAP": 31,
}
DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


@dataclass(frozen=True)
class BindMount:
    source: str  # host path
    target: str  # path in the container
    read_only: bool = False


@dataclass(frozen=True)
class DeviceNode:
    source: str  # host device node
    target: str
    permissions: str = "rw"  # "r", "w", "m" as in the device-plugin API; no "w": read-only


@dataclass
class ContainerSpec:
    argv: list[str]
    hostname: str
    env: dict[str, str]
    cwd: str = "/"
    uid: int = 65534
    gid: int = 65534
    mounts: list[BindMount] = field(default_factory=list)
    devices: list[DeviceNode] = field(default_factory=list)
    cgroup: str = ""  # relative to the cgroup hierarchy's root; "" = stay where we are

    @property
    def capabilities(self) -> int:
        """The capability mask the command runs with: none unless it runs as root."""
        if self.uid != 0:
            return 0
        return sum(1 << number for number in ROOT_CAPABILITIES.values())
