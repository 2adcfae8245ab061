"""Which distribution ships an imported module, and which distributions an install of kvshuttle brings.

Read from the installed metadata of the running interpreter (the project's ``.venv``: ``importlib.metadata``) and
pyproject.toml, no network: ``distribution_of("google.protobuf.json_format")`` is ``protobuf``; ``closure(reqs)`` is
every distribution those requirements bring, their own requirements followed (markers evaluated, extras included).
Used by tests/unit/test_install_imports.py to check each install's imports against its dependencies.
"""

from __future__ import annotations

import sys
import tomllib
from collections.abc import Iterable
from functools import cache
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[2]


@cache
def _top_level() -> dict[str, tuple[str, ...]]:
    return {name: tuple(dists) for name, dists in metadata.packages_distributions().items()}


@cache
def _shipped(dist: str) -> frozenset[str]:
    """The dotted names of the modules and packages a distribution's files hold."""
    names = set()
    for file in metadata.distribution(dist).files or ():
        parts = file.parts
        if not parts or not (parts[-1].endswith(".py") or parts[-1].endswith(".so") or parts[-1].endswith(".pyi")):
            continue
        parts = [*parts[:-1], parts[-1].split(".")[0]]
        if parts[-1] == "__init__":
            parts = parts[:-1]
        names.update(".".join(parts[:n]) for n in range(1, len(parts) + 1))
    return frozenset(names)


def distribution_of(module: str) -> str | None:
    """The canonical name of the installed distribution that ships ``module`` (or ``module``'s attribute, as
    ``from a import b`` names ``a.b``); None when none does. A namespace package shared by several distributions
    (``google``, ``opentelemetry``) goes to the one that ships the longest part of the name."""
    parts = module.split(".")
    candidates = _top_level().get(parts[0], ())
    if len(set(map(canonicalize_name, candidates))) == 1:
        return canonicalize_name(candidates[0])
    best, depth = None, 0
    for dist in candidates:
        shipped = _shipped(dist)
        n = next((n for n in range(len(parts), 0, -1) if ".".join(parts[:n]) in shipped), 0)
        if n > depth:
            best, depth = canonicalize_name(dist), n
    return best


def is_third_party(module: str) -> bool:
    top = module.split(".")[0]
    return top not in sys.stdlib_module_names and top != "kvshuttle"


def closure(requirements: Iterable[str]) -> frozenset[str]:
    """Canonical names of every distribution the requirements bring: theirs and, from the installed metadata, their
    requirements (with the extras asked for), and so on. A distribution not installed here ends its branch."""
    seen: set[tuple[str, frozenset[str]]] = set()
    todo = [Requirement(r) for r in requirements]
    while todo:
        req = todo.pop()
        name, extras = canonicalize_name(req.name), frozenset(req.extras)
        if (name, extras) in seen:
            continue
        seen.add((name, extras))
        try:
            requires = metadata.requires(name) or []
        except metadata.PackageNotFoundError:
            continue
        for text in requires:
            sub = Requirement(text)
            if sub.marker is None or any(sub.marker.evaluate({"extra": e}) for e in (extras or {""})):
                todo.append(sub)
    return frozenset(name for name, _ in seen)


@cache
def pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def requirements(extras: Iterable[str]) -> list[str]:
    """pyproject.toml's dependencies plus those of the extras."""
    project = pyproject()
    return list(project["dependencies"]) + [r for e in extras for r in project["optional-dependencies"][e]]
