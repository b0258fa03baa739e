"""The Dockerfiles, their build context and the hook installer, checked without a Docker daemon.

hadolint lints them; Docker's own parser (the `dockerfile` package) reads them to check that
every base image is pinned, every file they copy is in the build context that .dockerignore
leaves, and the services image runs as non-root. install-hook.sh runs for real against
temporary directories, with the libvgpu.so the test setup builds.
"""

from __future__ import annotations

import os
import re
import shutil
import stat
import subprocess
import sys
import sysconfig
import tomllib
from pathlib import Path

import dockerfile
import pytest
from packaging.requirements import Requirement

from tests.deploy.manifests import REPO

IMAGES = REPO / "deploy" / "images"
DOCKERFILES = sorted(IMAGES.glob("*.Dockerfile"))
CONSTRAINTS = IMAGES / "constraints.txt"
INSTALL_HOOK = IMAGES / "install-hook.sh"
HOOK_LIBRARY = REPO / "libvgpu-hook" / "build" / "libvgpu.so"


def _tool(name: str) -> str:
    for directory in (sysconfig.get_path("scripts"), str(Path(sys.executable).parent)):
        if (Path(directory) / name).is_file():
            return str(Path(directory) / name)
    found = shutil.which(name)
    if found is None:
        pytest.fail(f"{name} not found: install the test extras (pip install -e '.[test]')")
    return found


def test_both_images_exist() -> None:
    assert [p.name for p in DOCKERFILES] == ["hook.Dockerfile", "services.Dockerfile"]


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.name)
def test_hadolint_is_clean(path: Path) -> None:
    result = subprocess.run(
        [_tool("hadolint"), "--no-color", str(path)],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr


def _resolve(value: str, args: dict[str, str]) -> str:
    return re.sub(r"\$\{(\w+)\}", lambda m: args[m.group(1)], value)


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.name)
def test_base_images_are_pinned(path: Path) -> None:
    args: dict[str, str] = {}
    stages: set[str] = set()
    for command in dockerfile.parse_file(str(path)):
        if command.cmd == "ARG" and "=" in command.value[0]:
            name, _, default = command.value[0].partition("=")
            args.setdefault(name, default)
        elif command.cmd == "FROM":
            image = _resolve(command.value[0], args)
            if image in stages:
                continue
            name, _, tag = image.rpartition(":")
            assert name and tag and tag != "latest", f"{path.name}: {image} is not pinned"
            assert re.search(r"\d", tag), f"{path.name}: {image} names no version"
            if len(command.value) == 3:
                stages.add(command.value[2])
        elif command.cmd == "COPY" and command.flags:
            source_stage = command.flags[0].removeprefix("--from=")
            assert source_stage in stages, f"{path.name}: no stage {source_stage}"


def _ignored(relative: str, patterns: list[str]) -> bool:
    """Docker's rule: the last pattern matching the path or one of its parents decides."""
    parts = relative.split("/")
    candidates = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    ignored = False
    for raw in patterns:
        negate = raw.startswith("!")
        pattern = raw.removeprefix("!").strip("/")
        regex = re.escape(pattern).replace(r"\*\*", ".*").replace(r"\*", "[^/]*")
        regex = regex.replace(r"\?", "[^/]")
        if any(re.fullmatch(regex, c) for c in candidates):
            ignored = not negate
    return ignored


def _dockerignore() -> list[str]:
    lines = (REPO / ".dockerignore").read_text().splitlines()
    return [line.strip() for line in lines if line.strip() and not line.startswith("#")]


def test_dockerignore_matcher_follows_docker() -> None:
    patterns = ["*", "!services", "**/__pycache__", "libvgpu-hook/build", "!libvgpu-hook"]
    assert _ignored(".venv/bin/python", patterns)
    assert not _ignored("services/cli/main.py", patterns)
    assert _ignored("services/cli/__pycache__/main.cpython-311.pyc", patterns)
    assert not _ignored("libvgpu-hook/build/libvgpu.so", patterns)  # the later "!" wins


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.name)
def test_copied_files_are_in_the_build_context(path: Path) -> None:
    patterns = _dockerignore()
    for command in dockerfile.parse_file(str(path)):
        if command.cmd != "COPY" or command.flags:
            continue
        for source in command.value[:-1]:
            assert (REPO / source).exists(), f"{path.name}: {source} does not exist"
            assert not _ignored(source, patterns), f"{path.name}: .dockerignore drops {source}"
    # Nothing large or private travels: no virtualenv, git, or build outputs.
    for private in (".venv/bin/python", ".git/HEAD", "libvgpu-hook/build/libvgpu.so",
                    "tests/conftest.py", "services/cli/__pycache__/x.pyc"):  # fmt: skip
        assert _ignored(private, patterns), private


