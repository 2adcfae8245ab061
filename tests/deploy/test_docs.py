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


# Code paths named in backticks (`services/store/history.py`, `tests/e2e/`) in the READMEs and docs/*.md must exist,
# relative to the repository root or to the page's folder. What counts as one (code_paths), explicitly:
# - inline code outside fenced blocks, the whole span one token (no whitespace: a span with a space is a command);
#   a `path::name` or `path:line` suffix is dropped (`services/devtools/etcd_process.py::RETENTION_ARGS`);
# - starting with a top-level folder of the repository (CODE_ROOTS), so `var/...` runtime paths, `/dev/shm` and
#   module names (`kvshuttle.v1`) are never checked;
# - ending in "/" (a folder) or in one of CODE_SUFFIXES (a file);
# - left out: globs (`*`), placeholders (`<`, `>`, `{`, `}`, `...`, `$`) and URLs (`://`).
CODE_ROOTS = ("protos/", "services/", "control_plane/", "workers/", "deploy/", "tests/", "docs/", "scripts/", ".ci/")
CODE_SUFFIXES = (".py", ".proto", ".yaml", ".yml", ".json", ".md", ".sh", ".toml", ".tpl", ".txt")
PLACEHOLDER = re.compile(r"[*<>{}$]|\.\.\.|://")
CODE_SPAN = re.compile(r"(?<!`)`([^`\n]+)`(?!`)")
DOC_PAGES = FRONT_PAGES + sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md"))
# Paths allowed to be missing for now: to be emptied (a path listed here that exists again fails the test, so that
# it is removed). These slow unit tests are moving from tests/unit/ to tests/slow/ in a change made at the same
# time as this check; that change updates the pages that name them.
NOT_YET_UPDATED: dict[str, set[str]] = {}


def code_paths(text: str) -> list[str]:
    """The repository paths named in inline code in markdown ``text`` (the rules above)."""
    text = re.sub(r"```.*?```", "", text, flags=re.S)
    out = []
    for span in CODE_SPAN.findall(text):
        token = re.sub(r"(::[\w.]+|:\d+)$", "", span.strip())
        if (not token or any(c.isspace() for c in token) or PLACEHOLDER.search(token)
                or not token.startswith(CODE_ROOTS) or not (token.endswith("/") or token.endswith(CODE_SUFFIXES))):
            continue
        out.append(token)
    return out


def missing_code_paths(page: Path, root: Path = ROOT) -> list[str]:
    """The code paths ``page`` names that exist neither under ``root`` nor next to the page."""
    return [token for token in code_paths(page.read_text())
            if not (root / token).exists() and not (page.parent / token).exists()]


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


@pytest.mark.parametrize("page", DOC_PAGES)
def test_code_paths_in_backticks_exist(page):
    found = set(missing_code_paths(ROOT / page))
    missing = found - NOT_YET_UPDATED.get(page, set())
    assert not missing, f"{page} names code paths that do not exist: {sorted(missing)}"
    fixed = NOT_YET_UPDATED.get(page, set()) - found
    assert not fixed, f"{page} no longer names missing {sorted(fixed)}: remove them from NOT_YET_UPDATED"


def test_the_code_path_check_finds_a_missing_path_and_only_paths(tmp_path):
    (tmp_path / "services" / "store").mkdir(parents=True)
    (tmp_path / "services" / "store" / "history.py").write_text("")
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "page.md").write_text("")
    page = tmp_path / "docs" / "guide.md"
    page.write_text(
        "Real: `services/store/history.py`, `services/store/`, `services/store/history.py::open_history`, "
        "`page.md`, `docs/page.md`.\n"
        "Missing: `services/store/made_up_history.py` and `control_plane/nowhere/`.\n"
        "Not paths: `services/*/README.md`, `var/stack/registry/history.db`, `services/<name>/server.py`, "
        "`kvshuttle.services`, `python -m services/x.py`, `https://example.com/services/x.py`, `services/x.py{,c}`, "
        "`protos/gen`, `make test`.\n"
        "```\nservices/in_a_code_block.py `services/also_in_a_block.py`\n```\n")
    assert code_paths(page.read_text()) == ["services/store/history.py", "services/store/", "services/store/history.py",
                                            "docs/page.md", "services/store/made_up_history.py",
                                            "control_plane/nowhere/"]
    assert missing_code_paths(page, tmp_path) == ["services/store/made_up_history.py", "control_plane/nowhere/"]
