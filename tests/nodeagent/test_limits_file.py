from __future__ import annotations

from pathlib import Path

import pytest

from services.common.schemas import ContainerAllocation, GpuSlice
from services.nodeagent import limits_file
from services.nodeagent.context_overhead import (
    container_overhead,
    overhead_for,
    parse_overheads,
)
from services.nodeagent.limits_file import ContainerLimits, DeviceLimit, LimitsError

A = "GPU-aaaaaaaa-0000-0000-0000-000000000000"
B = "GPU-bbbbbbbb-0000-0000-0000-000000000000"


def decision(*slices: tuple[str, int, int]) -> ContainerAllocation:
    return ContainerAllocation(
        container="main",
        slices=[
            GpuSlice(uuid=u, index=i, memory_mib=m, cores=c) for i, (u, m, c) in enumerate(slices)
        ],
    )


def test_render_exact_format_in_visible_order() -> None:
    limits = limits_file.limits_from_decision(
        "ns", "pod-1", "main", (B, A), decision((A, 10240, 30), (B, 0, 0))
    )
    assert limits_file.render(limits) == (
        "version=1\n"
        "namespace=ns\n"
        "pod=pod-1\n"
        "container=main\n"
        "device_count=2\n"
        f"device.0.uuid={B}\n"
        "device.0.memory_limit_mib=0\n"
        "device.0.cores=0\n"
        f"device.1.uuid={A}\n"
        "device.1.memory_limit_mib=10240\n"
        "device.1.cores=30\n"
    )


def test_decision_must_match_the_exposed_gpus() -> None:
    with pytest.raises(LimitsError, match=f"no slice on \\['{B}'\\]"):
        limits_file.limits_from_decision("ns", "p", "c", (A, B), decision((A, 1, 1)))
    with pytest.raises(LimitsError, match=f"slices on unexposed GPUs \\['{B}'\\]"):
        limits_file.limits_from_decision("ns", "p", "c", (A,), decision((A, 1, 1), (B, 1, 1)))


def test_values_that_would_break_the_format_are_refused() -> None:
    bad = ContainerLimits("ns\nversion=2", "p", "c", (DeviceLimit(A, 1, 1),))
    with pytest.raises(LimitsError, match="namespace"):
        limits_file.render(bad)
    with pytest.raises(LimitsError, match="out of range"):
        limits_file.render(ContainerLimits("ns", "p", "c", (DeviceLimit(A, 1, 101),)))


def test_write_is_atomic_and_leaves_no_temporary_files(tmp_path: Path) -> None:
    limits = ContainerLimits("ns", "p", "c", (DeviceLimit(A, 512, 50),))
    container_dir = tmp_path / "abc"
    path = limits_file.write(container_dir, limits)
    assert path == container_dir / "limits"
    assert path.read_text() == limits_file.render(limits)
    limits_file.write(container_dir, ContainerLimits("ns", "p", "c", (DeviceLimit(A, 1024, 50),)))
    assert "memory_limit_mib=1024" in path.read_text()
    assert sorted(p.name for p in container_dir.iterdir()) == ["limits"]
    assert path.stat().st_mode & 0o777 == 0o644


def test_context_overhead_is_written_only_when_set_and_read_back() -> None:
    plain = ContainerLimits("ns", "p", "c", (DeviceLimit(A, 512, 50),))
    assert "context_overhead" not in limits_file.render(plain)
    charged = ContainerLimits("ns", "p", "c", (DeviceLimit(A, 512, 50),), context_overhead_mib=300)
    text = limits_file.render(charged)
    assert text.endswith("device.0.cores=50\ncontext_overhead_mib=300\n")
    assert limits_file.parse(text) == charged


def test_context_overhead_rules_per_model() -> None:
    rules = parse_overheads(" A100=420, t4=250 ,*=300")
    assert [overhead_for(rules, m) for m in ("A100-80GB", "Tesla T4", "L4")] == [420, 250, 300]
    assert parse_overheads("350") == [("*", 350)] and parse_overheads("") == []
    assert overhead_for(parse_overheads("A100=420"), "T4") == 0
    models = {A: "A100-40GB", B: "Tesla T4"}
    assert container_overhead(rules, models, (A, B)) == 420
    for bad, words in (("A100=lots", "not a whole number"), ("=3", "not MODEL=MiB"),
                       ("T4=99999", "outside 0..16384")):  # fmt: skip
        with pytest.raises(ValueError, match=words):
            parse_overheads(bad)


def test_virtual_memory_is_written_only_when_on_and_read_back() -> None:
    plain = ContainerLimits("ns", "p", "c", (DeviceLimit(A, 512, 50), DeviceLimit(B, 0, 0)))
    assert "virtual_memory" not in limits_file.render(plain)
    assert "spill_limit_mib" not in limits_file.render(plain)
    spilling = limits_file.with_virtual_memory(plain, 8192)
    text = limits_file.render(spilling)
    assert "device.0.virtual_memory=1\n" in text and "device.1.virtual_memory=1\n" in text
    assert text.endswith("spill_limit_mib=8192\n")
    assert limits_file.parse(text) == spilling
    with pytest.raises(LimitsError, match="spill limit"):
        limits_file.render(limits_file.with_virtual_memory(plain, -1))
