"""The documentation site (mkdocs.yml over docs/) builds in MkDocs' strict mode, so a broken link
or anchor, or a page left out of the nav, fails the suite; and strict mode does catch those."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def build(root: Path, site: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_the_site_builds_strictly(tmp_path):
    result = build(ROOT, tmp_path / "site")
    assert result.returncode == 0, result.stderr
    pages = {p.relative_to(ROOT / "docs") for p in (ROOT / "docs").rglob("*.md")}
    built = {p.relative_to(tmp_path / "site") for p in (tmp_path / "site").rglob("index.html")}
    assert {p.with_suffix("") / "index.html" for p in pages if p.stem != "index"} < built


def test_a_broken_link_or_a_page_outside_the_nav_fails_the_build(tmp_path):
    shutil.copytree(ROOT / "docs", tmp_path / "docs")
    shutil.copy(ROOT / "mkdocs.yml", tmp_path)
    (tmp_path / "docs" / "stray.md").write_text("# Not in the nav\n")
    result = build(tmp_path, tmp_path / "site")
    assert result.returncode != 0 and "stray.md" in result.stderr, result.stderr

    (tmp_path / "docs" / "stray.md").unlink()
    serving = tmp_path / "docs" / "serving.md"
    serving.write_text(serving.read_text() + "\nSee [nothing](no-such-page.md).\n")
    result = build(tmp_path, tmp_path / "site")
    assert result.returncode != 0 and "no-such-page.md" in result.stderr, result.stderr
