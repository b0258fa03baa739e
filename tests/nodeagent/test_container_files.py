"""The container's directory as the agent prepares it (container_files.py), on a real fs."""

from __future__ import annotations

import re
import stat
import struct
from pathlib import Path

import pytest

from services.nodeagent.container_files import (
    REGION_MAGIC,
    HookSettings,
    config_dir,
    limits_path,
    prepare,
    state_dir,
)
from services.nodeagent.settings import NodeAgentSettings, check_settings, hook_settings


def test_the_region_magic_is_the_hooks() -> None:
    header = Path(__file__).parents[2] / "libvgpu-hook" / "src" / "region.h"
    found = re.search(r"#define VGPU_REGION_MAGIC (0x[0-9a-f]+)ull", header.read_text())
    assert found and int(found.group(1), 16) == REGION_MAGIC


def mode(path: Path) -> int:
    return stat.S_IMODE(path.lstat().st_mode)


def test_prepare_lays_out_the_two_mounts(tmp_path: Path) -> None:
    host_dir = tmp_path / "0123456789abcdef"
    prepare(host_dir, HookSettings(limit_wait_ms=2500, compute_policy="hard"))
    assert (mode(host_dir), mode(config_dir(host_dir)), mode(state_dir(host_dir))) == (
        0o700,
        0o755,
        0o1777,
    )
    conf = (config_dir(host_dir) / "hook.conf").read_text()
    assert conf.splitlines()[1:] == ["version=1", "limit_wait_ms=2500", "compute_policy=hard"]
    region = state_dir(host_dir) / "hook.region"
    assert struct.unpack("<QII", region.read_bytes()) == (0x3147455255504756, 0, 0)
    assert mode(region) == 0o666


def test_prepare_resets_what_an_earlier_container_left(tmp_path: Path) -> None:
    host_dir = tmp_path / "key"
    prepare(host_dir, HookSettings())
    limits_path(host_dir).write_text("version=1\ndevice_count=0\n")  # the earlier container's
    region = state_dir(host_dir) / "hook.region"
    region.write_bytes(bytes(4096))  # grown, then zeroed by the earlier container
    prepare(host_dir, HookSettings())
    assert not limits_path(host_dir).exists()
    assert len(region.read_bytes()) == 16


def test_a_planted_symlink_never_receives_the_agents_modes(tmp_path: Path) -> None:
    """Root in the container can swap names in the state directory; the agent writes the
    region's mode through its open file, and renames over whatever is there."""
    host_dir = tmp_path / "key"
    prepare(host_dir, HookSettings())
    victim = tmp_path / "host-file"
    victim.write_text("secret")
    victim.chmod(0o600)
    region = state_dir(host_dir) / "hook.region"
    region.unlink()
    region.symlink_to(victim)
    prepare(host_dir, HookSettings())
    assert mode(victim) == 0o600 and victim.read_text() == "secret"
    assert not region.is_symlink()


@pytest.mark.parametrize(
    ("fields", "problem"),
    [
        ({"compute_policy": "fair"}, "compute policy must be one of share, hard, off"),
        ({"limit_wait_ms": 600_001}, "limit wait must be 0 to 600000 ms"),
    ],
)
def test_bad_hook_settings_are_refused(fields: dict[str, object], problem: str) -> None:
    with pytest.raises(ValueError, match=problem):
        HookSettings(**fields)  # type: ignore[arg-type]


def test_the_agent_settings_give_the_hook_its_wait_and_policy() -> None:
    settings = NodeAgentSettings(node_name="n", resolve_timeout_s=12.5, compute_policy="off")
    check_settings(settings)
    assert hook_settings(settings) == HookSettings(limit_wait_ms=12500, compute_policy="off")
    with pytest.raises(ValueError, match="compute_policy must be one of share, hard, off"):
        check_settings(NodeAgentSettings(node_name="n", compute_policy="none"))
