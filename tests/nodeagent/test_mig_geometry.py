"""MIG geometry (services/common/mig.py) and MIG on simulated GPUs (NVML's calls and rules)."""

from __future__ import annotations

import pytest

from services.common import mig
from services.nodeagent.gpus import backend_for
from services.nodeagent.gpus.backend import MigControl
from services.nodeagent.gpus.sim_mig import MigError, parse_geometry
from services.nodeagent.gpus.simulated import SimulatedGpuBackend
from services.nodeagent.health import HealthMarks


def placed(*gis: tuple[str, int, int]) -> list[mig.PlacedGi]:
    return [mig.PlacedGi(name, mig.Placement(start, size)) for name, start, size in gis]


def test_profile_tables_match_nvidias_names_ids_and_placements() -> None:
    a100 = {p.name: (p.profile_id, p.slices, p.memory_slices, p.max_count, p.starts)
            for p in mig.profiles_for("A100-40GB")}  # fmt: skip
    assert a100 == {
        "1g.5gb": (19, 1, 1, 7, (0, 1, 2, 3, 4, 5, 6)),
        "1g.5gb+me": (20, 1, 1, 1, (0, 1, 2, 3, 4, 5, 6)),
        "1g.10gb": (15, 1, 2, 4, (0, 2, 4, 6)),
        "2g.10gb": (14, 2, 2, 3, (0, 2, 4)),
        "3g.20gb": (9, 3, 4, 2, (0, 4)),
        "4g.20gb": (5, 4, 4, 1, (0,)),
        "7g.40gb": (0, 7, 8, 1, (0,)),
    }
    assert [p.name for p in mig.profiles_for("a100-80gb")] == [
        "1g.10gb", "1g.10gb+me", "1g.20gb", "2g.20gb", "3g.40gb", "4g.40gb", "7g.80gb",
    ]  # fmt: skip
    h100 = {p.name: p.memory_mib for p in mig.profiles_for("H100-80GB")}
    assert h100["1g.10gb"] == 9984 and h100["3g.40gb"] == 40448 and h100["7g.80gb"] == 81152
    assert mig.profiles_for("T4") == ()
    assert mig.resource_name("1g.5gb") == "nvidia.com/mig-1g.5gb"
    assert mig.resource_name("1g.5gb+me") == "nvidia.com/mig-1g.5gb.me"


def test_compute_instance_sizes_follow_nvml() -> None:
    sizes = {p.name: mig.compute_instance_sizes(p) for p in mig.profiles_for("A100-40GB")}
    assert sizes["1g.5gb"] == {1: 1}
    assert sizes["2g.10gb"] == {1: 2, 2: 1}
    assert sizes["3g.20gb"] == {1: 3, 2: 1, 3: 1}
    assert sizes["4g.20gb"] == {1: 4, 2: 2, 4: 1}
    assert sizes["7g.40gb"] == {1: 7, 2: 3, 3: 2, 4: 1, 7: 1}


def test_free_starts_respect_overlap_and_max_count() -> None:
    three = mig.profile_named("A100-40GB", "3g.20gb")
    one = mig.profile_named("A100-40GB", "1g.5gb")
    assert mig.free_starts(three, []) == [0, 4]
    assert mig.free_starts(three, placed(("1g.5gb", 5, 1))) == [0]
    assert mig.free_starts(one, placed(("3g.20gb", 0, 4))) == [4, 5, 6]
    full = placed(*[("1g.5gb", s, 1) for s in range(7)])
    assert mig.free_starts(one, full) == []
    # 7 x 1g.5gb reached its max even though slice 7 is free of GIs.
    assert mig.free_starts(mig.profile_named("A100-40GB", "1g.10gb"), full) == []
    with pytest.raises(ValueError, match=r"overlaps the 1g.5gb at 5-5"):
        mig.check_placement(three, 4, placed(("1g.5gb", 5, 1)))
    with pytest.raises(
        ValueError, match=r"cannot start at memory slice 2 \(allowed starts: 0, 4\)"
    ):
        mig.check_placement(three, 2, [])
    with pytest.raises(ValueError, match=r"has no MIG profile '2g.5gb'"):
        mig.profile_named("A100-40GB", "2g.5gb")
    with pytest.raises(ValueError, match="T4 does not support MIG"):
        mig.profile_named("T4", "1g.5gb")


def test_choice_of_start_keeps_room_and_smallest_profile_fits() -> None:
    one = mig.profile_named("A100-40GB", "1g.5gb")
    # A lone 1g goes to the top, leaving both 3g.20gb/4g.20gb halves usable.
    assert mig.choose_start("A100-40GB", one, []) == 6
    assert mig.smallest_fitting("A100-40GB", 4000, []) == (one, 6)
    found = mig.smallest_fitting("A100-40GB", 12000, [])
    assert found is not None and found[0].name == "3g.20gb"
    assert mig.smallest_fitting("A100-40GB", 50000, []) is None
    assert (
        mig.smallest_fitting("A100-40GB", 20000, placed(("3g.20gb", 0, 4), ("3g.20gb", 4, 4)))
        is None
    )
    found = mig.smallest_fitting("H100-80GB", 15000, [])
    assert found is not None and found[0].name == "1g.20gb"


