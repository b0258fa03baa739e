"""The layering rules of docs/architecture.md, checked on every module's imports."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SERVICES = Path(__file__).resolve().parents[1] / "services"
# What each package may import from services.* besides itself and services.common.
ALLOWED: dict[str, set[str]] = {
    "common": set(),
    "allocator": set(),
    "nodeagent": set(),
    "metrics": set(),
    "simulators": set(),
    # Replays traces through the allocator's placement core; the through-scheduler replay
    # assembles the real services (allocator, node agent publisher, API server, scheduler).
    "simulate": {"allocator", "nodeagent", "simulators"},
    "cli": {"allocator", "nodeagent", "metrics", "simulators", "simulate"},  # the app layer
}


def imported_packages(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module]
        for name in names:
            parts = name.split(".")
            if parts[0] == "services" and len(parts) > 1:
                found.add(parts[1])
    return found


def test_every_package_has_a_rule() -> None:
    packages = {p.name for p in SERVICES.iterdir() if (p / "__init__.py").exists()}
    assert packages == set(ALLOWED)


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_no_package_imports_what_its_layer_forbids(package: str) -> None:
    allowed = ALLOWED[package] | {package} | ({"common"} if package != "common" else set())
    offenders = {
        str(path.relative_to(SERVICES)): sorted(imported_packages(path) - allowed)
        for path in (SERVICES / package).rglob("*.py")
        if imported_packages(path) - allowed
    }
    assert not offenders, f"forbidden imports: {offenders}"
