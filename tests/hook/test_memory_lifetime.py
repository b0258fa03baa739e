"""Memory that outlives the call that took it stays charged for exactly as long as the driver
holds it: VMM allocations until released and unmapped everywhere (shared ones counted once in
the container), pools at what they reserve until trimmed, executable graphs' memory while they
exist, context limits while the context exists, and stream-ordered allocations on the stream's
device. Each test runs the real compiled hook over the simulated driver (which models these
lifetimes), through every way a program finds the driver's functions."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from tests.hook.harness import (
    CUDA_ERROR_OUT_OF_MEMORY,
    hook_env,
    limits_text,
    run,
    summary,
    tool,
    write_limits,
)

OOM = CUDA_ERROR_OUT_OF_MEMORY
RESOLVE = ["link", "dlsym", "procaddr", "procaddr_pt", "procaddr_v1"]
# Two simulated GPUs, 1000 MiB of each for the container.
TWO_GPUS = {"VGPU_SIM_GPUS": "2x40960", "VGPU_HOOK_QUIET": "1"}


def mem_life(container: Path, *args: str) -> dict[str, int]:
    write_limits(container, limits_text(1000, 1000))
    proc = run([tool("mem_life"), *args], container, **TWO_GPUS)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return summary(proc)


@pytest.mark.parametrize("resolve", RESOLVE)
def test_vmm_stays_charged_until_released_and_unmapped(
    build: Path, tmp_path: Path, resolve: str
) -> None:
    assert mem_life(tmp_path, "vmm", resolve) == {
        "used_created": 512,
        "used_released_mapped": 512,  # released, but still mapped
        "rc_second": OOM,  # so 600 more does not fit
        "used_unmapped_retained": 512,  # unmapped, but cuMemRetainAllocationHandle holds it
        "same_handle": 1,
        "used_end": 0,  # released and unmapped: gone
    }


@pytest.mark.parametrize("resolve", RESOLVE)
def test_a_pool_is_charged_what_it_keeps_until_trimmed(
    build: Path, tmp_path: Path, resolve: str
) -> None:
    assert mem_life(tmp_path, "pool", resolve) == {
        "used_kept": 600,  # freed into a pool that keeps everything (release threshold: max)
        "rc_outside": OOM,  # so cuMemAlloc cannot take it again
        "rc_reuse": 0,  # but the pool can hand it out again
        "used_reused": 600,
        "used_trimmed_100": 100,  # cuMemPoolTrimTo(100 MiB)
        "used_trimmed": 0,
        "used_end": 0,
    }


@pytest.mark.parametrize("resolve", RESOLVE)
def test_the_default_pool_gives_memory_back_at_a_synchronisation(
    build: Path, tmp_path: Path, resolve: str
) -> None:
    assert mem_life(tmp_path, "async", resolve) == {
        "used_freed": 600,  # cuMemFreeAsync: the pool holds it until the next synchronisation
        "rc_outside": OOM,
        "used_synced": 0,  # release threshold 0: given back, and the hook sees it
        "rc_after_sync": 0,
    }


def test_a_destroyed_pool_is_charged_until_its_last_allocation_is_freed(
    build: Path, tmp_path: Path
) -> None:
    assert mem_life(tmp_path, "pool_destroy") == {"used_destroyed": 600, "used_end": 0}


@pytest.mark.parametrize("resolve", RESOLVE)
def test_async_allocation_is_charged_to_the_streams_device(
    build: Path, tmp_path: Path, resolve: str
) -> None:
    assert mem_life(tmp_path, "async_device", resolve) == {
        "rc_first": 0,
        "rc_second": OOM,  # device 1's slice is full...
        "used_device0": 0,  # ...and device 0, the current context's, holds nothing
        "rc_device0": 0,
        "used_device1": 600,
    }


GRAPH_EXPECTED = {
    "used_nodes": 0,  # a template graph takes nothing
    "used_instantiated": 600,  # the executable graph is charged
    "used_template_destroyed": 600,  # and keeps it when the template goes
    "rc_second": OOM,  # so a second executable graph does not fit
    "used_launched": 600,  # uploading and launching take nothing more
    "used_exec_destroyed": 0,
    "rc_third": 0,
    "used_end": 0,
}


@pytest.mark.parametrize("resolve", RESOLVE)
@pytest.mark.parametrize("how", ["flags", "instantiate", "params", "clone"])
def test_graph_memory_is_charged_to_the_executable_graph(
    build: Path, tmp_path: Path, resolve: str, how: str
) -> None:
    if resolve == "procaddr_v1" and how in ("instantiate", "params"):
        pytest.skip("CUDA 11.8 has neither cuGraphInstantiateWithParams nor the 12.0 signature")
    assert mem_life(tmp_path, "graph", resolve, how) == GRAPH_EXPECTED


@pytest.mark.parametrize("resolve", RESOLVE)
def test_stream_ordered_memory_captured_into_a_graph_is_charged_to_its_executable_graphs(
    build: Path, tmp_path: Path, resolve: str
) -> None:
    assert mem_life(tmp_path, "capture", resolve) == {
        "used_captured": 0,  # capturing cuMemAllocAsync allocates nothing
        "used_instantiated": 600,  # the executable graph made from the capture is charged
        "rc_second": OOM,  # so a second one does not fit
        "used_launched": 600,
        "used_exec_destroyed": 0,
        "rc_third": 0,
        "used_end": 0,
    }


@pytest.mark.parametrize("resolve", RESOLVE)
def test_context_limits_are_charged(build: Path, tmp_path: Path, resolve: str) -> None:
    assert mem_life(tmp_path, "limits", resolve) == {
        "rc_heap": 0,
        "heap_mib": 600,
        "used_heap": 592,  # 600 MiB heap, beyond the 8 MiB every context has
        "rc_fifo": OOM,  # a 600 MiB printf FIFO does not fit beside it
        "used_fifo": 592,
        "used_default": 0,  # heap back to its default
        # 1 KiB more stack for each of 108 SMs x 2048 threads of the simulated GPU
        "rc_stack": 0,
        "used_stack": 216,
        "rc_big_stack": OOM,
        "used_two_contexts": 316,  # another context's 100 MiB more heap
        "used_context_destroyed": 216,  # given back with that context
    }


class Lines:
    """A test program driven line by line over stdin/stdout."""

    def __init__(self, argv: list[str], container: Path, sim_state: Path) -> None:
        env = hook_env(container, sim_state, **TWO_GPUS)
        self.proc = subprocess.Popen(
            argv, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )

    def line(self) -> dict[str, int]:
        assert self.proc.stdout is not None
        text = self.proc.stdout.readline()
        assert text, f"the program ended early (rc={self.proc.wait(timeout=10)})"
        return summary(text)

    def send(self, text: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(text + "\n")
        self.proc.stdin.flush()

    def finish(self) -> int:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        return self.proc.wait(timeout=30)


def share(tmp_path: Path, importer_container: Path, resolve: str) -> tuple[dict, dict, dict]:
    """Process A creates 600 MiB, maps it and exports it; B imports and maps it; A then unmaps
    and releases it while B still holds it; B tries to create 600 MiB more, then lets go."""
    exporter_container = tmp_path / "a"
    for c in {exporter_container, importer_container}:
        c.mkdir(exist_ok=True)
        write_limits(c, limits_text(1000, 1000))
    sock, sim = str(tmp_path / "share.sock"), tmp_path / "sim"
    a = Lines([tool("mem_life"), "vmm_export", resolve, sock], exporter_container, sim)
    b = None
    try:
        assert a.line() == {"used": 600}
        b = Lines([tool("mem_life"), "vmm_import", resolve, sock], importer_container, sim)
        imported = b.line()
        a.send("release")
        released = a.line()
        b.send("create")
        last = b.line()
        assert b.finish() == 0
        assert a.finish() == 0
        return imported, released, last
    finally:
        for p in (a, b):
            if p and p.proc.poll() is None:
                p.proc.kill()


@pytest.mark.parametrize("resolve", ["link", "procaddr"])
def test_a_shared_vmm_allocation_is_counted_once_in_the_container(
    build: Path, tmp_path: Path, resolve: str
) -> None:
    imported, released, last = share(tmp_path, tmp_path / "a", resolve)
    assert imported == {"used_before": 600, "used_mapped": 600}  # not 1200
    assert released == {"used": 600}  # A let go, B still maps it: still counted
    assert last == {"rc_create": OOM, "used_holding": 600, "used_end": 0}


def test_memory_imported_from_another_container_is_charged_when_mapped(
    build: Path, tmp_path: Path
) -> None:
    imported, released, last = share(tmp_path, tmp_path / "b", "link")
    assert imported == {"used_before": 0, "used_mapped": 600}
    assert released == {"used": 0}  # container A is free of it
    assert last == {"rc_create": OOM, "used_holding": 600, "used_end": 0}
