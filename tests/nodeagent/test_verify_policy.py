"""The verifier's rules on given NVML figures: tolerance, confirmation, newest-first kills
(of real processes), and what a hook may and may not claim. Events go over real NATS."""

from __future__ import annotations

import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from services.common import subjects
from services.common.bus import Bus
from services.common.schemas import SliceViolation
from services.nodeagent.containers import ResolvedContainer
from services.nodeagent.gpus.backend import GpuProcess
from services.nodeagent.limits_file import ContainerLimits, DeviceLimit
from services.nodeagent.relay import HookClaims
from services.nodeagent.relay_protocol import Hello, HelloDevice
from services.nodeagent.verify import ComputeCheck, Verifier
from tests.nodeagent.harness import wait_until

GPU = "GPU-0"
KEY = "0123456789abcdef"


def container(limit_mib: int = 1000, overhead: int = 0) -> ResolvedContainer:
    limits = ContainerLimits(
        namespace="ml", pod="train", container="main",
        devices=(DeviceLimit(GPU, limit_mib, 50),), context_overhead_mib=overhead,
    )  # fmt: skip
    return ResolvedContainer(KEY, Path("/nonexistent"), limits, "uid-train")


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def sleepers() -> Iterator[list[subprocess.Popen[bytes]]]:
    """Three real processes started a clock tick apart: oldest first."""
    started = []
    for _ in range(3):
        started.append(subprocess.Popen(["sleep", "60"]))
        time.sleep(0.03)
    yield started
    for proc in started:
        proc.kill()
        proc.wait()


async def events(bus: Bus) -> list[SliceViolation]:
    received: list[SliceViolation] = []

    async def keep(message: SliceViolation) -> None:
        received.append(message)

    await bus.subscribe(subjects.violations("n"), SliceViolation, keep)
    await bus.client.flush()
    return received


def no_hooks(key: str) -> HookClaims | None:
    return None


async def test_tolerance_is_percent_or_per_process_allowance(bus: Bus) -> None:
    verifier = Verifier(node_name="n", bus=bus, tolerance_percent=5.0)
    assert verifier.tolerance(container(1000), 1000, 3) == 50
    # The context overhead the hook charges counts per process when no allowance is set.
    assert verifier.tolerance(container(1000, overhead=300), 1000, 3) == 900
    explicit = Verifier(node_name="n", bus=bus, tolerance_percent=5.0, tolerance_mib=100)
    assert explicit.tolerance(container(1000, overhead=300), 1000, 3) == 300
    with pytest.raises(ValueError, match="on_violation must be report or kill, got 'stop'"):
        Verifier(node_name="n", bus=bus, on_violation="stop")


async def test_a_finding_needs_confirmation_then_is_reported_once(bus: Bus) -> None:
    received = await events(bus)
    clock = Clock()
    verifier = Verifier(node_name="n", bus=bus, confirm_s=1.0, clock=clock)
    over = {KEY: {GPU: [GpuProcess(pid=4242, uuid=GPU, memory_used_mib=1100)]}}
    ok = {KEY: {GPU: [GpuProcess(pid=4242, uuid=GPU, memory_used_mib=1040)]}}  # within 5 %
    assert await verifier.check([container()], ok, no_hooks) == []
    assert await verifier.check([container()], over, no_hooks) == []  # first sample
    clock.now += 0.5
    assert await verifier.check([container()], over, no_hooks) == []  # not long enough yet
    clock.now += 0.6
    (found,) = await verifier.check([container()], over, no_hooks)
    assert (found.kind, found.measured_mib, found.tolerance_mib, found.pids) == (
        "over_limit", 1100, 50, [4242],
    )  # fmt: skip
    clock.now += 1
    assert await verifier.check([container()], over, no_hooks) == []  # standing: not re-sent
    assert verifier.flags(KEY) == {GPU: "over_limit"}
    await verifier.check([container()], ok, no_hooks)
    assert verifier.flags(KEY) == {}
    await wait_until(lambda: received, 10, "the event over NATS")
    assert [v.kind for v in received] == ["over_limit"]


async def test_kill_takes_the_newest_processes_until_the_rest_fit(
    bus: Bus, sleepers: list[subprocess.Popen[bytes]]
) -> None:
    clock = Clock()
    verifier = Verifier(node_name="n", bus=bus, on_violation="kill", confirm_s=0, clock=clock)
    oldest, middle, newest = sleepers
    processes = [
        GpuProcess(pid=oldest.pid, uuid=GPU, memory_used_mib=600),
        GpuProcess(pid=middle.pid, uuid=GPU, memory_used_mib=300),
        GpuProcess(pid=newest.pid, uuid=GPU, memory_used_mib=400),
    ]
    assigned = {KEY: {GPU: processes}}
    await verifier.check([container()], assigned, no_hooks)
    clock.now += 0.1
    (found,) = await verifier.check([container()], assigned, no_hooks)
    # 1300 MiB in a 1000 MiB slice (+50): the newest goes first and 900 MiB then fit.
    assert found.action == "kill" and found.killed_pids == [newest.pid]
    assert newest.wait(timeout=10) == -9
    assert oldest.poll() is None and middle.poll() is None


