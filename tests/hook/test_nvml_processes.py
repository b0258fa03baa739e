"""NVML's process lists inside a container show only the container's processes (issue 13): two
containers share one simulated GPU, each with a process holding memory; nvidia-smi's way of
asking (dlopen + dlsym, the two-call protocol, every version of the compute list) through the
real compiled hook lists the asking container's process alone, with what the driver says it
holds. Without the hook the same GPU lists both."""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

from tests.hook.harness import holding, limits_text, run, summary, tool, write_limits


@contextmanager
def holding_memory(container_dir: Path, gpu: Path) -> Iterator[tuple[int, int]]:
    """A process of the container holding memory in 300 MiB chunks up to its limit:
    (its pid, MiB it holds)."""
    args = ("alloc", "link", "create", 300, "hold")
    with holding(container_dir, *args, VGPU_HOOK_QUIET="1", VGPU_SIM_STATE_DIR=str(gpu)) as proc:
        yield proc.pid, summary(proc.first_line)["allocated_mib"]  # type: ignore[attr-defined]


def process_lists(
    container_dir: Path, gpu: Path, *, hook: bool = True
) -> dict[str, dict[int, int]]:
    """Device 0's compute process lists, by version: {pid: MiB}."""
    proc = run(
        [tool("nvml_procs")],
        container_dir,
        hook=hook,
        VGPU_HOOK_QUIET="1",
        VGPU_SIM_STATE_DIR=str(gpu),
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    first = dict(re.findall(r"(\w+)=(\S+)", proc.stdout.splitlines()[0]))
    assert first["device"] == "0", proc.stdout
    return {
        version: {
            int(pid): int(mib)
            for pid, mib in (
                entry.split(":") for entry in first[version].split(",") if entry != "-"
            )
        }
        for version in ("v1", "v2", "v3")
    }


def test_nvml_lists_only_the_containers_processes(build: Path, tmp_path: Path) -> None:
    gpu = tmp_path / "gpu"  # one simulated GPU, shared by both containers
    a, b = tmp_path / "a", tmp_path / "b"
    for d, mib in ((a, 1024), (b, 700)):
        d.mkdir()
        write_limits(d, limits_text(mib))
    with ExitStack() as stack:
        a_pid, a_mib = stack.enter_context(holding_memory(a, gpu))
        b_pid, b_mib = stack.enter_context(holding_memory(b, gpu))
        assert (a_mib, b_mib) == (900, 600)
        both = process_lists(a, gpu, hook=False)
        seen_by_a = process_lists(a, gpu)
        seen_by_b = process_lists(b, gpu)
    for version in ("v1", "v2", "v3"):
        assert both[version] == {a_pid: 900, b_pid: 600}, both
        assert seen_by_a[version] == {a_pid: 900}, seen_by_a
        assert seen_by_b[version] == {b_pid: 600}, seen_by_b


def test_a_container_without_running_processes_lists_none(build: Path, tmp_path: Path) -> None:
    gpu = tmp_path / "gpu"
    a, idle = tmp_path / "a", tmp_path / "idle"
    for d in (a, idle):
        d.mkdir()
        write_limits(d, limits_text(1024))
    with holding_memory(a, gpu) as (a_pid, _):
        assert process_lists(idle, gpu) == {"v1": {}, "v2": {}, "v3": {}}
        assert process_lists(idle, gpu, hook=False)["v3"].keys() == {a_pid}
