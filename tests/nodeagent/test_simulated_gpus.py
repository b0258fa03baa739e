from __future__ import annotations

import dataclasses

import pytest

from services.common.schemas import GpuUsage
from services.nodeagent.gpus import (
    GpuProcess,
    HealthEvent,
    NvmlGpuBackend,
    NvmlInitError,
    backend_for,
)
from services.nodeagent.gpus.backend import LoadSink
from services.nodeagent.gpus.simulated import (
    FAKE_PID_BASE,
    MODELS,
    USAGE_PERIOD_S,
    SimulatedGpuBackend,
    parse_spec,
    simulated_pid,
    simulated_uuid,
    slice_load,
)

CARD_MIB = 40960  # A100-40GB
# Pinned clock values spread over more than one period of the synthetic wave.
CLOCKS = [0.0, 7.5, 29.0, 45.0, 61.3, 90.0, 118.0, 1000.0, 1_700_000_000.0]


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


class Clock:
    def __init__(self, now: float = 0.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def two_a100s(clock: Clock) -> tuple[SimulatedGpuBackend, str, str]:
    backend = SimulatedGpuBackend("n", "2xA100-40GB", clock=clock)
    a, b = (g.uuid for g in backend.devices())
    return backend, a, b


def idle(gpu: str) -> GpuUsage:
    return GpuUsage(uuid=gpu, memory_used_mib=0, sm_util_percent=0.0, memory_util_percent=0.0)


def test_idle_gpus_report_zero_at_any_time() -> None:
    clock = Clock()
    backend, a, b = two_a100s(clock)
    for clock.now in CLOCKS:
        assert backend.usage() == [idle(a), idle(b)]
        assert backend.processes() == []


def test_simulated_gpus_are_a_load_sink_and_nvml_is_not() -> None:
    assert isinstance(SimulatedGpuBackend("n", "1xT4"), LoadSink)
    assert not issubclass(NvmlGpuBackend, LoadSink)


def test_a_half_gpu_slice_stays_inside_its_limits_and_moves_smoothly() -> None:
    clock = Clock()
    backend, a, b = two_a100s(clock)
    backend.attach("0123456789abcdef", a, 20480, 50)
    seen: set[tuple[int, float]] = set()
    for clock.now in CLOCKS:
        gpu, other = backend.usage()
        assert other == idle(b)
        assert 0.5 * 20480 <= gpu.memory_used_mib <= 0.9 * 20480
        assert 0 < gpu.sm_util_percent <= 50
        assert 0 < gpu.memory_util_percent <= 100
        assert backend.usage() == [gpu, other]  # same clock, same figures
        assert backend.processes() == [
            GpuProcess(
                simulated_pid("0123456789abcdef"), a, gpu.memory_used_mib, gpu.sm_util_percent
            )
        ]
        seen.add((gpu.memory_used_mib, gpu.sm_util_percent))
        before = gpu
        clock.now += 1.0
        (after, _) = backend.usage()
        assert abs(after.sm_util_percent - before.sm_util_percent) < 5  # smooth
        assert abs(after.memory_used_mib - before.memory_used_mib) < 0.05 * 20480
    assert len(seen) > len(CLOCKS) // 2  # it moves


def test_a_slice_covers_its_whole_range_over_a_period() -> None:
    figures = [slice_load("k", 20480, 50, t * USAGE_PERIOD_S / 240) for t in range(240)]
    memory = [f.memory_used_mib for f in figures]
    sm = [f.sm_util_percent for f in figures]
    assert min(memory) == 10240 and max(memory) == 18432  # 50 % .. 90 % of the slice
    assert min(sm) >= 12.5 and max(sm) == 50.0 and min(sm) < 13  # up to its cores


def test_whole_gpu_slices_load_the_card_and_are_uncapped() -> None:
    clock = Clock()
    backend, a, _ = two_a100s(clock)
    backend.attach("whole", a, 0, 0)  # 0 = the whole card, no compute limit
    sms = []
    for clock.now in CLOCKS:
        gpu = backend.usage()[0]
        assert 0.5 * CARD_MIB <= gpu.memory_used_mib <= 0.9 * CARD_MIB
        assert 0 < gpu.sm_util_percent <= 100
        sms.append(gpu.sm_util_percent)
    assert max(sms) > 50  # more than any capped half slice could show


def test_containers_keyed_differently_run_different_waves() -> None:
    at = [slice_load(key, 20480, 50, 10.0) for key in ("aaaaaaaaaaaaaaaa", "bbbbbbbbbbbbbbbb")]
    assert at[0] != at[1]
    assert slice_load("aaaaaaaaaaaaaaaa", 20480, 50, 10.0) == at[0]  # deterministic


def test_two_slices_on_one_gpu_add_up() -> None:
    clock = Clock()
    backend, a, b = two_a100s(clock)
    backend.attach("left", a, 4096, 20)
    backend.attach("right", a, 8192, 30)
    for clock.now in CLOCKS:
        gpu, other = backend.usage()
        left = slice_load("left", 4096, 20, clock.now)
        right = slice_load("right", 8192, 30, clock.now)
        assert gpu.memory_used_mib == left.memory_used_mib + right.memory_used_mib
        assert gpu.sm_util_percent == pytest.approx(left.sm_util_percent + right.sm_util_percent)
        assert 0.5 * 12288 <= gpu.memory_used_mib <= 0.9 * 12288
        assert gpu.sm_util_percent <= 50
        assert other == idle(b)
        assert sorted(p.memory_used_mib for p in backend.processes()) == sorted(
            [left.memory_used_mib, right.memory_used_mib]
        )


def test_the_sum_is_clamped_at_the_card() -> None:
    """Three uncapped 30 GiB slices on a 40 GiB card (over-committed) never exceed it."""
    clock = Clock()
    backend, a, _ = two_a100s(clock)
    for key in ("one", "two", "three"):
        backend.attach(key, a, 30720, 0)
    for clock.now in CLOCKS:
        gpu = backend.usage()[0]
        assert gpu.memory_used_mib == CARD_MIB  # three slices use at least 46080 MiB
        assert gpu.sm_util_percent == 100.0  # three uncapped slices at 25 % or more each
        assert gpu.memory_util_percent <= 100.0
        assert len(backend.processes()) == 3


def test_detach_returns_the_gpu_to_zero() -> None:
    clock = Clock(42.0)
    backend, a, b = two_a100s(clock)
    backend.attach("multi", a, 10240, 30)
    backend.attach("multi", b, 10240, 30)  # one container on both GPUs: one PID on each
    backend.attach("other", b, 4096, 10)
    assert [p.pid for p in backend.processes() if p.uuid in (a, b)].count(
        simulated_pid("multi")
    ) == 2
    backend.detach("multi")
    gpu_a, gpu_b = backend.usage()
    assert gpu_a == idle(a)
    assert gpu_b.memory_used_mib == slice_load("other", 4096, 10, 42.0).memory_used_mib
    backend.detach("other")
    backend.detach("never-attached")  # no-op
    assert backend.usage() == [idle(a), idle(b)]
    assert backend.processes() == []


def test_attach_replaces_and_refuses_bad_slices() -> None:
    clock = Clock(5.0)
    backend, a, b = two_a100s(clock)
    backend.attach("k", a, 20480, 50)
    backend.attach("k", a, 4096, 10)  # the same container on the same GPU: replaced
    assert backend.usage()[0] == GpuUsage(
        uuid=a, **dataclasses.asdict(slice_load("k", 4096, 10, 5.0))
    )
    backend.attach("big", b, 10**9, 500)  # beyond the card and 100 %: the whole card
    assert backend.usage()[1] == GpuUsage(
        uuid=b, **dataclasses.asdict(slice_load("big", CARD_MIB, 100, 5.0))
    )
    with pytest.raises(ValueError, match="no simulated GPU with uuid 'GPU-nope'"):
        backend.attach("k", "GPU-nope", 1024, 10)
    with pytest.raises(ValueError, match="must not be negative"):
        backend.attach("k", a, -1, 10)


def test_pinned_and_removed_gpus_hide_their_synthetic_load() -> None:
    clock = Clock(3.0)
    backend, a, b = two_a100s(clock)
    backend.attach("k", a, 20480, 50)
    backend.attach("j", b, 20480, 50)
    backend.set_usage(a, 12.5, 1000)
    backend.remove_gpu(b)
    assert backend.usage() == [GpuUsage(uuid=a, memory_used_mib=1000, sm_util_percent=12.5)]
    assert backend.processes() == []


def test_fake_pids_are_stable_and_never_real() -> None:
    assert simulated_pid("0123456789abcdef") == simulated_pid("0123456789abcdef")
    assert simulated_pid("0123456789abcdef") != simulated_pid("fedcba9876543210")
    pids = [simulated_pid(f"{n:016x}") for n in range(1000)]
    assert all(FAKE_PID_BASE <= pid < 2**31 for pid in pids)
    assert FAKE_PID_BASE == 2**22  # Linux's PID_MAX_LIMIT: no real PID reaches it


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
