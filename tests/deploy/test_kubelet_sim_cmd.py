"""`vgpu kubelet-sim`: the compose stack's kubelet simulator as a command of its own.

Its normal run (sockets served, a node agent registering, a clean stop on SIGTERM) is part
of test_compose.py's run of the stack; here, bad input gets a clear error and no hang.
"""

from __future__ import annotations

from pathlib import Path

from click.testing import CliRunner

from services.cli.main import main as vgpu


def test_a_missing_node_name_is_named() -> None:
    result = CliRunner().invoke(vgpu, ["kubelet-sim"], env={"NODE_NAME": "", "VGPU_NODE_NAME": ""})
    assert result.exit_code == 1
    assert "node_name" in result.output


def test_a_bad_setting_is_named() -> None:
    result = CliRunner().invoke(
        vgpu, ["kubelet-sim", "--node-name", "n1"], env={"VGPU_HTTP_PORT": "eighty"}
    )
    assert result.exit_code == 1
    assert "http_port" in result.output


def test_an_unusable_socket_directory_is_an_error_not_a_hang(work_dir: Path) -> None:
    blocker = work_dir / "file"
    blocker.write_text("not a directory")
    result = CliRunner().invoke(
        vgpu,
        ["kubelet-sim", "--node-name", "n1", "--plugin-dir", str(blocker / "plugins"),
         "--pod-resources-socket", str(work_dir / "pr" / "kubelet.sock"), "--http-port", "0"],
    )  # fmt: skip
    assert result.exit_code == 1
    assert "Error" in result.output
