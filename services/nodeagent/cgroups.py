"""Which pod and container a host process belongs to, from its /proc/<pid>/cgroup.

Shapes seen on Kubernetes nodes (cgroup v1 lines are `<id>:<controllers>:<path>`, v2 is
`0::<path>`; the same path shapes appear in both):

- systemd driver: `/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod<uid>.slice/`
  then `cri-containerd-<id>.scope` (containerd), `crio-<id>.scope` (CRI-O) or
  `docker-<id>.scope`; the pod UID's dashes are written as underscores.
- cgroupfs driver: `/kubepods/burstable/pod<uid>/<id>` (guaranteed pods sit right under
  `/kubepods`).
- Inside a cgroup namespace the path starts with `/..` segments; only the pattern matters.

CRI-O's `crio-conmon-<id>.scope` is the monitor process, not the container.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

_POD = re.compile(
    r"pod([0-9a-fA-F]{8}[-_][0-9a-fA-F]{4}[-_][0-9a-fA-F]{4}[-_][0-9a-fA-F]{4}[-_][0-9a-fA-F]{12})"
)
_SCOPE = re.compile(r"^(?:cri-containerd|crio|docker|containerd)-([0-9a-f]{12,64})\.scope$")
_BARE_ID = re.compile(r"^([0-9a-f]{64})$")


@dataclass(frozen=True)
class CgroupIdentity:
    pod_uid: str  # with dashes, as the API server writes it
    container_id: str  # the runtime's container ID; "" when the process sits in the pod cgroup


def parse_cgroup_path(path: str) -> CgroupIdentity | None:
    """The pod and container of one cgroup path, or None when it is not a pod's."""
    if "kubepods" not in path:
        return None
    pod_uid = ""
    container_id = ""
    for segment in path.split("/"):
        found = _POD.search(segment)
        if found and (segment.startswith("pod") or segment.startswith("kubepods")):
            pod_uid = found.group(1).replace("_", "-").lower()
            continue
        if not pod_uid:
            continue
        if segment.startswith("crio-conmon-"):
            return None
        scope = _SCOPE.match(segment) or _BARE_ID.match(segment)
        if scope:
            container_id = scope.group(1)
    if not pod_uid:
        return None
    return CgroupIdentity(pod_uid=pod_uid, container_id=container_id)


def parse_cgroup_file(text: str) -> CgroupIdentity | None:
    """The contents of /proc/<pid>/cgroup (v1 or v2). The most specific answer wins: one
    that names a container over one that names only the pod."""
    best: CgroupIdentity | None = None
    for line in text.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        identity = parse_cgroup_path(parts[2].strip())
        if identity is None:
            continue
        if best is None or (identity.container_id and not best.container_id):
            best = identity
    return best


def identity_of_pid(pid: int, proc_root: Path) -> CgroupIdentity | None:
    """None when the process is gone, unreadable, or not in a pod."""
    try:
        text = (proc_root / str(pid) / "cgroup").read_text()
    except OSError:
        return None
    return parse_cgroup_file(text)
