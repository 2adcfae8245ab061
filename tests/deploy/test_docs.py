"""The documentation: the mkdocs site builds with --strict (no warning: broken links and anchors, pages left out of
the nav, generated reference pages that fail), and the README stays a front page whose links resolve."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
FRONT_PAGES = ["README.md", "control_plane/README.md", "services/README.md", "workers/README.md", "protos/README.md",
               "tests/README.md", "deploy/README.md", "deploy/docker/README.md"]


def relative_links(path: Path) -> list[str]:
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)  # not in code blocks
    return [link for link in LINK.findall(text) if not re.match(r"[a-z]+:|#", link)]


@pytest.mark.timeout(120)
def test_the_site_builds_strict_without_warnings(tmp_path):
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file",
                           str(ROOT / "mkdocs.yml"), "--site-dir", str(tmp_path / "site")],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=110)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-5000:]
    assert "WARNING" not in output, output[-5000:]
    site = tmp_path / "site"
    for page in ("index.html", "reference/configuration.html", "reference/metrics.html",
                 "reference/span-attributes.html", "reference/reason-codes.html", "deploying/kubernetes.html"):
        assert (site / page).is_file(), page
    assert "kvshuttle_turns_total" in (site / "reference/metrics.html").read_text()
    assert not list(site.rglob("*.py")), "the hook must not be published"


def test_the_readme_is_a_front_page():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 200, f"README.md has {len(lines)} lines: move detail into docs/"
    assert any("docs/" in link for link in relative_links(ROOT / "README.md"))


@pytest.mark.parametrize("page", FRONT_PAGES)
def test_relative_links_resolve(page):
    path = ROOT / page
    for link in relative_links(path):
        target = (path.parent / link.split("#", 1)[0]).resolve()
        assert target.exists(), f"{page}: link {link!r} points to nothing"
        assert ROOT in target.parents or target == ROOT, f"{page}: link {link!r} leaves the repository"
