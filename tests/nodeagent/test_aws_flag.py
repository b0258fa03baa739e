"""AWS's virtual GPU plugin's DaemonSet argument `--vgpu=10` on `vgpu node-agent`: the number
of vGPUs (device IDs) each GPU advertises, as in AWS's plugin."""

from __future__ import annotations

from click.testing import CliRunner

from services.cli import main as cli
from services.nodeagent.settings import NodeAgentSettings


def settings_of(*args: str) -> NodeAgentSettings:
    captured: dict[str, NodeAgentSettings] = {}

    def capture(service: object, *_: object) -> None:
        captured["settings"] = service._settings  # type: ignore[attr-defined]

    original = cli._serve
    cli._serve = capture  # type: ignore[assignment]
    try:
        result = CliRunner().invoke(
            cli.main, ["node-agent", "--node-name", "n", "--simulate", "1xT4", *args]
        )
    finally:
        cli._serve = original  # type: ignore[assignment]
    assert result.exit_code == 0, result.output
    return captured["settings"]


def test_awss_vgpu_flag_is_the_split_count() -> None:
    assert settings_of("--vgpu=10").split_count == 10  # AWS's manifest, as written
    assert settings_of("--vgpu", "4").split_count == 4
    assert settings_of().split_count == 10  # AWS's default too
