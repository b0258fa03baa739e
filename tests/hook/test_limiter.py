"""The compute limiter in simulation: kernels of every process run one after another on the
simulated GPU (sim/sim_exec.c), so without the limiter two busy containers split it half and
half. Figures are printed (pytest -s shows them); assertions are generous because the machine
running the tests is shared and loaded."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from tests.hook.harness import hook_env, limits_text, run, summary, tool, write_limits

SECONDS = 1.0
GRID = 1000  # blocks: 1 ms of simulated GPU time per kernel


def load(container_dir: Path, *args: object, hook: bool = True, **extra: str) -> float:
    proc = run(
        [tool("launch_load"), str(SECONDS), str(GRID), *map(str, args)],
        container_dir,
        hook=hook,
        VGPU_HOOK_QUIET="1",
        **extra,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return float(proc.stdout.split("per_second=")[1])


@pytest.fixture(scope="module")
def full_rate(build: Path, tmp_path_factory: pytest.TempPathFactory) -> float:
    """Launches per second of an unlimited process alone on a simulated GPU."""
    return load(tmp_path_factory.mktemp("free"), hook=False)


def container(root: Path, name: str, cores: int) -> Path:
    d = root / name
    d.mkdir()
    write_limits(d, limits_text(1024, cores=cores))
    return d


def test_30_and_70_percent_containers_share_a_gpu_near_30_70(build: Path, tmp_path: Path) -> None:
    gpu = str(tmp_path / "gpu")  # both containers on one simulated GPU
    a, b = container(tmp_path, "a", 30), container(tmp_path, "b", 70)
    argv = [tool("launch_load"), str(SECONDS * 2), str(GRID)]
    procs = [
        subprocess.Popen(
            argv, env=hook_env(d, VGPU_SIM_STATE_DIR=gpu), stdout=subprocess.PIPE, text=True
        )
        for d in (a, b)
    ]
    rates = [float(p.communicate(timeout=60)[0].split("per_second=")[1]) for p in procs]
    share = rates[0] / sum(rates)
    print(f"\n30/70 in simulation: {rates[0]:.0f} and {rates[1]:.0f} launches/s, share {share:.3f}")
    assert 0.2 <= share <= 0.4
    assert sum(rates) > 500  # the GPU (1000 launches/s) stays mostly busy


@pytest.mark.parametrize("kind", ["kernel", "graph", "ex", "coop"])
def test_a_limited_container_alone_holds_its_share_without_the_agent(
    tmp_path: Path, full_rate: float, kind: str
) -> None:
    limited = load(container(tmp_path, "limited", 30), kind)
    print(
        f"\nalone, {kind}: free {full_rate:.0f}/s, 30% {limited:.0f}/s, "
        f"ratio {limited / full_rate:.3f}"
    )
    assert 0.2 <= limited / full_rate <= 0.45


@pytest.mark.parametrize(
    ("cores", "policy"), [(100, "share"), (0, "share"), (30, "off")], ids=["100%", "0", "off"]
)
def test_never_throttled_when_not_limited(
    tmp_path: Path, full_rate: float, cores: int, policy: str
) -> None:
    rate = load(container(tmp_path, "c", cores), VGPU_COMPUTE_POLICY=policy)
    assert rate >= 0.6 * full_rate, (rate, full_rate)  # limited runs stay under 0.45


def test_launch_count_reaches_the_region(build: Path, tmp_path: Path) -> None:
    d = container(tmp_path, "c", 100)
    proc = run([tool("launch_load"), "0.3", "10"], d)
    assert summary(proc)["launches"] > 0
    assert (d / "hook.region").stat().st_size > 0
