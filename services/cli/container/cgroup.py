"""The container's cgroup, named as the kubelet's cgroupfs driver names it, so the node agent
attributes its processes to the pod (services/nodeagent/cgroups.py) even when they never
speak to the hook's relay. Accounting only: no controller limits are set.
"""

from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path


def pod_cgroup(pod_uid: str, container_id: str) -> str:
    """Relative to the hierarchy's root, as the kubelet lays out a BestEffort pod."""
    return f"kubepods/besteffort/pod{pod_uid}/{container_id}"


def hierarchy() -> str | None:
    """The cgroup v2 mount, else cgroup v1's named systemd hierarchy; None without either."""
    named = None
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        before, _, after = line.partition(" - ")
        fstype, _, options = after.split(" ", 2)
        point = before.split()[4]
        if fstype == "cgroup2":
            return point
        if fstype == "cgroup" and "name=systemd" in options.split(","):
            named = point
    return named


def join(relative: str) -> str | None:
    """Move the calling process into the cgroup (created if needed); its path, or None when
    this machine offers no writable hierarchy (then the agent matches by relay peers only)."""
    root = hierarchy()
    if root is None:
        return None
    path = os.path.join(root, relative)
    try:
        os.makedirs(path, exist_ok=True)
        Path(path, "cgroup.procs").write_text("0")
    except OSError:
        return None
    return path


def remove(path: str, levels: int = 2) -> None:
    """Remove the container's cgroup once its processes are gone, then its empty parents
    (the pod's, its QoS class's) up to `levels` up; one still in use stays."""
    for _ in range(50):  # the namespace's last processes may still be exiting
        try:
            os.rmdir(path)
            break
        except FileNotFoundError:
            break
        except OSError:
            time.sleep(0.02)
    for _ in range(levels):
        path = os.path.dirname(path)
        with contextlib.suppress(OSError):
            os.rmdir(path)
