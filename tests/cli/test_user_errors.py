"""Every user error of the CLI is a message naming what is wrong, never a traceback: run
through the installed `vgpu` entry point (the console script a user types), as a subprocess.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
VGPU = str(Path(sys.executable).parent / "vgpu")


def vgpu(*args: str) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(
        [VGPU, *args], cwd=ROOT, capture_output=True, text=True, timeout=60, check=False
    )
    assert "Traceback" not in result.stderr + result.stdout, result.stderr
    return result


@pytest.fixture
def state(tmp_path: Path) -> Path:
    """A state file of a `vgpu up` that 'runs' (this test's pid) but serves nothing: what
    the CLI says about the manifest must not depend on the system."""
    path = tmp_path / "up.json"
    path.write_text(
        '{"nats_url": "nats://127.0.0.1:1", "api_url": "http://127.0.0.1:1", '
        '"allocator_url": "", "metrics_url": "", '
        f'"kubelets": {{}}, "work_dir": "", "pid": {os.getpid()}}}'
    )
    return path


def manifest(tmp_path: Path, text: str | bytes) -> Path:
    path = tmp_path / "pod.yaml"
    if isinstance(text, bytes):
        path.write_bytes(text)
    else:
        path.write_text(text)
    return path


POD = "apiVersion: v1\nkind: Pod\nmetadata:\n  name: {name}\n  namespace: {namespace}\n" \
    "spec:\n  containers: [{{name: c, image: cuda}}]\n"  # fmt: skip


def test_the_entry_point_is_installed() -> None:
    assert os.access(VGPU, os.X_OK), VGPU
    assert vgpu("--help").returncode == 0


def test_a_binary_manifest(tmp_path: Path, state: Path) -> None:
    path = manifest(tmp_path, bytes(range(256)) * 4)
    result = vgpu("submit", str(path), "--state-file", str(state))
    assert result.returncode == 1
    assert f"{path} is not a YAML or JSON manifest: byte 128 is not UTF-8 text" in result.stderr


def test_a_binary_manifest_without_a_running_system(tmp_path: Path) -> None:
    """The file's problem is what the user must fix first; it is named before the system."""
    path = manifest(tmp_path, b"\x00\xff\xfe binary")
    result = vgpu("submit", str(path), "--state-file", str(tmp_path / "absent.json"))
    assert result.returncode == 1 and "is not a YAML or JSON manifest" in result.stderr


@pytest.mark.parametrize("namespace", ["Bad_NS", "'-x'", "'a.b'", "'" + "n" * 64 + "'", "7"])
def test_a_bad_namespace(tmp_path: Path, state: Path, namespace: str) -> None:
    path = manifest(tmp_path, POD.format(name="ok", namespace=namespace))
    result = vgpu("submit", str(path), "--state-file", str(state))
    assert result.returncode == 1
    assert "metadata.namespace: Invalid value:" in result.stderr
    assert "RFC 1123 label" in result.stderr


def test_a_bad_pod_name(tmp_path: Path, state: Path) -> None:
    path = manifest(tmp_path, POD.format(name="My_Pod", namespace="default"))
    result = vgpu("submit", str(path), "--state-file", str(state))
    assert result.returncode == 1
    assert "metadata.name: Invalid value: 'My_Pod'" in result.stderr


def test_a_missing_file_and_a_directory(tmp_path: Path, state: Path) -> None:
    missing = vgpu("submit", str(tmp_path / "nope.yaml"), "--state-file", str(state))
    assert missing.returncode == 2
    assert f"File '{tmp_path / 'nope.yaml'}' does not exist" in missing.stderr
    directory = vgpu("submit", str(tmp_path), "--state-file", str(state))
    assert directory.returncode == 2 and "is a directory" in directory.stderr


def test_an_unreadable_manifest(tmp_path: Path, state: Path) -> None:
    if os.geteuid() == 0:
        pytest.skip("root reads every file")
    path = manifest(tmp_path, POD.format(name="ok", namespace="default"))
    path.chmod(0)
    result = vgpu("submit", str(path), "--state-file", str(state))
    assert result.returncode == 1 and "cannot read" in result.stderr


def test_a_good_manifest_reaches_the_system_check(tmp_path: Path, state: Path) -> None:
    """The checks above refuse only what is wrong: a good pod gets as far as the bus."""
    path = manifest(tmp_path, POD.format(name="train-1", namespace="team-a"))
    result = vgpu("submit", str(path), "--state-file", str(state))
    assert result.returncode == 1 and "the bus (NATS at nats://127.0.0.1:1)" in result.stderr


def test_a_bad_state_file(tmp_path: Path) -> None:
    path = manifest(tmp_path, POD.format(name="ok", namespace="default"))
    junk = tmp_path / "state.json"
    junk.write_bytes(b"\xff\x00not json")
    result = vgpu("submit", str(path), "--state-file", str(junk))
    assert result.returncode == 1 and f"{junk} is not a vgpu state file" in result.stderr


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["submit", "--timeout", "soon", "x.yaml"], "Invalid value for '--timeout': 'soon'"),
        (["inspect", "--nope"], "No such option '--nope'"),
        (["frobnicate"], "No such command 'frobnicate'"),
        (["up", "--nodes", "many"], "Invalid value for '--nodes': 'many'"),
        (["up", "--mode", "shared"], "Invalid value for '--mode': 'shared'"),
        (["delete"], "Missing argument 'POD'"),
        (["delete", "-n", "Team_A", "x"], "namespace: Invalid value: 'Team_A'"),
        (["delete", "Bad/Name"], "name: Invalid value: 'Bad/Name'"),
    ],
)
def test_bad_flags_and_arguments(args: list[str], says: str) -> None:
    result = vgpu(*args)
    assert result.returncode == 2, result.stderr
    assert says in result.stderr


def test_bad_values_for_up(tmp_path: Path) -> None:
    state = str(tmp_path / "up.json")
    nodes = vgpu("up", "--nodes", "0", "--state-file", state)
    assert nodes.returncode == 1 and "at least one node, got 0" in nodes.stderr
    gpus = vgpu("up", "--simulate", "4xFOO", "--state-file", state)
    assert gpus.returncode == 1 and "unknown model 'FOO'" in gpus.stderr


def test_delete_of_an_unknown_pod_needs_a_system(tmp_path: Path, state: Path) -> None:
    """`vgpu delete` of a pod the API server does not know is covered against a running
    system in test_vgpu_delete.py; without one reachable it says so."""
    result = vgpu("delete", "nope", "--state-file", str(state))
    assert result.returncode == 1 and "the local API server is unreachable" in result.stderr
