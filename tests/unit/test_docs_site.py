"""The documentation site (mkdocs.yml, docs/) builds in strict mode, and strict mode catches what it is set to catch.

    the real tree                            builds with no warning
    a copy with one internal link broken     fails, naming the link
    a copy with a page left out of nav       fails, naming the page
    docs/index.md                            shows README.md's capability table (the one copy), its links working
    scripts/docs_hooks.py                    reads GitHub-style lists (2-space nesting, no blank line) as GitHub does

Each build is `mkdocs build --strict` in a subprocess, as a user runs it, into a temporary site dir (~2 s each)."""
import html
import importlib.util
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("mkdocs", reason="mkdocs is not installed (main venv: scripts/requirements-main.txt)")
pytest.importorskip("material", reason="mkdocs-material is not installed (main venv: scripts/requirements-main.txt)")

ROOT = Path(__file__).resolve().parents[2]
HOOKS = Path("scripts") / "docs_hooks.py"


def build(root: Path, site: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")           # Material's release banner, not a build warning
    return subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(root / "mkdocs.yml"),
                           "-d", str(site)], cwd=root, env=env, capture_output=True, text=True, timeout=120)


@pytest.fixture
def copy(tmp_path):
    """The site's sources (mkdocs.yml, docs/, the hook) in a scratch tree that a test may break."""
    dst = tmp_path / "tree"
    shutil.copytree(ROOT / "docs", dst / "docs")
    shutil.copy(ROOT / "mkdocs.yml", dst / "mkdocs.yml")
    shutil.copy(ROOT / "README.md", dst / "README.md")
    (dst / HOOKS).parent.mkdir(parents=True)
    shutil.copy(ROOT / HOOKS, dst / HOOKS)
    return dst


def test_site_builds_strict(tmp_path):
    r = build(ROOT, tmp_path / "site")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "WARNING" not in r.stderr, r.stderr
    page = (tmp_path / "site" / "main_job" / "index.html").read_text()
    assert "main_job.png" in page and "kl_mean_r3" in page      # the page, its plot and its console output
    index = (tmp_path / "site" / "index.html").read_text()
    rows = re.findall(r"^\| ([^|]+?) \|.*\[[^]]+\]\(docs/([a-z_0-9]+)\.md\)", (ROOT / "README.md").read_text(), re.M)
    assert len(rows) >= 10, "README.md's capability table not found"
    for name, page in rows:                                     # README's table, once, its links into the site
        assert html.escape(name, quote=False) in index and f'href="{page}/"' in index, (name, page)


def test_broken_internal_link_fails(copy, tmp_path):
    index = copy / "docs" / "index.md"
    text = index.read_text()
    m = re.search(r"\]\(([a-z_0-9]+\.md)\)", text)
    assert m, "docs/index.md links no page"
    index.write_text(text.replace(m.group(0), "](no_such_page.md)", 1))
    r = build(copy, tmp_path / "site")
    assert r.returncode != 0, "a broken link built in strict mode"
    assert "no_such_page.md" in r.stderr and "not found" in r.stderr, r.stderr


def test_page_missing_from_nav_fails(copy, tmp_path):
    (copy / "docs" / "orphan_page.md").write_text("# A page nobody listed\n")
    r = build(copy, tmp_path / "site")
    assert r.returncode != 0, "a page missing from nav built in strict mode"
    assert "not included in the \"nav\"" in r.stderr and "orphan_page.md" in r.stderr, r.stderr


def test_hook_reads_lists_as_github_does():
    spec = importlib.util.spec_from_file_location("docs_hooks", ROOT / HOOKS)
    hooks = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hooks)
    src = "Para:\n- a\n  b\n  - nested\n- c\n\n```\nx:\n  - code\n```"
    assert hooks.normalize(src) == "Para:\n\n- a\n  b\n    - nested\n- c\n\n```\nx:\n  - code\n```"
    assert hooks.normalize("- a\n- b\n\ntext") == "- a\n- b\n\ntext"          # nothing to change: unchanged
    readme = "# T\n## Capabilities\n\n| a | [p](docs/p.md) |\n\n## Next\nx"
    page = "# I\n[the table](../README.md#capabilities)\nrest"
    assert hooks.include_readme(page, readme) == "# I\n| a | [p](p.md) |\nrest"
    with pytest.raises(ValueError, match="no section #missing"):
        hooks.include_readme("[t](../README.md#missing)", readme)
