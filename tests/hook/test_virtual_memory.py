"""Virtual device memory (issue 19): on a GPU whose memory scaling is above 1 the agent writes
`device.<i>.virtual_memory=1` and `spill_limit_mib` into the limit file, and an allocation that
fits the slice but not what the card has free succeeds with managed memory that pages to the
host. On the real compiled hook and the simulated driver, which shares the card's capacity
between processes and pages managed memory: a neighbour container fills the card, then a
program allocates within its slice."""

from __future__ import annotations

import re
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from services.nodeagent.relay_protocol import Usage
from tests.hook.harness import (
    SIM_MIB,
    holding,
    hook_env,
    limits_text,
    run,
    summary,
    tool,
    write_limits,
)
from tests.hook.test_relay import agent

WORKLOAD = Path(__file__).resolve().parents[1] / "gpu" / "spill_workload.py"
NEIGHBOUR_MIB = 30000  # what the neighbour holds of the simulated card's 40960 MiB
SLICE_MIB = 20480  # our slice: more than the 10960 MiB the card has left
CARD_FREE_MIB = SIM_MIB - NEIGHBOUR_MIB
HOST = {"VGPU_SIM_HOST_MIB": "65536"}  # host memory the simulated driver may page out to


def virtual_limits(slice_mib: int, spill_limit_mib: int = 16384) -> str:
    """What the agent writes for a container on a GPU with memory scaling > 1."""
    return (
        limits_text(slice_mib) + f"device.0.virtual_memory=1\nspill_limit_mib={spill_limit_mib}\n"
    )


@contextmanager
def card_filled(tmp_path: Path, gpu: Path) -> Iterator[None]:
    """Another container holding NEIGHBOUR_MIB of the shared simulated card."""
    neighbour = tmp_path / "neighbour"
    neighbour.mkdir()
    write_limits(neighbour, limits_text(NEIGHBOUR_MIB))
    args = ("alloc", "link", "create", 100, "hold")
    with holding(neighbour, *args, VGPU_HOOK_QUIET="1", VGPU_SIM_STATE_DIR=str(gpu)) as proc:
        assert summary(proc.first_line)["allocated_mib"] == NEIGHBOUR_MIB  # type: ignore[attr-defined]
        yield


def fill_slice(container: Path, gpu: Path) -> tuple[dict[str, int], str]:
    proc = run([tool("alloc_limit"), "100"], container, VGPU_SIM_STATE_DIR=str(gpu), **HOST)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return summary(proc), proc.stderr


def test_within_its_slice_a_task_never_fails_because_the_card_is_full(
    build: Path, tmp_path: Path
) -> None:
    gpu, container = tmp_path / "gpu", tmp_path / "c"
    container.mkdir()
    write_limits(container, virtual_limits(SLICE_MIB))
    with card_filled(tmp_path, gpu):
        got, stderr = fill_slice(container, gpu)
    # Up to the slice (the next 100 MiB chunk is the slice's refusal, not the card's).
    assert got["allocated_mib"] == 20400 and got["result"] == 2, got
    assert "used 20400 MiB + asked 100 MiB > limit 20480 MiB" in stderr
    # The program is told its whole slice, spilled or not; all of it comes back.
    assert (got["total_mib"], got["free_mib"], got["free_after_mib"]) == (SLICE_MIB, 80, SLICE_MIB)


def test_with_memory_scaling_1_nothing_changes(build: Path, tmp_path: Path) -> None:
    """No virtual_memory key (scaling 1): the card's own out-of-memory, as before."""
    gpu, container = tmp_path / "gpu", tmp_path / "c"
    container.mkdir()
    write_limits(container, limits_text(SLICE_MIB))
    with card_filled(tmp_path, gpu):
        got, stderr = fill_slice(container, gpu)
    assert got["allocated_mib"] == 10900 and got["result"] == 2, got  # the card is full
    assert "out of memory on device" not in stderr  # the driver refused, not the slice
    assert got["free_mib"] == CARD_FREE_MIB - 10900  # what the card has, within the slice
    assert got["total_mib"] == SLICE_MIB


def test_spilled_memory_is_bounded_by_the_node_setting(build: Path, tmp_path: Path) -> None:
    gpu, container = tmp_path / "gpu", tmp_path / "c"
    container.mkdir()
    write_limits(container, virtual_limits(SLICE_MIB, spill_limit_mib=2000))
    with card_filled(tmp_path, gpu):
        got, stderr = fill_slice(container, gpu)
    # 10900 MiB on the card, then 100 MiB chunks spill until the next would pass 2000 MiB.
    assert got["allocated_mib"] == 10900 + 2000 and got["result"] == 2, got
    assert "past its host bound (spill_limit_mib=2000)" in stderr
    assert got["free_after_mib"] == SLICE_MIB  # spilled memory came back with the rest


