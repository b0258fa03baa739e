"""Inside a container the hook's configuration cannot be changed from the container.

Each test runs the real compiled hook with the simulated driver in a mount namespace laid out
as the node agent's Allocate response asks (tests/hook/container.py): /var/run/vgpu bound
read-only (hook.conf, limits), /var/run/vgpu-state read-write (hook.region, relay.sock), the
directories made by the agent's own code. Every escape of issue 13 is tried here; each worked
with the hook before it (environment overrides, a writable limits mount, symlinks followed,
a zeroed region re-initialised as if new) and must now be refused or ignored.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from services.nodeagent.container_files import (
    REGION_FILE,
    HookSettings,
    config_dir,
    limits_path,
    state_dir,
)
from tests.hook.container import (
    Mount,
    agent_directory,
    container_argv,
    require_namespaces,
    run_in_container,
)
from tests.hook.harness import (
    CUDA_ERROR_INVALID_VALUE,
    CUDA_ERROR_OUT_OF_MEMORY,
    hook_env,
    limits_text,
    run,
    summary,
    tool,
    write_limits,
)

REFUSED = "refusing to run with unknown limits: cuInit returns CUDA_ERROR_INVALID_VALUE"
FIXED_LIMITS = "/var/run/vgpu/limits"
REGION = "/var/run/vgpu-state/hook.region"


@pytest.fixture(autouse=True)
def _namespaces(build: Path) -> None:
    require_namespaces()


def container_env(sim_state: Path, **extra: str) -> dict[str, str]:
    """The environment a container's process has: no VGPU_* setting unless a test adds one."""
    env = hook_env(sim_state, sim_state / "sim")
    for name in ("VGPU_CONTAINER_DIR", "VGPU_LIMIT_WAIT_MS"):
        env.pop(name)
    env.update(extra)
    return env


def make_container(tmp_path: Path, limits: str | None, **settings: object) -> list[Mount]:
    mounts = agent_directory(tmp_path / "dir", HookSettings(**settings))  # type: ignore[arg-type]
    if limits is not None:
        write_limits(config_dir(tmp_path / "dir"), limits)
    return mounts


def alloc(
    tmp_path: Path, mounts: list[Mount], chunk: int = 100, **env: str
) -> subprocess.CompletedProcess[str]:
    return run_in_container(
        [tool("alloc_limit"), str(chunk)], mounts, container_env(tmp_path, **env)
    )


def test_limits_hold_inside_a_container(tmp_path: Path) -> None:
    proc = alloc(tmp_path, make_container(tmp_path, limits_text(1000)))
    assert summary(proc)["allocated_mib"] == 1000, proc.stderr
    assert summary(proc)["result"] == CUDA_ERROR_OUT_OF_MEMORY
    assert f"limits from {FIXED_LIMITS} for pod default/half-gpu" in proc.stderr
    assert "ignoring" not in proc.stderr


def test_environment_cannot_move_the_limits_away(tmp_path: Path) -> None:
    """`VGPU_CONTAINER_DIR=/nonexistent VGPU_LIMIT_WAIT_MS=0` ran unlimited before."""
    mounts = make_container(tmp_path, limits_text(1000))
    proc = alloc(tmp_path, mounts, VGPU_CONTAINER_DIR="/nonexistent", VGPU_LIMIT_WAIT_MS="0")
    assert summary(proc)["allocated_mib"] == 1000, proc.stderr
    assert proc.stderr.count("vgpu-hook: ignoring VGPU_CONTAINER_DIR, VGPU_LIMIT_WAIT_MS:") == 1
    # The same variables on a bare host still steer the hook (development and tests).
    bare = run([tool("alloc_limit"), "1000"], tmp_path / "nonexistent", VGPU_LIMIT_WAIT_MS="0")
    assert summary(bare)["allocated_mib"] == 40000


def test_environment_cannot_raise_a_limit(tmp_path: Path) -> None:
    mounts = make_container(tmp_path, None, limit_wait_ms=100)
    proc = alloc(tmp_path, mounts, VGPU_MEMORY_LIMIT_MIB="30000", VGPU_CONTEXT_OVERHEAD_MIB="0")
    assert summary(proc) == {"init_result": CUDA_ERROR_INVALID_VALUE}
    assert "ignoring VGPU_MEMORY_LIMIT_MIB, VGPU_CONTEXT_OVERHEAD_MIB" in proc.stderr


