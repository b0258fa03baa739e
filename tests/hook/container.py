"""Running a program as the hook sees it inside a container, for tests.

A private mount namespace (unshare, as root) gets a fresh tmpfs on /var/run, and each mount
of an Allocate response is bound at its container path with its read-only flag, as a
container runtime binds them. Nothing else of a container is emulated: the program keeps the
host's root, users and PID namespace, which is all the hook's configuration depends on.
"""

from __future__ import annotations

import functools
import shlex
import subprocess
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import pytest

from services.nodeagent.container_files import (
    CONFIG_MOUNT,
    STATE_MOUNT,
    HookSettings,
    config_dir,
    prepare,
    state_dir,
)


@dataclass(frozen=True)
class Mount:
    host_path: str
    container_path: str
    read_only: bool


@functools.cache
def namespaces_available() -> bool:
    try:
        probe = subprocess.run(
            ["unshare", "--mount", "--propagation", "private", "true"],
            capture_output=True,
            timeout=10,
        )
    except (OSError, subprocess.TimeoutExpired):
        return False
    return probe.returncode == 0


def require_namespaces() -> None:
    if not namespaces_available():
        pytest.skip("needs mount namespaces (unshare --mount, as root)")


def _bind(mount: Mount) -> str:
    # The namespace shares the host's root: a mount point made outside the fresh /var/run
    # would be left on the host. The hook itself is preloaded with LD_PRELOAD instead.
    if not mount.container_path.startswith("/var/run/"):
        raise ValueError(f"only mounts under /var/run are emulated, not {mount.container_path}")
    host, target = shlex.quote(mount.host_path), shlex.quote(mount.container_path)
    make = f"mkdir -p {target}" if Path(mount.host_path).is_dir() else f"touch {target}"
    lines = [make, f"mount --bind {host} {target}"]
    if mount.read_only:
        lines.append(f"mount -o remount,bind,ro {target}")
    return "\n".join(lines)


def bind_script(mounts: Iterable[Mount]) -> str:
    """Shell lines that lay the mounts out in the current (new) mount namespace; they stop the
    script at the first failure."""
    lines = ["mount -t tmpfs -o mode=755 vgpu-test-run /var/run", *map(_bind, mounts)]
    return "\n".join(f"{line} || exit 125" for chunk in lines for line in chunk.splitlines())


def allocate_mounts(host_dir: Path) -> list[Mount]:
    """The two mounts the agent's Allocate response asks for its container directory."""
    return [
        Mount(str(config_dir(host_dir)), CONFIG_MOUNT, True),
        Mount(str(state_dir(host_dir)), STATE_MOUNT, False),
    ]


def container_argv(argv: list[str], mounts: Iterable[Mount]) -> list[str]:
    script = bind_script(mounts) + '\nexec "$@"'
    return ["unshare", "--mount", "--propagation", "private", "sh", "-c", script, "sh", *argv]


def run_in_container(
    argv: list[str], mounts: Iterable[Mount], env: dict[str, str], timeout: float = 60
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        container_argv(argv, mounts), env=env, capture_output=True, text=True, timeout=timeout
    )


def agent_directory(host_dir: Path, settings: HookSettings | None = None) -> list[Mount]:
    """A container directory as the node agent prepares it at Allocate (its real code), and
    the two mounts its Allocate response asks for."""
    prepare(host_dir, settings or HookSettings())
    return allocate_mounts(host_dir)