def nvml_used(gpu: Path, container: Path) -> dict[int, int]:
    """Device 0's processes as the driver counts them (no hook): {pid: MiB on the card}."""
    proc = run([tool("nvml_procs")], container, hook=False, VGPU_SIM_STATE_DIR=str(gpu))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    v2 = dict(re.findall(r"(\w+)=(\S+)", proc.stdout.splitlines()[0]))["v2"]
    return {int(p): int(m) for p, m in (e.split(":") for e in v2.split(",") if e != "-")}


def test_spilled_memory_pages_to_the_host_and_is_reported_apart(
    build: Path, tmp_path: Path, short_dir: Path
) -> None:
    gpu = tmp_path / "gpu"
    write_limits(short_dir, virtual_limits(SLICE_MIB))
    with card_filled(tmp_path, gpu), agent(short_dir) as relay:
        args = ("alloc", "link", "create", 100, "hold")
        env = {"VGPU_HOOK_QUIET": "1", "VGPU_SIM_STATE_DIR": str(gpu), **HOST}
        with holding(short_dir, *args, **env) as proc:
            assert summary(proc.first_line)["allocated_mib"] == 20400  # type: ignore[attr-defined]
            # On the card it holds what was free; the rest lives on the host.
            used = nvml_used(gpu, short_dir)
            assert used[proc.pid] == CARD_FREE_MIB
            assert sum(used.values()) == SIM_MIB  # never more than the card
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:
                usages = [m for m in relay.messages if isinstance(m, Usage)]
                if usages and usages[-1].devices[0].used_mib == 20400:  # all of it, reported
                    break
                time.sleep(0.05)
    device = usages[-1].devices[0]
    assert (device.used_mib, device.spilled_mib) == (20400, 20400 - 10900)


def test_the_gpu_benchmarks_workload_spills_on_the_simulated_driver(
    build: Path, tmp_path: Path
) -> None:
    """tests/gpu/spill_workload.py, which measures the cost on a real GPU, behaves here as it
    must there: a buffer the full card cannot hold comes back as managed memory and kernels
    run over it; with memory scaling 1 the driver's out-of-memory comes back."""
    gpu = tmp_path / "gpu"
    virtual, plain = tmp_path / "virtual", tmp_path / "plain"
    virtual.mkdir(), plain.mkdir()
    write_limits(virtual, virtual_limits(SLICE_MIB))
    write_limits(plain, limits_text(SLICE_MIB))
    argv = [sys.executable, str(WORKLOAD), "bench", "12288", "2"]  # more than the card has left
    extra = {"VGPU_SIM_STATE_DIR": str(gpu), "VGPU_HOOK_QUIET": "1", **HOST}
    with card_filled(tmp_path, gpu):
        spilled = run(argv, virtual, **extra)
        refused = run(argv, plain, **extra)
    assert spilled.returncode == 0, spilled.stderr
    assert summary(spilled)["result"] == 0 and summary(spilled)["managed"] == 1
    assert summary(refused)["result"] == 2  # CUDA_ERROR_OUT_OF_MEMORY, from the driver


def test_spilled_memory_pages_back_onto_the_card_when_it_has_room(
    build: Path, tmp_path: Path
) -> None:
    """The simulated driver's paging: a buffer spilled while the card was full moves onto the
    card at the next kernel once the neighbour has gone, as a device-preferring managed
    buffer does on hardware."""
    gpu, container = tmp_path / "gpu", tmp_path / "c"
    container.mkdir()
    write_limits(container, virtual_limits(SLICE_MIB))
    env = hook_env(container, gpu, VGPU_HOOK_QUIET="1", **HOST)
    with card_filled(tmp_path, gpu):
        proc = subprocess.Popen(
            [sys.executable, str(WORKLOAD), "touch", "16384"],
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        assert proc.stdout is not None and proc.stdin is not None
        first = proc.stdout.readline()
        assert first.strip() == "allocated managed=1", first + (proc.stderr.read() or "")
        assert nvml_used(gpu, container)[proc.pid] == CARD_FREE_MIB  # the rest is on the host
    try:
        # The neighbour is gone: the next kernel pages the buffer in.
        proc.stdin.write("go\n")
        proc.stdin.flush()
        assert proc.stdout.readline().strip() == "touched"
        assert nvml_used(gpu, container)[proc.pid] == 16384
    finally:
        proc.communicate(timeout=30)