def test_limits_that_never_appear_fail_cuda_initialisation(tmp_path: Path) -> None:
    """The wait is the agent's (hook.conf); the environment can neither shorten nor skip it."""
    mounts = make_container(tmp_path, None, limit_wait_ms=300)
    started = time.monotonic()
    proc = alloc(tmp_path, mounts, VGPU_LIMIT_WAIT_MS="0")
    assert time.monotonic() - started >= 0.3
    assert summary(proc) == {"init_result": CUDA_ERROR_INVALID_VALUE}
    assert (
        f"vgpu-hook: no limit file at {FIXED_LIMITS} after 300 ms (the node agent has not "
        f"written this container's limits); {REFUSED}" in proc.stderr
    )


def test_limits_written_during_the_wait_are_used(tmp_path: Path) -> None:
    mounts = make_container(tmp_path, None, limit_wait_ms=20000)
    argv = container_argv([tool("alloc_limit"), "100"], mounts)
    with subprocess.Popen(
        argv, env=container_env(tmp_path), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    ) as proc:
        time.sleep(0.3)
        write_limits(config_dir(tmp_path / "dir"), limits_text(700))  # the agent, host side
        out, err = proc.communicate(timeout=60)
    assert summary(out)["allocated_mib"] == 700, err


def test_root_in_the_container_cannot_replace_the_limits(tmp_path: Path) -> None:
    """The limits mount used to be read-write: root rewrote the file and ran unlimited."""
    mounts = make_container(tmp_path, limits_text(1000))
    for attack in (
        f"echo 'version=1\ndevice_count=0' > {FIXED_LIMITS}",
        f"rm -f {FIXED_LIMITS}",
        f"mv {FIXED_LIMITS} /tmp/moved-limits-{os.getpid()}",
        "touch /var/run/vgpu/hook.conf",
    ):
        proc = run_in_container(["sh", "-c", attack], mounts, container_env(tmp_path))
        assert proc.returncode != 0, attack
        assert "Read-only file system" in proc.stderr, (attack, proc.stderr)
    assert summary(alloc(tmp_path, mounts))["allocated_mib"] == 1000


def test_limits_on_a_writable_mount_are_refused(tmp_path: Path) -> None:
    """A runtime that ignored read_only, or a container that planted its own directory there."""
    mounts = make_container(tmp_path, limits_text(1000))
    writable = [Mount(m.host_path, m.container_path, False) for m in mounts]
    proc = alloc(tmp_path, writable)
    assert summary(proc) == {"init_result": CUDA_ERROR_INVALID_VALUE}
    assert "/var/run/vgpu/hook.conf: is on a writable mount" in proc.stderr
    (config_dir(tmp_path / "dir") / "hook.conf").unlink()
    proc = alloc(tmp_path, writable)
    assert summary(proc) == {"init_result": CUDA_ERROR_INVALID_VALUE}
    assert f"{FIXED_LIMITS}: is on a writable mount" in proc.stderr


def test_a_symlinked_limits_file_is_refused(tmp_path: Path) -> None:
    mounts = make_container(tmp_path, None)
    forged = state_dir(tmp_path / "dir") / "forged"  # somewhere the container can write
    forged.write_text(limits_text(40000))
    limits_path(tmp_path / "dir").symlink_to("/var/run/vgpu-state/forged")
    proc = alloc(tmp_path, mounts)
    assert summary(proc) == {"init_result": CUDA_ERROR_INVALID_VALUE}
    assert f"{FIXED_LIMITS}: is a symbolic link (the node agent writes a regular file)" in (
        proc.stderr
    )


