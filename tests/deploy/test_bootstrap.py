"""scripts/bootstrap.sh installs once per change of pyproject.toml, and `./scripts/up.sh`
(no extras) reuses what `./scripts/test.sh` (the test extras) installed.

The script runs for real with `sh`, in a copy of the layout it expects; only the
interpreter it calls is a recorder of the pip commands it is given (pip itself is not vgpu's,
and installing for real would take minutes and the network)."""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RECORDER = """#!/bin/sh
echo "$*" >> "$(dirname "$0")/../calls.log"
"""


def layout(tmp_path: Path) -> Path:
    (tmp_path / "scripts").mkdir()
    shutil.copy(ROOT / "scripts" / "bootstrap.sh", tmp_path / "scripts" / "bootstrap.sh")
    (tmp_path / "pyproject.toml").write_text("[project]\nname = 'vgpu'\n")
    (tmp_path / "libvgpu-hook").mkdir()
    (tmp_path / "libvgpu-hook" / "build.sh").write_text("echo built >> .venv/calls.log\n")
    python = tmp_path / ".venv" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text(RECORDER)
    python.chmod(0o755)
    return tmp_path


def bootstrap(root: Path, extras: str = "") -> list[str]:
    env = {**os.environ, "VGPU_EXTRAS": extras}
    subprocess.run(["sh", "scripts/bootstrap.sh"], cwd=root, env=env, check=True, timeout=30)
    calls = (root / ".venv" / "calls.log").read_text().splitlines()
    (root / ".venv" / "calls.log").unlink()
    return [c for c in calls if "install" in c and "-e" in c]


def test_up_reuses_what_test_installed(tmp_path: Path) -> None:
    root = layout(tmp_path)
    assert bootstrap(root, "test") == [
        "-m pip install --quiet --disable-pip-version-check -e .[test]"
    ]
    assert bootstrap(root, "test") == []  # installed once
    assert bootstrap(root) == []  # scripts/up.sh after scripts/test.sh: nothing to install


def test_a_changed_pyproject_installs_again(tmp_path: Path) -> None:
    root = layout(tmp_path)
    assert bootstrap(root, "test")
    earlier = time.time() - 60  # the install predates the edit of pyproject.toml
    os.utime(root / ".venv" / ".installed-test", (earlier, earlier))
    assert bootstrap(root) == ["-m pip install --quiet --disable-pip-version-check -e ."]
    assert bootstrap(root) == []


def test_test_extras_are_not_taken_for_granted_after_a_plain_install(tmp_path: Path) -> None:
    root = layout(tmp_path)
    assert bootstrap(root)
    assert bootstrap(root, "test") == [
        "-m pip install --quiet --disable-pip-version-check -e .[test]"
    ]
