"""One build and run of the hook's tests with AddressSanitizer and UndefinedBehaviorSanitizer:
the C unit tests and every end-to-end test except the timing-heavy limiter measurements (whose
launch paths the relay tests still exercise). Skipped when already running sanitized."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.hook.harness import HOOK_DIR, ROOT, SANITIZE, build_hook


@pytest.mark.skipif(SANITIZE, reason="this run is already the sanitized one")
@pytest.mark.timeout(700)  # a build and a run of most hook tests; the run itself stops at 600 s
def test_hook_tests_pass_under_asan_and_ubsan(build: Path) -> None:
    proc = build_hook(HOOK_DIR / "build" / "sanitize", sanitize=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    here = Path(__file__).parent
    files = ["test_hook.py", "test_paths.py", "test_sharing.py", "test_nvml.py", "test_relay.py",
             "test_virtual_memory.py"]  # fmt: skip
    tests = [str(here / f) for f in files]
    tests.append(str(here / "test_limiter.py::test_launch_count_reaches_the_region"))
    lifetimes = here / "test_memory_lifetime.py"
    for case in (
        "vmm_stays_charged_until_released_and_unmapped[link]",
        "a_pool_is_charged_what_it_keeps_until_trimmed[link]",
        "async_allocation_is_charged_to_the_streams_device[link]",
        "graph_memory_is_charged_to_the_executable_graph[flags-link]",
        "context_limits_are_charged[link]",
        "a_shared_vmm_allocation_is_counted_once_in_the_container[link]",
    ):
        tests.append(f"{lifetimes}::test_{case}")
    tests.append(
        str(here / "test_loader_fork.py::test_dl_race_answers_driver_lookups_with_the_hook")
    )
    tests.append(
        str(here / "test_nvml_processes.py::test_nvml_lists_only_the_containers_processes")
    )
    tests.append(str(here / "test_log_rate.py"))
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *tests],
        env={**os.environ, "SANITIZE": "1"},
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    tail = "\n".join(proc.stdout.splitlines()[-30:])
    assert proc.returncode == 0, f"{tail}\n{proc.stderr[-3000:]}"
    assert " passed" in tail