@pytest.mark.parametrize(("kind", "words"), [("fifo", "a FIFO"), ("dir", "a directory")])
def test_limits_that_are_not_a_regular_file_are_refused(
    tmp_path: Path, kind: str, words: str
) -> None:
    mounts = make_container(tmp_path, None)
    if kind == "fifo":
        os.mkfifo(limits_path(tmp_path / "dir"))  # would block a plain open forever
    else:
        limits_path(tmp_path / "dir").mkdir()
    proc = alloc(tmp_path, mounts)
    assert summary(proc) == {"init_result": CUDA_ERROR_INVALID_VALUE}
    assert f"{FIXED_LIMITS}: is {words}, not a regular file" in proc.stderr


def test_a_bad_hook_conf_fails_closed(tmp_path: Path) -> None:
    mounts = make_container(tmp_path, limits_text(1000))
    conf = config_dir(tmp_path / "dir") / "hook.conf"
    conf.write_text("version=1\ncompute_policy=fair\n")
    proc = alloc(tmp_path, mounts)
    assert summary(proc) == {"init_result": CUDA_ERROR_INVALID_VALUE}
    assert "/var/run/vgpu/hook.conf:2: compute_policy: 'fair' is not one of" in proc.stderr


# --- the shared accounting region --------------------------------------------------------

HOLDER = r"""
import ctypes, sys
ctypes.CDLL("libcuda.so.1", mode=ctypes.RTLD_GLOBAL)
api = ctypes.CDLL(None)
rc = api.cuInit(0)
if rc:
    print(f"init_result={rc}", flush=True)
    sys.exit(1)
dev, ctx, ptr = ctypes.c_int(), ctypes.c_void_p(), ctypes.c_ulonglong()
api.cuDeviceGet(ctypes.byref(dev), 0)
api.cuCtxCreate_v2(ctypes.byref(ctx), 0, dev)
def alloc(mib):
    return api.cuMemAlloc_v2(ctypes.byref(ptr), ctypes.c_size_t(mib << 20))
print(f"held={alloc(int(sys.argv[1]))}", flush=True)
sys.stdin.readline()
print(f"more={alloc(int(sys.argv[2]))}", flush=True)
"""


def zero_region(tmp_path: Path, mounts: list[Mount]) -> None:
    """What any process of the container can do: the region is writable by design."""
    size = (state_dir(tmp_path / "dir") / REGION_FILE).stat().st_size
    attack = f"dd if=/dev/zero of={REGION} bs={size} count=1 conv=notrunc status=none"
    env = {k: v for k, v in container_env(tmp_path).items() if k != "LD_PRELOAD"}  # dd vs ASan
    proc = run_in_container(["sh", "-c", attack], mounts, env)
    assert proc.returncode == 0, proc.stderr


def test_zeroing_the_region_does_not_hide_usage(tmp_path: Path) -> None:
    """Before, a zeroed region was taken for a new one: the next process got the whole limit
    again while the first still held its memory."""
    mounts = make_container(tmp_path, limits_text(1000))
    argv = container_argv([sys.executable, "-c", HOLDER, "600", "100"], mounts)
    with subprocess.Popen(
        argv,
        env=container_env(tmp_path),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    ) as holder:
        assert holder.stdin and holder.stdout
        assert holder.stdout.readline().strip() == "held=0"
        zero_region(tmp_path, mounts)
        newcomer = alloc(tmp_path, mounts)
        holder.stdin.write("\n")
        holder.stdin.flush()
        more = holder.stdout.readline().strip()
        _, err = holder.communicate(timeout=60)
    assert summary(newcomer) == {"init_result": CUDA_ERROR_INVALID_VALUE}
    assert (
        f"vgpu-hook: cannot share accounting through {REGION}: its header is zeroed (not the "
        "node agent's, not this hook's layout); refusing to run" in newcomer.stderr
    )
    assert more == f"more={CUDA_ERROR_OUT_OF_MEMORY}"  # the holder is refused too
    assert "the shared accounting region's header was overwritten while in use" in err


