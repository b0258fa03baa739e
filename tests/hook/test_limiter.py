"""The compute limiter in simulation: kernels of every process run one after another on the
simulated GPU (sim/sim_exec.c), so without the limiter two busy containers split it half and
half. Shares are the simulated GPU's busy time (launch_load's kernels' GPU time over its wall
time), not launch rates: a loaded machine that runs the launching loops late does not enter
them as long as the launch queue keeps the GPU fed. Figures are printed (pytest -s shows them);
bounds are generous where only the machine's load can move a figure (a starved process uses
less than its share, never more) and tight (5 points) above each share."""

from __future__ import annotations

import re
import statistics
import subprocess
from pathlib import Path

import pytest

from tests.hook.harness import hook_env, limits_text, run, summary, tool, write_limits

SECONDS = 1.0
GRID = 1000  # blocks: 1 ms of simulated GPU time per kernel
QUEUE_US = "50000"  # 50 ms of launches queued per stream: a late launcher keeps the GPU fed
SHORT, LONG = "100", "20000"  # 0.1 ms and 20 ms kernels


def figures(out: str) -> dict[str, float]:
    return {k: float(v) for k, v in re.findall(r"(\w+)=([\d.]+)", out.strip().splitlines()[-1])}


def load(container_dir: Path, *args: object, hook: bool = True, **extra: str) -> dict[str, float]:
    proc = run(
        [tool("launch_load"), str(SECONDS), str(GRID), *map(str, args)],
        container_dir,
        hook=hook,
        VGPU_HOOK_QUIET="1",
        **extra,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return figures(proc.stdout)


@pytest.fixture(scope="module")
def full_rate(build: Path, tmp_path_factory: pytest.TempPathFactory) -> float:
    """Launches per second of an unlimited process alone on a simulated GPU."""
    return load(tmp_path_factory.mktemp("free"), hook=False)["per_second"]


def container(root: Path, name: str, cores: int) -> Path:
    d = root / name
    d.mkdir()
    write_limits(d, limits_text(1024, cores=cores))
    return d


def together(
    gpu: Path, jobs: list[tuple[Path, str]], seconds: float, kind: str = "kernel"
) -> list[dict[str, float]]:
    """Runs launch_load in each container at once on one simulated GPU, asynchronously."""
    procs = [
        subprocess.Popen(
            [tool("launch_load"), str(seconds), grids, kind, "link", "0"],
            env=hook_env(d, VGPU_SIM_STATE_DIR=str(gpu), VGPU_SIM_QUEUE_US=QUEUE_US),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for d, grids in jobs
    ]
    outs = [p.communicate(timeout=seconds * 10 + 60) for p in procs]
    for p, (out, err) in zip(procs, outs, strict=True):
        assert p.returncode == 0, out + err
    return [figures(out) for out, _ in outs]


def assert_near(share: float, target: int) -> None:
    assert share <= target + 5, f"{share:.1f}% is more than 5 points over the {target}% share"
    assert share >= target - 10, f"{share:.1f}% is far under the {target}% share"


@pytest.mark.parametrize(
    ("cores", "grids"),
    [
        ((30, 70), (SHORT, SHORT)),
        ((30, 70), (LONG, LONG)),
        ((30, 70), (f"{SHORT},{LONG}", f"{SHORT},{LONG}")),
        ((50, 50), (SHORT, SHORT)),
        ((50, 50), (LONG, LONG)),
        ((50, 50), (f"{SHORT},{LONG}", f"{SHORT},{LONG}")),
        # The failure: short kernels beside long ones got 1.5% of a 30% share.
        ((30, 70), (SHORT, LONG)),
        ((30, 70), (LONG, SHORT)),
    ],
    ids=["30/70-short", "30/70-long", "30/70-mixed", "50/50-short", "50/50-long", "50/50-mixed",
         "30short/70long", "30long/70short"],
)  # fmt: skip
def test_two_containers_land_on_their_shares(
    build: Path, tmp_path: Path, cores: tuple[int, int], grids: tuple[str, str]
) -> None:
    jobs = [
        (container(tmp_path, f"c{i}", c), g)
        for i, (c, g) in enumerate(zip(cores, grids, strict=True))
    ]
    got = [100 * f["busy_share"] for f in together(tmp_path / "gpu", jobs, 3.0)]
    print(f"\n{cores} {grids}: {got[0]:.1f}% / {got[1]:.1f}% of the GPU's time")
    assert_near(got[0], cores[0])
    assert_near(got[1], cores[1])


@pytest.mark.parametrize("grids", ["100000", "100,50000"], ids=["100ms", "mixed"])
def test_long_and_mixed_kernels_alone_hold_the_share(
    build: Path, tmp_path: Path, grids: str
) -> None:
    """At 30%, the old limiter let 100 ms kernels run at 40% (a launch never waited more than
    500 ms, so part of each one's debt went unpaid) and a random mix of 0.1 ms and 50 ms
    kernels at 47% (one average cost per launch, sampled once per 2 ms: mostly short ones)."""
    d = container(tmp_path, "c", 30)
    (f,) = together(tmp_path / "gpu", [(d, grids)], 3.0)
    print(f"\n{grids} at 30%: {100 * f['busy_share']:.1f}%")
    assert 20 <= 100 * f["busy_share"] <= 36  # a 100 ms kernel is 3 points of 3 s


def test_a_long_kernel_does_not_starve_the_short_ones_after_it(build: Path, tmp_path: Path) -> None:
    """Long kernels, then short ones, on one container's clock (two processes, one after the
    other, sharing the region): the short phase waits at most what the last long kernel owes,
    then runs at its share."""
    d = container(tmp_path, "c", 30)
    (long_phase,) = together(tmp_path / "gpu", [(d, "50000")], 1.5)
    (short_phase,) = together(tmp_path / "gpu", [(d, SHORT)], 2.0)
    shares = [100 * long_phase["busy_share"], 100 * short_phase["busy_share"]]
    print(f"\n30%: long kernels {shares[0]:.1f}%, then short ones {shares[1]:.1f}%")
    assert shares[0] <= 40
    # At most 167 - 20 ms of debt carried over: >= 30% of the remaining 1.85 s.
    assert 20 <= shares[1] <= 35


@pytest.mark.parametrize("kind", ["kernel", "graph", "ex", "coop"])
def test_a_limited_container_alone_holds_its_share_without_the_agent(
    build: Path, tmp_path: Path, kind: str
) -> None:
    (f,) = together(tmp_path / "gpu", [(container(tmp_path, "limited", 30), str(GRID))], 2, kind)
    print(f"\nalone, {kind}: 30% -> {100 * f['busy_share']:.1f}% of the GPU's time")
    assert 0.2 <= f["busy_share"] <= 0.35


@pytest.mark.parametrize(
    ("cores", "policy"), [(100, "share"), (0, "share"), (30, "off")], ids=["100%", "0", "off"]
)
def test_never_throttled_when_not_limited(
    tmp_path: Path, full_rate: float, cores: int, policy: str
) -> None:
    rate = load(container(tmp_path, "c", cores), VGPU_COMPUTE_POLICY=policy)["per_second"]
    assert rate >= 0.6 * full_rate, (rate, full_rate)  # limited runs stay under 0.35


def test_launch_count_reaches_the_region(build: Path, tmp_path: Path) -> None:
    d = container(tmp_path, "c", 100)
    proc = run([tool("launch_load"), "0.3", "10"], d)
    assert summary(proc)["launches"] > 0
    assert (d / "hook.region").stat().st_size > 0


def test_sixteen_launching_threads_keep_most_of_their_rate(build: Path, tmp_path: Path) -> None:
    """The gate adds no shared-counter bottleneck: launches per CPU-second of 16 threads
    launching zero-time kernels, with the hook (unlimited, and limiter engaged at 90% without
    holding) against the driver alone. CPU time, not wall time: the machine is shared. The
    target is 80% (docs/benchmarks.md); the bound here is generous for a loaded machine."""
    dirs = {"100": container(tmp_path, "c100", 100), "90": container(tmp_path, "c90", 90)}
    rates: dict[str, list[float]] = {"plain": [], "100": [], "90": []}
    argv = [tool("launch_load"), "0.5", "1", "kernel", "link", "0", "16"]
    for _ in range(3):  # interleaved: load changes hit all three alike
        for name in rates:
            proc = run(
                argv,
                dirs.get(name, tmp_path),
                hook=name != "plain",
                VGPU_SIM_NS_PER_BLOCK="0",
                VGPU_HOOK_QUIET="1",
            )
            assert proc.returncode == 0, proc.stderr
            rates[name].append(figures(proc.stdout)["per_cpu_second"])
    plain, unlimited, engaged = (statistics.median(rates[k]) for k in ("plain", "100", "90"))
    print(f"\n16 threads: {unlimited / plain:.0%} unlimited, {engaged / plain:.0%} engaged")
    assert unlimited >= 0.6 * plain
    assert engaged >= 0.5 * plain
