"""Host PID -> pod and container, from real-looking /proc/<pid>/cgroup contents."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.nodeagent.cgroups import CgroupIdentity, identity_of_pid, parse_cgroup_file
from services.nodeagent.containers import ResolvedContainer
from services.nodeagent.gpus import GpuProcess
from services.nodeagent.limits_file import ContainerLimits, DeviceLimit
from services.nodeagent.process_map import ProcessAttributor

UID = "1f2e3d4c-5b6a-4789-8abc-def012345678"
SYSTEMD_UID = UID.replace("-", "_")
CID = "3f1a9c0e7b6d5a4f3e2d1c0b9a8f7e6d5c4b3a2f1e0d9c8b7a6f5e4d3c2b1a0f"


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        # cgroup v2, systemd driver, containerd
        (
            "0::/kubepods.slice/kubepods-burstable.slice/"
            f"kubepods-burstable-pod{SYSTEMD_UID}.slice/cri-containerd-{CID}.scope\n",
            CgroupIdentity(UID, CID),
        ),
        # cgroup v2, systemd driver, guaranteed QoS (no QoS slice), CRI-O
        (
            f"0::/kubepods.slice/kubepods-pod{SYSTEMD_UID}.slice/crio-{CID}.scope\n",
            CgroupIdentity(UID, CID),
        ),
        # cgroup v2 inside a cgroup namespace
        (
            f"0::/../../kubepods-besteffort-pod{SYSTEMD_UID}.slice/cri-containerd-{CID}.scope\n",
            CgroupIdentity(UID, CID),
        ),
        # cgroup v1, cgroupfs driver (docker-era and containerd): many controllers
        (
            "12:hugetlb:/kubepods/besteffort/pod" + UID + "/" + CID + "\n"
            "11:memory:/kubepods/besteffort/pod" + UID + "/" + CID + "\n"
            "1:name=systemd:/kubepods/besteffort/pod" + UID + "/" + CID + "\n",
            CgroupIdentity(UID, CID),
        ),
        # cgroup v1, systemd driver, CRI-O, guaranteed pod
        (
            f"10:devices:/kubepods.slice/kubepods-pod{SYSTEMD_UID}.slice/crio-{CID}.scope\n"
            "9:cpuset:/\n",
            CgroupIdentity(UID, CID),
        ),
        # docker with the systemd driver
        (
            "0::/kubepods.slice/kubepods-burstable.slice/"
            f"kubepods-burstable-pod{SYSTEMD_UID}.slice/docker-{CID}.scope\n",
            CgroupIdentity(UID, CID),
        ),
        # a process in the pod's cgroup itself (the pause sandbox on some runtimes)
        (f"0::/kubepods/burstable/pod{UID}\n", CgroupIdentity(UID, "")),
        # CRI-O's conmon monitor is not a container process
        (f"0::/kubepods.slice/kubepods-pod{SYSTEMD_UID}.slice/crio-conmon-{CID}.scope\n", None),
        # host processes
        ("0::/system.slice/containerd.service\n", None),
        ("0::/user.slice/user-1000.slice/session-3.scope\n", None),
        ("", None),
    ],
)
def test_parse_cgroup_file(text: str, expected: CgroupIdentity | None) -> None:
    assert parse_cgroup_file(text) == expected


def test_mixed_v1_lines_prefer_the_one_naming_a_container() -> None:
    text = f"5:cpu:/kubepods/pod{UID}\n4:memory:/kubepods/pod{UID}/{CID}\n"
    assert parse_cgroup_file(text) == CgroupIdentity(UID, CID)


def test_identity_of_a_gone_process(tmp_path: Path) -> None:
    assert identity_of_pid(123, tmp_path) is None


def container(key: str, pod_uid: str, uuids: tuple[str, ...]) -> ResolvedContainer:
    limits = ContainerLimits("ns", f"pod-{key}", "main", tuple(DeviceLimit(u, 0, 0) for u in uuids))
    return ResolvedContainer(key, Path("/nonexistent") / key, limits, pod_uid)


def test_attribution_order(tmp_path: Path) -> None:
    def cgroup(pid: int, uid: str, cid: str) -> None:
        (tmp_path / str(pid)).mkdir()
        (tmp_path / str(pid) / "cgroup").write_text(
            f"0::/kubepods.slice/kubepods-pod{uid.replace('-', '_')}.slice/"
            f"cri-containerd-{cid}.scope\n"
        )

    other_uid = "aaaaaaaa-5b6a-4789-8abc-def012345678"
    sibling = "b" * 64
    cgroup(10, UID, CID)  # the relay peer
    cgroup(11, UID, CID)  # its child, same container
    cgroup(12, other_uid, sibling)  # a pod with one container on GPU-1
    cgroup(13, UID, "c" * 64)  # pod UID has two containers on GPU-1: ambiguous
    mine = container("k1", UID, ("GPU-1",))
    twin = container("k2", UID, ("GPU-1",))
    theirs = container("k3", other_uid, ("GPU-1",))
    attributor = ProcessAttributor(tmp_path)
    attributor.learn(10, "k1")
    processes = [
        GpuProcess(10, "GPU-1", 100, 10.0),
        GpuProcess(11, "GPU-1", 50, 5.0),
        GpuProcess(12, "GPU-1", 70, -1.0),
        GpuProcess(13, "GPU-1", 30, 1.0),
        GpuProcess(99, "GPU-1", 30, 1.0),  # gone
    ]
    figures = attributor.attribute(processes, {10: "k1"}, [mine, twin, theirs])
    assert set(figures) == {"k1", "k3"}
    k1 = figures["k1"]["GPU-1"]
    assert (k1.memory_used_mib, k1.sm_util_percent, k1.pids) == (150, 15.0, 2)
    k3 = figures["k3"]["GPU-1"]
    assert (k3.memory_used_mib, k3.sm_util_percent, k3.pids) == (70, -1.0, 1)
    attributor.forget("k1")
    assert "k1" not in attributor.attribute(processes[1:2], {}, [mine, twin, theirs])