async def test_what_a_hook_claims_is_checked_against_the_agents_records(bus: Bus) -> None:
    clock = Clock()
    verifier = Verifier(node_name="n", bus=bus, confirm_s=0, clock=clock)
    running = {KEY: {GPU: [GpuProcess(pid=4242, uuid=GPU, memory_used_mib=900)]}}
    honest = Hello(v=1, pid=7, comm="python", devices=[HelloDevice(0, GPU, 1000, 50)])
    fresh = HookClaims(hellos=[(4242, honest)], used_mib={0: 900}, reported_at=clock.now)
    for _ in range(3):
        assert await verifier.check([container()], running, lambda key: fresh) == []
    # A report far below what NVML shows (the region was zeroed) is tampering...
    zeroed = HookClaims(hellos=[(4242, honest)], used_mib={0: 0}, reported_at=clock.now)
    await verifier.check([container()], running, lambda key: zeroed)
    (found,) = await verifier.check([container()], running, lambda key: zeroed)
    assert (found.kind, found.reported_mib, found.measured_mib) == ("tampering", 0, 900)
    # ...but a stale report says nothing either way.
    clock.now += 10
    stale = HookClaims(hellos=[(4242, honest)], used_mib={0: 0}, reported_at=100.0)
    await verifier.check([container()], running, lambda key: stale)
    assert verifier.flags(KEY) == {}
    # A hello with other limits than the agent wrote is tampering at once.
    lying = Hello(v=1, pid=7, comm="python", devices=[HelloDevice(0, GPU, 40960, 100)])
    claims = HookClaims(hellos=[(4242, lying)], used_mib={}, reported_at=0)
    (found,) = await verifier.check([container()], running, lambda key: claims)
    assert found.kind == "tampering" and "40960 MiB and 100% cores" in found.reason
    assert verifier.flags(KEY) == {GPU: "tampering"}


def busy(sm: float, memory_mib: int = 500) -> dict[str, dict[str, list[GpuProcess]]]:
    """The container's two processes on the GPU, taking `sm` percent of it between them."""
    return {KEY: {GPU: [
        GpuProcess(pid=4242, uuid=GPU, memory_used_mib=memory_mib, sm_util_percent=sm / 2),
        GpuProcess(pid=4243, uuid=GPU, memory_used_mib=0, sm_util_percent=sm / 2),
    ]}}  # fmt: skip


@pytest.mark.parametrize(
    ("policy", "own", "gpu_total", "over"),
    [
        ("share", 80.0, 100.0, True),  # 80 % of a GPU others want, on a 50 % share
        ("share", 60.0, 100.0, False),  # within the 10-point tolerance
        ("share", 95.0, 97.0, False),  # nobody else wants the GPU: work conservation
        ("hard", 95.0, 95.0, True),  # hard holds the share even on an idle GPU
        ("off", 100.0, 100.0, False),  # no compute limit to break
    ],
)
async def test_compute_over_the_share_counts_only_while_others_want_the_gpu(
    bus: Bus, policy: str, own: float, gpu_total: float, over: bool
) -> None:
    clock = Clock()
    rule = ComputeCheck(policy=policy, tolerance_percent=10.0, confirm_s=6.0)
    verifier = Verifier(node_name="n", bus=bus, clock=clock, compute=rule)
    found = []
    for _ in range(4):  # 0, 2, 4, 6 s: long enough to confirm
        found += await verifier.check([container()], busy(own), no_hooks, {GPU: gpu_total})
        clock.now += 2.0
    assert [v.kind for v in found] == (["over_compute"] if over else [])
    if over:
        (finding,) = found
        assert (finding.cores_limit, finding.measured_sm_percent, finding.pids) == (
            50, own, [4242, 4243],
        )  # fmt: skip
        assert finding.others_sm_percent == round(gpu_total - own, 2)
        assert f"at {own}% SM, over its cores share of 50% + 10 points" in finding.reason
        assert verifier.flags(KEY) == {GPU: "over_compute"}
    else:
        assert verifier.flags(KEY) == {}


async def test_a_compute_finding_needs_its_own_longer_confirmation_and_ends(bus: Bus) -> None:
    received = await events(bus)
    clock = Clock()
    verifier = Verifier(node_name="n", bus=bus, clock=clock, compute=ComputeCheck(confirm_s=6.0))
    assert await verifier.check([container()], busy(90), no_hooks, {GPU: 100.0}) == []
    clock.now += 4.0  # a handover of the share takes the hook up to ~3 s: not yet a finding
    assert await verifier.check([container()], busy(90), no_hooks, {GPU: 100.0}) == []
    clock.now += 2.5
    (found,) = await verifier.check([container()], busy(90), no_hooks, {GPU: 100.0})
    assert found.kind == "over_compute" and found.action == "report"
    clock.now += 2.0
    assert await verifier.check([container()], busy(90), no_hooks, {GPU: 100.0}) == []
    # Unsampled processes (-1) or an unknown GPU figure judge nothing: the finding ends.
    await verifier.check([container()], busy(-2), no_hooks, {GPU: 100.0})
    assert verifier.flags(KEY) == {}
    # Without GPU figures (an older caller) compute is not judged at all.
    for _ in range(5):
        clock.now += 2.0
        assert await verifier.check([container()], busy(90), no_hooks) == []
    await wait_until(lambda: received, 10, "the event over NATS")
    assert [v.kind for v in received] == ["over_compute"]
