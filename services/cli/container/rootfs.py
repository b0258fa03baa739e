"""The container's filesystem, built inside a fresh mount namespace, then pivoted into.

There is no image: the root is the host's `/` seen through an overlay whose upper layer is a
private tmpfs, so the container can create mount points and write files without touching the
host (a container's writable layer). The host's other mounts are bound back in, except
`/proc` (fresh, for the new PID namespace), `/sys` (fresh, read-only) and `/dev` (a tmpfs with
the usual few device nodes, as runc makes it). The Allocate response's mounts and devices go on
top, each read-only when it says so.
"""

from __future__ import annotations

import os
from collections import deque
from pathlib import Path

from services.cli.container import linux
from services.cli.container.spec import BindMount, ContainerSpec, DeviceNode

_OWN_TREES = ("/proc", "/sys", "/dev")  # made fresh, never bound from the host
_DEVICE_NODES = ("null", "zero", "full", "random", "urandom", "tty")
_DEV_LINKS = {
    "fd": "/proc/self/fd", "stdin": "/proc/self/fd/0", "stdout": "/proc/self/fd/1",
    "stderr": "/proc/self/fd/2", "ptmx": "pts/ptmx",
}  # fmt: skip
_READ_ONLY_PROC = ("sys", "sysrq-trigger", "irq", "bus")  # as Docker keeps them
_SAFE_FLAGS = linux.MS_NOSUID | linux.MS_NODEV


class RootfsError(RuntimeError):
    """The container's filesystem could not be made; the message names the step."""


def resolve_in_root(root: str, path: str) -> str:
    """`path` as the container sees it, with symlinks resolved inside `root`, never outside."""
    parts = deque(part for part in path.split("/") if part not in ("", "."))
    current: list[str] = []
    hops = 0
    while parts:
        part = parts.popleft()
        if part == "..":
            if current:
                current.pop()
            continue
        full = os.path.join(root, *current, part)
        if os.path.islink(full):
            hops += 1
            if hops > 40:
                raise RootfsError(f"too many symbolic links resolving {path} in the container")
            link = os.readlink(full)
            if link.startswith("/"):
                current = []
            parts.extendleft(reversed([p for p in link.split("/") if p not in ("", ".")]))
            continue
        current.append(part)
    return os.path.join(root, *current)


def _make_mount_point(target: str, directory: bool) -> None:
    if os.path.lexists(target):
        if os.path.isdir(target) != directory:
            kind = "a directory" if directory else "a file"
            raise RootfsError(f"cannot mount {kind} on {target}: it exists as another kind")
        return
    if directory:
        os.makedirs(target, exist_ok=True)
        return
    os.makedirs(os.path.dirname(target), exist_ok=True)
    os.close(os.open(target, os.O_CREAT | os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644))


def _bind(source: str, target: str) -> None:
    linux.mount(source, target, None, linux.MS_BIND | linux.MS_REC)


def _remount(target: str, read_only: bool, extra: int = 0) -> None:
    flags = linux.MS_REMOUNT | linux.MS_BIND | extra | (linux.MS_RDONLY if read_only else 0)
    linux.mount("none", target, None, flags)


def _host_mount_points(scratch: str) -> list[str]:
    """Top-most host mounts other than `/` and the trees the container gets fresh."""
    points: list[str] = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        point = line.split()[4].encode().decode("unicode_escape")
        if point == "/" or point.startswith(scratch):
            continue
        if any(point == tree or point.startswith(tree + "/") for tree in _OWN_TREES):
            continue
        points.append(point)
    kept: list[str] = []
    for point in sorted(set(points)):
        if not any(point.startswith(parent.rstrip("/") + "/") for parent in kept):
            kept.append(point)
    return kept


def _overlay_root(scratch: str) -> str:
    linux.mount("tmpfs", scratch, "tmpfs", _SAFE_FLAGS, "mode=0755")
    for name in ("upper", "work", "root"):
        os.mkdir(os.path.join(scratch, name), 0o755)
    root = os.path.join(scratch, "root")
    options = f"lowerdir=/,upperdir={scratch}/upper,workdir={scratch}/work"
    try:
        linux.mount("overlay", root, "overlay", _SAFE_FLAGS, options)
    except OSError as exc:
        raise RootfsError(f"cannot lay an overlay over the host's / ({exc.strerror})") from exc
    return root


