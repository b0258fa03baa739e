"""The hook never hangs a process through the loader or fork (issue 13): it is preloaded into
every process of a container, so a deadlock between its own locks and the dynamic loader's, or
a lock a forked child inherits held, hangs programs that never touch CUDA. Each test runs a C
reproducer (libvgpu-hook/tests/) under the real compiled hook, many times, each run bounded by
a timeout: a hang fails the test instead of hanging it."""

from __future__ import annotations

import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.hook.harness import SANITIZE, hook_env, limits_text, summary, tool, write_limits

RUN_TIMEOUT_S = 20.0  # one run takes milliseconds; this only has to outlast a loaded machine
PARALLEL = 4


def run_many(argv: list[str], env: dict[str, str], runs: int) -> list[str]:
    """Runs argv `runs` times, PARALLEL at a time; what went wrong in each failed run. Stops
    starting new runs after the first failure, so a hanging hook fails fast."""
    failures: list[str] = []

    def once(_: int) -> str | None:
        if failures:
            return None
        try:
            proc = subprocess.run(
                argv, env=env, capture_output=True, text=True, timeout=RUN_TIMEOUT_S
            )
        except subprocess.TimeoutExpired:
            failures.append(f"hung (no exit within {RUN_TIMEOUT_S:.0f} s)")
            return failures[-1]
        if proc.returncode != 0 or not proc.stdout.startswith("ok "):
            failures.append(f"rc={proc.returncode} stdout={proc.stdout!r} stderr={proc.stderr!r}")
            return failures[-1]
        return None

    with ThreadPoolExecutor(PARALLEL) as pool:
        list(pool.map(once, range(runs)))
    return failures


@pytest.mark.parametrize("mode", ["nocuda", "cuda"])
def test_dlsym_from_many_threads_during_dlopen_never_hangs(
    build: Path, tmp_path: Path, mode: str
) -> None:
    """Threads look symbols up while another dlopens a plugin whose constructor looks symbols
    up under the loader lock. The old interposer took a once-lock and then waited for the
    loader inside it: hung in ~1 run of 6 without CUDA, ~4 of 10 with it."""
    write_limits(tmp_path, limits_text(1024))
    env = hook_env(tmp_path)
    failures = run_many([tool("dl_race"), mode, "8"], env, runs=500)
    assert not failures, f"{len(failures)} failed run(s) of dl_race {mode}; first: {failures[0]}"


def test_dl_race_answers_driver_lookups_with_the_hook(build: Path, tmp_path: Path) -> None:
    """The reproducer is meaningful: with CUDA, its lookups go through the interposer (a
    handle lookup of cuMemAlloc_v2 returns the hook's function, found by every thread)."""
    write_limits(tmp_path, limits_text(1024))
    proc = subprocess.run(
        [tool("dl_race"), "cuda", "8"],
        env=hook_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT_S,
    )
    assert proc.returncode == 0, proc.stderr
    # 8 threads x 200 rounds: 4 of every 5 driver names exist, 3 of every 4 libc names.
    assert summary(proc)["lookups"] == 8 * (160 + 150)


@pytest.mark.skipif(
    SANITIZE, reason="ASan's own allocator lock is not held across fork: children hang in malloc"
)
def test_200_forks_of_a_busy_multithreaded_parent_never_hang(build: Path, tmp_path: Path) -> None:
    """Threads allocate, free, ask past the limit, look functions up and read NVML through the
    hook while the main thread forks 200 times; every child uses the hook (lookups, NVML,
    an allocation) and exits through its exit handlers. Children of the old hook inherited
    the table lock held by another thread and hung a few in a hundred."""
    write_limits(tmp_path, limits_text(1024))
    proc = subprocess.run(
        [tool("fork_race"), "200", "8", "cuda"],
        env=hook_env(tmp_path, VGPU_HOOK_QUIET="1"),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert summary(proc) == {"forks": 200, "hung": 0, "failed": 0}, proc.stderr[-2000:]
    assert proc.returncode == 0
