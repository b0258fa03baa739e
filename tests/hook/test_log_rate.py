"""Over-limit log lines are rate-limited (issue 13): a program that retries an allocation over
its limit in a loop must not flood its stderr. The first lines print, then at most one a
second saying how many were suppressed since the last one, and at exit a last line counts
what was suppressed after it: every refusal is accounted for, in a bounded number of lines."""

from __future__ import annotations

import re
import sys
import time
from pathlib import Path

import pytest

from tests.hook.harness import limits_text, run, summary, write_limits

BURST = 10  # VGPU_LOG_BURST in libvgpu-hook/src/log.h

SCRIPT = r"""
import ctypes, sys, time
cuda = ctypes.CDLL("libcuda.so.1")
assert cuda.cuInit(0) == 0
ctx, p = ctypes.c_void_p(), ctypes.c_ulonglong()
assert cuda.cuCtxCreate_v2(ctypes.byref(ctx), 0, 0) == 0
def over_limit():
    return cuda.cuMemAlloc_v2(ctypes.byref(p), ctypes.c_size_t(2048 << 20)) == 2
refused = sum(over_limit() for _ in range(int(sys.argv[1])))
time.sleep(float(sys.argv[2]))
refused += over_limit()
print(f"refused={refused}", flush=True)
"""

OOM = "vgpu-hook: out of memory on device 0: used 0 MiB + asked 2048 MiB > limit 1024 MiB"


def accounted(stderr: str) -> tuple[int, int, list[str]]:
    """(lines printed, refusals those lines account for, the lines)."""
    lines = [line for line in stderr.splitlines() if "out of memory on device" in line]
    total = 0
    for line in lines:
        if line.startswith(OOM):
            total += 1
            since = re.search(r"\((\d+) more suppressed since the last one\)$", line)
            total += int(since.group(1)) if since else 0
        else:
            at_exit = re.fullmatch(
                r'vgpu-hook: (\d+) more "out of memory on device" lines suppressed', line
            )
            assert at_exit, line
            total += int(at_exit.group(1))
    return len(lines), total, lines


@pytest.mark.parametrize("pause_s", [0.0, 1.5])
def test_10000_refusals_write_a_bounded_number_of_lines(
    build: Path, tmp_path: Path, pause_s: float
) -> None:
    write_limits(tmp_path, limits_text(1024))
    started = time.monotonic()
    proc = run([sys.executable, "-c", SCRIPT, "10000", str(pause_s)], tmp_path)
    elapsed = time.monotonic() - started
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert summary(proc) == {"refused": 10001}
    printed, total, lines = accounted(proc.stderr)
    assert total == 10001, lines
    # The burst, one a second after it, and the count at exit.
    assert BURST <= printed <= BURST + int(elapsed) + 2, lines
    assert lines[BURST - 1].endswith("(more of these: at most one a second)")
    if pause_s:
        # A second after the last printed line the next refusal prints again, with the count.
        assert re.search(r"\((\d+) more suppressed since the last one\)$", lines[-1]), lines