def test_services_image_runs_vgpu_as_non_root() -> None:
    commands = dockerfile.parse_file(str(IMAGES / "services.Dockerfile"))
    final = commands[max(i for i, c in enumerate(commands) if c.cmd == "FROM") :]
    users = [c.value[0] for c in final if c.cmd == "USER"]
    assert users and users[-1].split(":")[0] not in ("0", "root")
    assert [c.value for c in final if c.cmd == "ENTRYPOINT"] == [("vgpu",)]
    installs = [c.value[0] for c in commands if c.cmd == "RUN" and "pip install" in c.value[0]]
    assert all("--constraint /src/constraints.txt" in line for line in installs[1:])


def _pins() -> dict[str, str]:
    pins: dict[str, str] = {}
    for line in CONSTRAINTS.read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            name, _, version = line.partition("==")
            assert version and re.fullmatch(r"[\w.+-]+", version), f"not a pin: {line}"
            pins[name.lower().replace("_", "-")] = version
    return pins


def test_runtime_dependencies_are_pinned_within_pyproject() -> None:
    pins = _pins()
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    for dependency in project["dependencies"]:
        requirement = Requirement(dependency)
        name = requirement.name.lower().replace("_", "-")
        assert name in pins, f"{name} is not pinned in {CONSTRAINTS.name} (see its header)"
        assert requirement.specifier.contains(pins[name]), (
            f"{name}=={pins[name]} in {CONSTRAINTS.name} does not satisfy {dependency}"
        )


def _install_hook(tmp: Path, **env: str) -> subprocess.CompletedProcess[str]:
    environ = {"PATH": os.environ["PATH"], "VGPU_HOOK_SOURCE": str(HOOK_LIBRARY),
               "VGPU_HOOK_DIR": str(tmp / "usr/local/vgpu"),
               "VGPU_CONTAINER_ROOT": str(tmp / "var/lib/vgpu/containers"), **env}  # fmt: skip
    return subprocess.run(
        ["sh", str(INSTALL_HOOK)], env=environ, capture_output=True, text=True, timeout=30,
        check=False,
    )  # fmt: skip


@pytest.fixture
def hook_library() -> Path:
    if not HOOK_LIBRARY.is_file():
        subprocess.run(["sh", str(REPO / "libvgpu-hook" / "build.sh")], check=True,
                       capture_output=True, timeout=300)  # fmt: skip
    return HOOK_LIBRARY


def test_install_hook_installs_both_files(tmp_path: Path, hook_library: Path) -> None:
    result = _install_hook(tmp_path)
    assert result.returncode == 0, result.stderr
    library = tmp_path / "usr/local/vgpu/libvgpu.so"
    preload = tmp_path / "var/lib/vgpu/containers/ld.so.preload"
    assert library.read_bytes() == hook_library.read_bytes()
    assert stat.S_IMODE(library.stat().st_mode) == 0o755
    # The path where the node agent mounts the hook inside GPU containers.
    assert preload.read_text() == "/usr/local/vgpu/libvgpu.so\n"
    assert stat.S_IMODE(preload.stat().st_mode) == 0o644
    assert sorted(p.name for p in library.parent.iterdir()) == ["libvgpu.so"]  # no leftovers
    assert sorted(p.name for p in preload.parent.iterdir()) == ["ld.so.preload"]


def test_install_hook_replaces_only_a_changed_library(tmp_path: Path, hook_library: Path) -> None:
    assert _install_hook(tmp_path).returncode == 0
    library = tmp_path / "usr/local/vgpu/libvgpu.so"
    inode = library.stat().st_ino
    again = _install_hook(tmp_path)
    assert again.returncode == 0 and "up to date" in again.stdout
    assert library.stat().st_ino == inode  # untouched: running containers keep their mapping
    newer = tmp_path / "newer.so"
    newer.write_bytes(hook_library.read_bytes() + b"\0")
    assert _install_hook(tmp_path, VGPU_HOOK_SOURCE=str(newer)).returncode == 0
    assert library.stat().st_ino != inode  # a new file renamed over the old one
    assert library.read_bytes() == newer.read_bytes()


def test_install_hook_refuses_bad_input(tmp_path: Path, hook_library: Path) -> None:
    missing = _install_hook(tmp_path, VGPU_HOOK_SOURCE=str(tmp_path / "nope.so"))
    assert missing.returncode == 1 and "no hook library at" in missing.stderr
    host_etc = _install_hook(tmp_path, VGPU_CONTAINER_ROOT="/etc")
    assert host_etc.returncode == 1 and "refusing to write under /etc" in host_etc.stderr
    relative = _install_hook(tmp_path, VGPU_HOOK_DIR="usr/local/vgpu")
    assert relative.returncode == 1 and "must be an absolute path" in relative.stderr
