"""Print the requirements of pyproject.toml's `dependencies` plus the named extras, one per line (a requirements file).

The images install these first, in a layer of their own, and the project itself (`pip install --no-deps .`) after
copying its code: a code change then rebuilds a small layer, not the gigabytes of torch and vLLM. The versions stay in
pyproject.toml only.

    python deploy/docker/requirements.py pyproject.toml [EXTRA ...] > requirements.txt
"""

from __future__ import annotations

import sys
import tomllib
from pathlib import Path


def requirements(pyproject: str | Path, extras: list[str]) -> list[str]:
    project = tomllib.loads(Path(pyproject).read_text())["project"]
    optional = project.get("optional-dependencies", {})
    unknown = [name for name in extras if name not in optional]
    if unknown:
        raise SystemExit(f"unknown extra(s) {', '.join(unknown)}; pyproject.toml has: {', '.join(sorted(optional))}")
    lines = list(project.get("dependencies", []))
    for name in extras:
        lines += [req for req in optional[name] if req not in lines]
    return lines


def main(argv: list[str]) -> int:
    if not argv or argv[0].startswith("-"):
        print(__doc__, file=sys.stderr)
        return 2
    print("\n".join(requirements(argv[0], argv[1:])))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
