"""Settings merge file < environment < flags, and name what is wrong."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest

from services.common.config import ConfigError, load_settings


class Example(msgspec.Struct, kw_only=True):
    nats_url: str = "nats://127.0.0.1:4222"
    http_port: int = 8080
    node_timeout_s: float = 15.0


def test_file_then_env_then_flags(tmp_path: Path) -> None:
    config = tmp_path / "vgpu.yaml"
    config.write_text("example:\n  http_port: 9000\n  node_timeout_s: 3\n")
    env = {"VGPU_HTTP_PORT": "9100", "VGPU_NATS_URL": "nats://env:4222"}
    settings = load_settings(
        Example, section="example", file=config, environ=env, overrides={"nats_url": None,
                                                                          "node_timeout_s": 1.5},
    )  # fmt: skip
    assert settings == Example(nats_url="nats://env:4222", http_port=9100, node_timeout_s=1.5)


def test_top_level_keys_apply_when_there_is_no_section(tmp_path: Path) -> None:
    config = tmp_path / "vgpu.yaml"
    config.write_text("http_port: 7000\nother_service:\n  x: 1\n")
    assert load_settings(Example, section="example", file=config, environ={}).http_port == 7000


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("example:\n  http_port: many\n", r"invalid example setting: .*http_port"),
        ("example:\n  colour: blue\n", "unknown example setting"),
        ("example: [unclosed\n", "not valid YAML"),
        ("- a list\n", "expected a mapping"),
    ],
)
def test_bad_settings_are_named(tmp_path: Path, content: str, message: str) -> None:
    config = tmp_path / "vgpu.yaml"
    config.write_text(content)
    with pytest.raises(ConfigError, match=message):
        load_settings(Example, section="example", file=config, environ={})


def test_missing_file_is_named(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"cannot read config file .*absent\.yaml"):
        load_settings(Example, section="example", file=tmp_path / "absent.yaml", environ={})
