"""A long coverage-guided fuzz of the hook's parsers (limit file, hook.conf, relay `util` lines).

Builds libvgpu-hook/fuzz (gcc's trace-pc coverage, ASan + UBSan) and runs it for --seconds
(CI runs 15 s in tests/hook/test_fuzz.py). A finding stops the run, is saved as
libvgpu-hook/build/fuzz/crash-<hash> and fails this script; the figures go to
docs/benchmarks.md.

    .venv/bin/python -m bench.fuzz_hook_parsers [--seconds 600] [--seed 1]
"""

from __future__ import annotations

import argparse
import platform
import re
import subprocess
import sys
import tempfile
from pathlib import Path

from bench.report import write_section

HOOK_DIR = Path(__file__).resolve().parent.parent / "libvgpu-hook"
FUZZ_DIR = HOOK_DIR / "build" / "fuzz"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=600.0)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    subprocess.run(["sh", str(HOOK_DIR / "fuzz" / "build.sh")], check=True, capture_output=True)
    with tempfile.TemporaryDirectory() as corpus:
        proc = subprocess.run(
            [
                str(FUZZ_DIR / "fuzz_limits"),
                f"-seconds={args.seconds}",
                f"-seed={args.seed}",
                f"-corpus={corpus}",
                f"-artifacts={FUZZ_DIR}/",
            ],
            capture_output=True,
            text=True,
        )
    if proc.returncode != 0:
        print(proc.stdout + proc.stderr, file=sys.stderr)
        sys.exit(f"the fuzzer found a failing input (exit {proc.returncode}); see above")
    line = next(x for x in proc.stdout.splitlines() if x.startswith("runs="))
    got = dict(re.findall(r"(\w+)=([\d.]+)", line))
    report = "\n".join(
        [
            "### libvgpu-hook: fuzzing the parsers",
            "",
            f"`.venv/bin/python -m bench.fuzz_hook_parsers --seconds {args.seconds:.0f} "
            f"--seed {args.seed}` on {platform.machine()}: libvgpu-hook/fuzz's coverage-guided "
            "engine (gcc `-fsanitize-coverage=trace-pc` edges with hit-count classes, "
            "AddressSanitizer and UndefinedBehaviorSanitizer) feeding every input to the limit "
            "file parser, the hook.conf parser and the relay's `util` line parser, with checks "
            "that an accepted file describes an enforceable slice and a refused one names the "
            "file and the problem.",
            "",
            "| runs | seconds | inputs/s | edges (seeds alone) | corpus (seeds) | findings |",
            "|---|---|---|---|---|---|",
            f"| {int(got['runs']):,} | {float(got['seconds']):.0f} | "
            f"{int(got['execs_per_second']):,} | {got['edges']} ({got['seed_edges']}) | "
            f"{got['corpus']} ({got['seeds']}) | none |",
        ]
    )
    print(report)
    write_section("hook-fuzz", report)


if __name__ == "__main__":
    main()