def _proc(root: str) -> None:
    proc = os.path.join(root, "proc")
    flags = _SAFE_FLAGS | linux.MS_NOEXEC
    linux.mount("proc", proc, "proc", flags)
    for name in _READ_ONLY_PROC:
        path = os.path.join(proc, name)
        if os.path.exists(path):
            _bind(path, path)
            _remount(path, read_only=True, extra=flags)


def _sys(root: str) -> None:
    target = os.path.join(root, "sys")
    flags = _SAFE_FLAGS | linux.MS_NOEXEC | linux.MS_RDONLY
    try:
        linux.mount("sysfs", target, "sysfs", flags)
    except OSError:  # not allowed in some nested containers: the host's, read-only
        _bind("/sys", target)
        _remount(target, read_only=True, extra=_SAFE_FLAGS | linux.MS_NOEXEC)


def _dev(root: str, devices: list[DeviceNode]) -> None:
    dev = os.path.join(root, "dev")
    linux.mount("tmpfs", dev, "tmpfs", linux.MS_NOSUID, "mode=0755,size=65536k")
    for name in _DEVICE_NODES:
        if os.path.exists(f"/dev/{name}"):
            _make_mount_point(os.path.join(dev, name), directory=False)
            _bind(f"/dev/{name}", os.path.join(dev, name))
    for name, link in _DEV_LINKS.items():
        os.symlink(link, os.path.join(dev, name))
    for name in ("pts", "shm"):
        os.mkdir(os.path.join(dev, name), 0o755)
    try:
        linux.mount("devpts", os.path.join(dev, "pts"), "devpts", linux.MS_NOSUID | linux.MS_NOEXEC,
                    "newinstance,ptmxmode=0666,mode=0620")  # fmt: skip
    except OSError:
        _bind("/dev/pts", os.path.join(dev, "pts"))
    linux.mount("shm", os.path.join(dev, "shm"), "tmpfs", _SAFE_FLAGS | linux.MS_NOEXEC,
                "mode=1777,size=65536k")  # fmt: skip
    for device in devices:
        if not os.path.exists(device.source):
            raise RootfsError(f"device {device.source} of the Allocate response does not exist")
        target = resolve_in_root(root, device.target)
        _make_mount_point(target, directory=False)
        _bind(device.source, target)
        _remount(target, read_only="w" not in device.permissions, extra=linux.MS_NOSUID)


def _bind_mounts(root: str, mounts: list[BindMount]) -> None:
    """Parents before children; read-only remounts last, so a mount point can still be made
    inside a read-only parent's source directory, as the runtime would make it."""
    placed: list[tuple[str, BindMount]] = []
    for mount in sorted(mounts, key=lambda m: len(Path(m.target).parts)):
        if not os.path.exists(mount.source):
            raise RootfsError(f"mount source {mount.source} (for {mount.target}) does not exist")
        target = resolve_in_root(root, mount.target)
        _make_mount_point(target, directory=os.path.isdir(mount.source))
        try:
            _bind(mount.source, target)
        except OSError as exc:
            raise RootfsError(f"cannot bind {mount.source} on {mount.target}: {exc}") from exc
        placed.append((target, mount))
    for target, mount in placed:
        _remount(target, read_only=mount.read_only, extra=_SAFE_FLAGS)


def _pivot(root: str) -> None:
    os.chdir(root)
    linux.pivot_root(".", ".")  # the old root now sits on top of the new one...
    linux.umount2(".", linux.MNT_DETACH)  # ...and goes, with every host mount under it
    os.chdir("/")


def build(spec: ContainerSpec, scratch: str) -> None:
    """Run in the container's own (already unshared) mount namespace, as PID 1 of its PID
    namespace; on return the process's root is the container's, its cwd `spec.cwd` or `/`."""
    linux.mount("none", "/", None, linux.MS_REC | linux.MS_PRIVATE)
    root = _overlay_root(scratch)
    for point in _host_mount_points(scratch):
        target = os.path.join(root, point.lstrip("/"))
        if os.path.lexists(target):
            _bind(point, target)
    _proc(root)
    _sys(root)
    _dev(root, spec.devices)
    _bind_mounts(root, spec.mounts)
    _pivot(root)
    try:
        os.chdir(spec.cwd)
    except OSError:
        os.chdir("/")