def test_geometry_spec() -> None:
    assert parse_geometry("0:3g.20gb,2x2g.10gb;1+2:7x1g.5gb", 3) == {
        0: ["3g.20gb", "2g.10gb", "2g.10gb"],
        1: ["1g.5gb"] * 7,
        2: ["1g.5gb"] * 7,
    }
    assert parse_geometry("all:", 2) == {0: [], 1: []}
    for spec, message in [
        ("0=1g.5gb", "expected <gpus>:<profiles>"),
        ("x:1g.5gb", "'x' is not 'all' or GPU indices"),
        ("3:1g.5gb", "no GPU 3 \\(the node has 2\\)"),
    ]:
        with pytest.raises(ValueError, match=message):
            parse_geometry(spec, 2)
    with pytest.raises(ValueError, match=r"MIG geometry of GPU 0: no room for a 1g.5gb"):
        SimulatedGpuBackend("n", "1xA100-40GB", mig_geometry="0:8x1g.5gb")
    with pytest.raises(ValueError, match=r"GPU 0: T4 .* does not support MIG"):
        SimulatedGpuBackend("n", "1xT4", mig_geometry="all:")


def test_simulated_nvml_mig_calls_and_rules() -> None:
    backend = backend_for("node-a", "1xA100-40GB,1xT4")
    assert isinstance(backend, MigControl) and isinstance(backend, SimulatedGpuBackend)
    a100, t4 = (gpu.uuid for gpu in backend.devices())
    with pytest.raises(MigError, match="MIG mode is off") as refused:
        backend.create_gpu_instance(a100, "1g.5gb")
    assert refused.value.code == "invalid_argument"
    with pytest.raises(MigError, match="does not support MIG"):
        backend.set_mig_mode(t4, True)
    backend.set_mig_mode(a100, True)
    assert backend.devices()[0].mig_mode and backend.devices()[0].mig_devices == []
    gi = backend.create_gpu_instance(a100, "3g.20gb", 4)
    with pytest.raises(MigError, match=r"overlaps the 3g.20gb at 4-7") as refused:
        backend.create_gpu_instance(a100, "1g.5gb", 5)
    assert refused.value.code == "insufficient_resources"
    ci = backend.create_compute_instance(a100, gi)
    devices = backend.mig_devices(a100)
    assert len(devices) == 1
    device = devices[0]
    assert device.uuid.startswith("MIG-") and len(device.uuid) == 40
    assert (device.profile, device.gi_id, device.ci_id, device.start, device.size) == (
        "3g.20gb", gi, ci, 4, 4,
    )  # fmt: skip
    assert (device.memory_mib, device.sm_count) == (19968, 108 * 3 // 7)
    # Partial compute instances are MIG devices named <C>c.<gi profile>.
    small = backend.create_gpu_instance(a100, "4g.20gb", 0)
    first = backend.create_compute_instance(a100, small, 2)
    backend.create_compute_instance(a100, small, 2)
    with pytest.raises(MigError, match="0 free compute slice"):
        backend.create_compute_instance(a100, small, 1)
    assert [d.profile for d in backend.mig_devices(a100)] == ["3g.20gb", "2c.4g.20gb", "2c.4g.20gb"]
    with pytest.raises(MigError, match="still has compute instances") as refused:
        backend.destroy_gpu_instance(a100, small)
    assert refused.value.code == "in_use"
    with pytest.raises(MigError, match="GPU instance\\(s\\) remain"):
        backend.set_mig_mode(a100, False)
    backend.destroy_compute_instance(a100, small, first)
    backend.destroy_compute_instance(a100, small, first + 1)
    backend.destroy_gpu_instance(a100, small)
    backend.destroy_compute_instance(a100, gi, ci)
    backend.destroy_gpu_instance(a100, gi)
    # A re-created instance is a new MIG device with a new UUID.
    again = backend.create_gpu_instance(a100, "3g.20gb", 4)
    backend.create_compute_instance(a100, again)
    assert backend.mig_devices(a100)[0].uuid != device.uuid
    with pytest.raises(MigError, match="no GPU instance 9"):
        backend.destroy_gpu_instance(a100, 9)


def test_health_is_per_mig_device() -> None:
    backend = SimulatedGpuBackend("node-a", "1xA100-40GB", mig_geometry="all:2x3g.20gb")
    first, second = backend.mig_devices(backend.devices()[0].uuid)
    marks = HealthMarks()
    assert marks.mark(first.uuid)
    marked = marks.apply(backend.devices())[0]
    assert marked.healthy
    assert [d.healthy for d in marked.mig_devices] == [False, True]
    backend.set_healthy(second.uuid, False)
    assert [d.healthy for d in backend.mig_devices(marked.uuid)] == [True, False]
    backend.inject_xid(first.uuid, 79)
    event = backend.wait_for_health_event(1.0)
    assert event is not None and event.uuid == first.uuid
    with pytest.raises(ValueError, match="no simulated MIG device"):
        backend.inject_xid("MIG-00000000-0000-0000-0000-000000000000", 79)
