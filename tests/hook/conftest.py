from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.hook.harness import BUILD, build_hook


@pytest.fixture(scope="session")
def build() -> Path:
    if shutil.which("gcc") is None:
        pytest.fail("gcc is required to build libvgpu-hook and was not found on PATH")
    proc = build_hook()
    if proc.returncode != 0:
        pytest.fail(
            f"libvgpu-hook/build.sh failed ({proc.returncode}):\n{proc.stdout}{proc.stderr}"
        )
    return BUILD


@pytest.fixture
def short_dir() -> Iterator[Path]:
    """A container directory whose relay.sock path fits a unix socket address."""
    path = Path(tempfile.mkdtemp(prefix="vgpu-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)
