"""Liveness of the shared region's slots across PID namespaces (issue 13): a process in a nested
PID namespace (`unshare --pid --fork --mount-proc`, as a container runtime or `vgpu run` makes)
sees other pid numbers than the host, so judging a slot by `kill(pid, 0)` reaped the live
slots of processes in another namespace, and the container then took its memory twice. The
owner of a slot now holds a file lock on it while it lives; these tests cross the namespace
boundary both ways with the real compiled hook."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from tests.hook.harness import holding, hook_env, limits_text, run, summary, tool, write_limits

NESTED = ["unshare", "--pid", "--fork", "--mount-proc"]


@pytest.fixture(autouse=True)
def _pid_namespaces() -> None:
    probe = subprocess.run([*NESTED, "true"], capture_output=True, text=True, timeout=30)
    if probe.returncode != 0:
        pytest.skip(f"PID namespaces are not available here: {probe.stderr.strip()}")


@contextmanager
def holder(container_dir: Path, *, nested: bool) -> Iterator[subprocess.Popen[str]]:
    """A process that takes 1000 of the container's 1024 MiB and holds them until its stdin
    closes; in a nested PID namespace when `nested`."""
    args = ("alloc", "link", "create", 100, "hold")
    with holding(
        container_dir, *args, prefix=NESTED if nested else (), VGPU_HOOK_QUIET="1"
    ) as proc:
        first = proc.first_line  # type: ignore[attr-defined]
        assert summary(first)["allocated_mib"] == 1000, first
        yield proc


def allocate(container_dir: Path, *, nested: bool) -> int:
    """MiB a fresh process gets in 10 MiB chunks, from the host or a nested namespace."""
    argv = [tool("alloc_limit"), "10"]
    proc = run([*NESTED, *argv] if nested else argv, container_dir, VGPU_HOOK_QUIET="1")
    assert proc.returncode == 0, proc.stderr
    return summary(proc)["allocated_mib"]


def kill_holder(proc: subprocess.Popen[str], *, nested: bool) -> None:
    """SIGKILL (no chance to give anything back), then wait until it is gone."""
    victim = proc.pid
    if nested:  # the holder is unshare's child, pid 1 of its namespace
        children = Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()
        assert len(children) == 1, children
        victim = int(children[0])
    os.kill(victim, signal.SIGKILL)
    proc.wait(timeout=30)  # unshare reaps its child first, then exits itself
    deadline = time.monotonic() + 10
    while Path(f"/proc/{victim}").exists() and time.monotonic() < deadline:
        time.sleep(0.01)


@pytest.mark.parametrize(
    ("holder_nested", "asker_nested"),
    [(False, True), (True, False), (True, True)],
    ids=["host-holds-nested-asks", "nested-holds-host-asks", "nested-holds-other-nested-asks"],
)
def test_a_live_slot_in_another_namespace_is_never_reaped(
    build: Path, tmp_path: Path, holder_nested: bool, asker_nested: bool
) -> None:
    write_limits(tmp_path, limits_text(1024))
    with holder(tmp_path, nested=holder_nested):
        # Only what the live holder left: 24 MiB, in 10 MiB chunks. The old hook reaped the
        # holder's slot from the other namespace and handed out 1020.
        assert allocate(tmp_path, nested=asker_nested) == 20
    # The holder gave back on exit: the whole budget again.
    assert allocate(tmp_path, nested=asker_nested) == 1020


@pytest.mark.parametrize(
    ("holder_nested", "asker_nested"),
    [(False, True), (True, False)],
    ids=["host-dies-nested-asks", "nested-dies-host-asks"],
)
def test_a_dead_slot_in_another_namespace_is_still_reaped(
    build: Path, tmp_path: Path, holder_nested: bool, asker_nested: bool
) -> None:
    write_limits(tmp_path, limits_text(1024))
    with holder(tmp_path, nested=holder_nested) as victim:
        kill_holder(victim, nested=holder_nested)
    assert allocate(tmp_path, nested=asker_nested) == 1020


def test_a_forked_child_does_not_keep_its_dead_parents_slot_alive(
    build: Path, tmp_path: Path
) -> None:
    """The slot's lock belongs to the parent's open file: a child that outlives its parent
    (a daemonised worker that never uses CUDA) must not keep the parent's memory charged."""
    write_limits(tmp_path, limits_text(1024))
    script = """
import ctypes, os, time
cuda = ctypes.CDLL("libcuda.so.1")
assert cuda.cuInit(0) == 0
ctx, p = ctypes.c_void_p(), ctypes.c_ulonglong()
assert cuda.cuCtxCreate_v2(ctypes.byref(ctx), 0, 0) == 0
assert cuda.cuMemAlloc_v2(ctypes.byref(p), ctypes.c_size_t(1000 << 20)) == 0
if os.fork() == 0:
    # fork() has returned here, so the hook's at-fork handlers have let go of the parent's
    # slot: before that, the child still shares the parent's lock (and shows it alive).
    os.write(1, b"child\\n")  # one write each: the two processes share the pipe
    time.sleep(30)  # outlives its parent; killed by the test
    os._exit(0)
os.write(1, b"forked\\n")
os.kill(os.getpid(), 9)  # the parent dies holding its 1000 MiB
"""
    proc = subprocess.Popen(
        [sys.executable, "-c", script],
        env=hook_env(tmp_path, VGPU_HOOK_QUIET="1"),
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        assert proc.stdout is not None
        assert {proc.stdout.readline(), proc.stdout.readline()} == {"forked\n", "child\n"}
        proc.wait(timeout=30)
        assert allocate(tmp_path, nested=False) == 1020
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
