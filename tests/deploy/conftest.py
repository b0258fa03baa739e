"""Fixtures of the deploy tests."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest


@pytest.fixture
def work_dir() -> Iterator[Path]:
    """A fresh directory with a short path: unix socket paths must stay under 108 bytes."""
    path = Path(tempfile.mkdtemp(prefix="vgpu-deploy-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)