@pytest.mark.parametrize(
    ("content", "problem"),
    [
        (b"", "is 0 bytes: neither the node agent's 16-byte header nor"),
        (b"\0" * 16, "its header is zeroed"),
        ((0x4D4949414D5348).to_bytes(8, "little") + bytes(8), "was not written for this hook"),
    ],
    ids=["empty", "zeroed-header", "foreign"],
)
def test_a_region_that_is_not_the_hooks_own_fails_closed(
    tmp_path: Path, content: bytes, problem: str
) -> None:
    """Never limits per process instead: that multiplies the slice by the process count."""
    mounts = make_container(tmp_path, limits_text(1000))
    region = state_dir(tmp_path / "dir") / REGION_FILE
    region.write_bytes(content)
    proc = alloc(tmp_path, mounts)
    assert summary(proc) == {"init_result": CUDA_ERROR_INVALID_VALUE}
    assert f"cannot share accounting through {REGION}: {problem}" in proc.stderr
    assert "limits apply to each process alone" not in proc.stderr


def test_a_missing_or_symlinked_region_fails_closed(tmp_path: Path) -> None:
    mounts = make_container(tmp_path, limits_text(1000))
    region = state_dir(tmp_path / "dir") / REGION_FILE
    region.unlink()
    proc = alloc(tmp_path, mounts)
    assert summary(proc) == {"init_result": CUDA_ERROR_INVALID_VALUE}
    assert f"{REGION}: does not exist (the node agent creates it)" in proc.stderr
    region.symlink_to("/dev/null")
    proc = alloc(tmp_path, mounts)
    assert summary(proc) == {"init_result": CUDA_ERROR_INVALID_VALUE}
    assert f"{REGION}: is a symbolic link (refused)" in proc.stderr


def test_processes_share_the_agent_made_region(tmp_path: Path) -> None:
    mounts = make_container(tmp_path, limits_text(1000))
    first = alloc(tmp_path, mounts, 300)
    assert summary(first)["allocated_mib"] == 900
    again = alloc(tmp_path, mounts, 300)  # the first gave everything back when it exited
    assert summary(again)["allocated_mib"] == 900


# --- the compute policy --------------------------------------------------------------------

SECONDS = 1.0
GRID = 1000


def launch_rate(tmp_path: Path, mounts: list[Mount] | None, **env: str) -> float:
    argv = [tool("launch_load"), str(SECONDS), str(GRID)]
    if mounts is None:
        tmp_path.mkdir()
        write_limits(tmp_path, limits_text(1024, cores=30))
        proc = run(argv, tmp_path, VGPU_HOOK_QUIET="1", **env)
    else:
        proc = run_in_container(argv, mounts, container_env(tmp_path, VGPU_HOOK_QUIET="1", **env))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return float(proc.stdout.split("per_second=")[1])


def compute_limit_rates(tmp_path: Path) -> tuple[float, float, float]:
    """Launch rates of a 30% slice: env `off` on a bare host, env `off` in a container, and
    the agent's policy `off` in a container."""
    tmp_path.mkdir()
    free = launch_rate(tmp_path / "bare", None, VGPU_COMPUTE_POLICY="off")
    (tmp_path / "a").mkdir()
    limited = launch_rate(
        tmp_path / "a",
        make_container(tmp_path / "a", limits_text(1024, cores=30)),
        VGPU_COMPUTE_POLICY="off",
    )
    (tmp_path / "b").mkdir()
    agent_off = launch_rate(
        tmp_path / "b",
        make_container(tmp_path / "b", limits_text(1024, cores=30), compute_policy="off"),
    )
    print(
        f"\n30% slice: env off on a bare host {free:.0f}/s, in a container {limited:.0f}/s, "
        f"agent's policy off {agent_off:.0f}/s"
    )
    return free, limited, agent_off


def test_environment_cannot_switch_the_compute_limit_off(tmp_path: Path) -> None:
    """`VGPU_COMPUTE_POLICY=off` dropped the compute limit before; only the agent may."""
    free, limited, agent_off = compute_limit_rates(tmp_path / "1")
    if not (limited <= 0.6 * free and agent_off >= 1.5 * limited):
        # Rates of unheld processes fall on a machine short of CPU: measure once more, and
        # judge each run by its best figure (a held process never runs faster than its share).
        again = compute_limit_rates(tmp_path / "2")
        free, limited, agent_off = (
            max(free, again[0]),
            min(limited, again[1]),
            max(agent_off, again[2]),
        )
    assert limited <= 0.6 * free, (limited, free)
    assert agent_off >= 1.5 * limited, (agent_off, limited)
