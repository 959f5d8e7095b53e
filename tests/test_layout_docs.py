"""The layout tables cannot drift silently: every path named in the module tables of
engine/README.md, gateway/README.md, common/README.md and services/README.md exists, and every
module of those packages is named in its package's table (itself, or a folder above it)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ["engine", "gateway", "common", "services"]
# Generated at set-up, never edited: named as a folder in common/README.md.
GENERATED = ROOT / "common" / "grpc_stubs" / "folio"


def named_paths(package: str) -> set[Path]:
    """The paths (relative to the package) in the first column of the README's module tables
    (those whose first column is headed "module")."""
    named: set[Path] = set()
    in_table = False
    for line in (ROOT / package / "README.md").read_text().splitlines():
        cells = [cell.strip() for cell in line.split("|")]
        if not line.startswith("|"):
            in_table = False
        elif not in_table:
            in_table = cells[1] == "module"
        elif not set(cells[1]) <= {"-"}:
            named |= {Path(p) for p in re.findall(r"`([\w./-]+)`", cells[1])}
    return named


def modules(package: str) -> list[Path]:
    found = []
    for path in (ROOT / package).rglob("*.py"):
        if path.name == "__init__.py" or GENERATED in path.parents:
            continue
        found.append(path.relative_to(ROOT / package))
    return sorted(found)


@pytest.mark.parametrize("package", PACKAGES)
def test_every_named_path_exists(package):
    named = named_paths(package)
    assert named, f"{package}/README.md has no layout table"
    missing = sorted(str(p) for p in named if not (ROOT / package / p).exists())
    assert not missing, f"{package}/README.md names paths that do not exist: {missing}"


@pytest.mark.parametrize("package", PACKAGES)
def test_every_module_is_named(package):
    named = named_paths(package)
    unnamed = [
        str(module)
        for module in modules(package)
        if module not in named and not any(parent in named for parent in module.parents)
    ]
    assert not unnamed, f"{package}/README.md's layout table does not name {unnamed}"
