from __future__ import annotations

import pytest

from services.nodeagent.gpus import GpuProcess, HealthEvent, NvmlInitError, backend_for
from services.nodeagent.gpus.simulated import (
    MODELS,
    SimulatedGpuBackend,
    parse_spec,
    simulated_uuid,
)


def test_parse_single_and_mixed_specs() -> None:
    assert [m.name for m in parse_spec("4xA100-40GB")] == ["A100-40GB"] * 4
    mixed = parse_spec("2xA100-40GB, 1xt4")
    assert [(m.name, m.memory_mib, m.sm_count) for m in mixed] == [
        ("A100-40GB", 40960, 108),
        ("A100-40GB", 40960, 108),
        ("T4", 15360, 40),
    ]


def test_model_table() -> None:
    table = {m.name: (m.memory_mib, m.sm_count) for m in MODELS.values()}
    assert table == {
        "A100-40GB": (40960, 108),
        "A100-80GB": (81920, 108),
        "H100-80GB": (81559, 132),
        "H200": (143771, 132),
        "V100-16GB": (16160, 80),
        "V100-32GB": (32510, 80),
        "T4": (15360, 40),
        "A10": (22731, 72),
        "L4": (23034, 58),
    }


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("3xFOO", "bad GPU spec part '3xFOO': unknown model 'FOO'"),
        ("0xA100-40GB", "bad GPU spec part '0xA100-40GB': count must be at least 1"),
        ("abc", "bad GPU spec part 'abc': expected <count>x<model>"),
        ("2xA100-40GB,,1xT4", "bad GPU spec part '': expected <count>x<model>"),
        ("-1xT4", "bad GPU spec part '-1xT4'"),
        ("", "empty GPU spec"),
    ],
)
def test_bad_specs_name_the_bad_part(spec: str, message: str) -> None:
    with pytest.raises(ValueError) as caught:
        parse_spec(spec)
    assert message in str(caught.value)


def test_uuids_are_stable_per_node_and_index() -> None:
    first = SimulatedGpuBackend("node-a", "2xT4").devices()
    again = SimulatedGpuBackend("node-a", "2xT4").devices()
    other = SimulatedGpuBackend("node-b", "2xT4").devices()
    assert [g.uuid for g in first] == [g.uuid for g in again]
    assert {g.uuid for g in first}.isdisjoint(g.uuid for g in other)
    assert first[1].uuid == simulated_uuid("node-a", 1)
    assert first[0].uuid.startswith("GPU-") and len(first[0].uuid) == 40


@pytest.mark.parametrize(
    ("spec", "numa"),
    [("1xT4", [0]), ("3xT4", [0, 0, 1]), ("4xA100-40GB", [0, 0, 1, 1]), ("2xT4", [0, 1])],
)
def test_numa_node_is_index_times_two_over_count(spec: str, numa: list[int]) -> None:
    devices = SimulatedGpuBackend("n", spec).devices()
    assert [g.numa_node for g in devices] == numa
    assert [g.index for g in devices] == list(range(len(numa)))
    assert all(g.healthy for g in devices)


def test_usage_is_deterministic_smooth_and_bounded() -> None:
    now = [1000.0]
    backend = SimulatedGpuBackend("n", "2xA100-40GB", clock=lambda: now[0])
    first = backend.usage()
    assert first == backend.usage()  # same clock, same numbers
    assert first[0] != first[1]  # GPUs are phase-shifted
    now[0] += 1.0
    later = backend.usage()
    for before, after in zip(first, later, strict=True):
        assert abs(before.sm_util_percent - after.sm_util_percent) < 5  # smooth
        assert 10 <= after.sm_util_percent <= 90
        assert 0.2 * 40960 <= after.memory_used_mib <= 0.6 * 40960


def test_health_can_be_changed_and_unknown_uuid_is_refused() -> None:
    backend = SimulatedGpuBackend("n", "2xT4")
    gpu = backend.devices()[1]
    backend.set_healthy(gpu.uuid, False)
    assert [g.healthy for g in backend.devices()] == [True, False]
    with pytest.raises(ValueError, match="no simulated GPU with uuid 'GPU-nope'"):
        backend.set_healthy("GPU-nope", False)


def test_no_spec_on_a_machine_without_nvml_is_a_clear_error() -> None:
    with pytest.raises(NvmlInitError, match="cannot start NVML"):
        backend_for("n", "")


def test_faults_and_pinned_usage() -> None:
    backend = SimulatedGpuBackend("node-a", "2xT4")
    a, b = (g.uuid for g in backend.devices())
    assert backend.wait_for_health_event(0.01) is None
    backend.inject_xid(b, 79)
    assert backend.wait_for_health_event(1) == HealthEvent(uuid=b, xid=79)
    backend.set_usage(a, 12.5, 1000)
    backend.add_process(77, a, 512, 10.0)
    assert next((u.uuid, u.sm_util_percent, u.memory_used_mib) for u in backend.usage()) == (
        a, 12.5, 1000,
    )  # fmt: skip
    assert backend.processes() == [GpuProcess(77, a, 512, 10.0)]
    backend.remove_gpu(a)
    assert [g.healthy for g in backend.devices()] == [False, True]
    assert [u.uuid for u in backend.usage()] == [b]
    assert backend.processes() == []
    assert backend.cuda_version() and backend.driver_version().endswith("-sim")
    with pytest.raises(ValueError, match="no simulated GPU"):
        backend.inject_xid("GPU-nope", 79)


def test_inline_models() -> None:
    (model,) = parse_spec("1xRTX-6000:49152:142")
    assert (model.name, model.memory_mib, model.sm_count) == ("RTX-6000", 49152, 142)
    with pytest.raises(ValueError, match="or give <name>:<memory MiB>:<SMs>"):
        parse_spec("1xRTX-6000")
