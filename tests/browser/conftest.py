"""Headless Debian Chromium driven by Playwright; every test here skips without them.

Playwright is only the driver: it never downloads a browser. The launch flags keep Chromium
off the network (no updates, sync, or background fetches) and out of any earlier profile.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

CHROMIUM_FLAGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
]  # fmt: skip


def chromium_binary() -> str | None:
    for candidate in (os.environ.get("VGPU_CHROMIUM"), "/usr/bin/chromium",
                      shutil.which("chromium"), shutil.which("chromium-browser")):  # fmt: skip
        if candidate and Path(candidate).is_file() and os.access(candidate, os.X_OK):
            return candidate
    return None


@pytest.fixture
async def page() -> AsyncIterator[Any]:
    binary = chromium_binary()
    if binary is None:
        pytest.skip("no chromium binary (apt-get install chromium)")
    playwright_api = pytest.importorskip("playwright.async_api")
    profile = tempfile.mkdtemp(prefix="vgpu-chromium-", dir="/tmp")
    try:
        async with playwright_api.async_playwright() as driver:
            context = await driver.chromium.launch_persistent_context(
                profile, executable_path=binary, args=CHROMIUM_FLAGS, headless=True,
                viewport={"width": 1400, "height": 900}, timeout=30_000,
            )  # fmt: skip
            try:
                tab = context.pages[0] if context.pages else await context.new_page()
                tab.set_default_timeout(15_000)
                yield tab
            finally:
                await context.close()
    finally:
        shutil.rmtree(profile, ignore_errors=True)
