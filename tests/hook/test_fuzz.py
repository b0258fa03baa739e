"""The coverage-guided fuzzer of the hook's parsers (libvgpu-hook/fuzz): a short run in CI that
must find nothing and must reach code the seeds do not, and a build with a planted bug that it
must find, save and replay (so that a run finding nothing means something)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from tests.hook.harness import HOOK_DIR

FUZZ_DIR = HOOK_DIR / "build" / "fuzz"


@pytest.fixture(scope="module")
def fuzzers() -> Path:
    proc = subprocess.run(
        ["sh", str(HOOK_DIR / "fuzz" / "build.sh")], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return FUZZ_DIR


def figures(output: str) -> dict[str, float]:
    line = next(x for x in output.splitlines() if x.startswith("runs="))
    return {k: float(v) for k, v in re.findall(r"(\w+)=([\d.]+)", line)}


@pytest.mark.timeout(120)
def test_a_short_run_finds_nothing_and_reaches_past_the_seeds(
    fuzzers: Path, tmp_path: Path
) -> None:
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    proc = subprocess.run(
        [str(fuzzers / "fuzz_limits"), "-seconds=15", "-seed=1", f"-corpus={corpus}"],
        capture_output=True,
        text=True,
        timeout=100,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    got = figures(proc.stdout)
    assert got["runs"] > 1000
    assert got["corpus"] > got["seeds"] and got["edges"] > got["seed_edges"], got
    assert len(list(corpus.iterdir())) == got["corpus"]  # what it kept (seeds too), on disk
    assert not list(tmp_path.glob("crash-*"))


@pytest.mark.timeout(360)
def test_a_planted_bug_is_found_saved_and_replayed(fuzzers: Path, tmp_path: Path) -> None:
    planted = fuzzers / "fuzz_limits_planted"
    proc = subprocess.run(
        [str(planted), "-seconds=300", "-seed=5", f"-artifacts={tmp_path}/"],
        capture_output=True,
        text=True,
        timeout=330,
    )
    assert proc.returncode != 0, "the planted bug was not found in 300 s: " + proc.stdout
    assert "planted bug: a device beyond device_count" in proc.stderr
    (crash,) = tmp_path.glob("crash-*")
    assert re.search(r"device\.\d+\.", crash.read_text(errors="replace"))

    again = subprocess.run([str(planted), str(crash)], capture_output=True, text=True, timeout=30)
    assert again.returncode != 0 and "planted bug" in again.stderr
    real = subprocess.run(
        [str(fuzzers / "fuzz_limits"), str(crash)], capture_output=True, text=True, timeout=30
    )
    assert real.returncode == 0 and "replayed without failure" in real.stdout, real.stderr
