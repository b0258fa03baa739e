"""A container's host directory: what its hook may only read, and where it may write.

    <container_root>/<key>/            0700: only the agent and the runtime reach it
        config/  -> /var/run/vgpu        read-only mount: hook.conf (at Allocate), limits
        state/   -> /var/run/vgpu-state  read-write mount: hook.region (at Allocate), relay.sock

Inside a container the hook takes its limits and settings only from the read-only mount, so
nothing in the container (root included) can change them; the two mounts are siblings, so
neither can shadow the other whatever order a runtime mounts them in. The hook's shared
accounting region must be writable by every process of the container, so it lives apart, is
created here with a header the hook checks (a zeroed or foreign file makes CUDA fail to
initialise), and is never trusted by the agent (docs/nodeagent.md).

Device-plugin agnostic: Allocate uses it today, a DRA driver's NodePrepareResources would too.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass
from pathlib import Path

from services.nodeagent.files import atomic_write, atomic_write_bytes

CONFIG_MOUNT = "/var/run/vgpu"  # fixed in the hook (libvgpu-hook/src/config.h)
STATE_MOUNT = "/var/run/vgpu-state"
CONFIG_SUBDIR = "config"
STATE_SUBDIR = "state"
HOOK_CONF_FILE = "hook.conf"
LIMITS_FILE = "limits"  # written by the resolver once it knows whose container this is
REGION_FILE = "hook.region"

CONTAINER_DIR_MODE = 0o700  # host users other than root never reach a container's files
CONFIG_DIR_MODE = 0o755
# Any user of the container creates nothing here but must reach the region and the socket;
# the sticky bit keeps non-root users from replacing the agent's files.
STATE_DIR_MODE = 0o1777
REGION_MODE = 0o666  # the container's processes may run as any user; all update the region

# The region header the hook expects (libvgpu-hook/PROTOCOL.md): magic, then layout 0 and
# size 0 = "grow me to your layout", so the agent never depends on the hook's layout. Anything
# else there (zeroed, foreign) is refused by the hook.
REGION_MAGIC = 0x3147455255504756  # "VGPUREG1", VGPU_REGION_MAGIC in libvgpu-hook/src/region.h
COMPUTE_POLICIES = ("share", "hard", "off")
MAX_LIMIT_WAIT_MS = 600_000  # the hook refuses longer waits


def region_header() -> bytes:
    return struct.pack("<QII", REGION_MAGIC, 0, 0)


@dataclass(frozen=True)
class HookSettings:
    """What hook.conf tells every hook on this node."""

    limit_wait_ms: int = 10_000  # how long the first CUDA call waits for the limit file
    compute_policy: str = "share"  # share | hard | off (libvgpu-hook/README.md)

    def __post_init__(self) -> None:
        if self.compute_policy not in COMPUTE_POLICIES:
            raise ValueError(
                f"compute policy must be one of {', '.join(COMPUTE_POLICIES)}, "
                f"got {self.compute_policy!r}"
            )
        if not 0 <= self.limit_wait_ms <= MAX_LIMIT_WAIT_MS:
            raise ValueError(
                f"limit wait must be 0 to {MAX_LIMIT_WAIT_MS} ms, got {self.limit_wait_ms}"
            )

    def render(self) -> str:
        return (
            "# written by the vgpu node agent; read by the hook (libvgpu-hook/PROTOCOL.md)\n"
            f"version=1\nlimit_wait_ms={self.limit_wait_ms}\n"
            f"compute_policy={self.compute_policy}\n"
        )


def config_dir(host_dir: Path) -> Path:
    return host_dir / CONFIG_SUBDIR


def state_dir(host_dir: Path) -> Path:
    return host_dir / STATE_SUBDIR


def limits_path(host_dir: Path) -> Path:
    return config_dir(host_dir) / LIMITS_FILE


def _directory(path: Path, mode: int) -> None:
    path.mkdir(parents=True, exist_ok=True)
    os.chmod(path, mode)  # mkdir's mode is cut by the umask


def prepare(host_dir: Path, settings: HookSettings) -> None:
    """Make the directory ready for a container about to start; OSError if it cannot be.

    Called before each container start that uses these device IDs (the kubelet never hands
    them to two running containers), so it resets what an earlier container left: its limits
    never apply to the next one, and accounting starts from a fresh region.
    """
    _directory(host_dir, CONTAINER_DIR_MODE)
    _directory(config_dir(host_dir), CONFIG_DIR_MODE)
    _directory(state_dir(host_dir), STATE_DIR_MODE)
    limits_path(host_dir).unlink(missing_ok=True)
    atomic_write(config_dir(host_dir) / HOOK_CONF_FILE, settings.render())
    # Durable too: after a node reboot the kubelet restarts containers without an Allocate,
    # and a region left empty by a crash would keep their CUDA from starting.
    atomic_write_bytes(state_dir(host_dir) / REGION_FILE, region_header(), REGION_MODE)
    os.utime(host_dir)  # the cleanup's grace period counts from the last Allocate
