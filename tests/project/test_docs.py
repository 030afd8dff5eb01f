"""The manual: a short README whose links resolve, and a docs site that builds with --strict, so a
broken link or anchor, or a page missing from the nav, fails the suite."""

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}


def build(root: Path, site: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(root / "mkdocs.yml"),
                           "-d", str(site)], capture_output=True, text=True, timeout=300, env=ENV)


def test_the_docs_site_builds_with_strict(tmp_path):
    out = build(ROOT, tmp_path / "site")
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert (tmp_path / "site" / "configuration" / "index.html").is_file()


def test_a_broken_link_or_anchor_fails_the_build(tmp_path):
    shutil.copytree(ROOT / "docs", tmp_path / "docs")
    shutil.copy(ROOT / "mkdocs.yml", tmp_path / "mkdocs.yml")
    with (tmp_path / "docs" / "known-limits.md").open("a") as f:
        f.write("\n[gone](no-such-page.md) and [no anchor](running.md#no-such-anchor)\n")
    out = build(tmp_path, tmp_path / "site")
    assert out.returncode != 0
    assert "no-such-page.md" in out.stderr and "no-such-anchor" in out.stderr


def test_every_docs_page_is_in_the_nav():
    nav = (ROOT / "mkdocs.yml").read_text()
    pages = sorted(p.name for p in (ROOT / "docs").glob("*.md"))
    assert [p for p in pages if f": {p}" not in nav] == []


def test_the_readme_is_short_and_its_links_resolve():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 220
    targets = re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", readme)
    assert targets and [t for t in targets if not t.startswith("http") and not (ROOT / t).exists()] == []
    assert "ruff check . && python -m pytest -q --durations=20 tests" in readme  # the command CI runs
