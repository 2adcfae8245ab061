"""The import graph of kvshuttle's own modules, read from the source (``ast``: function-level imports included).

Used by tests/unit/test_layers.py to hold the layering of the architecture: commands → services → common runtime,
engine client and store → control_plane → stubs.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

# Folder of each mapped package (pyproject [tool.setuptools] package-dir).
ROOTS = {"kvshuttle.control_plane": "control_plane", "kvshuttle.services": "services", "kvshuttle.workers": "workers"}


@dataclass(frozen=True)
class Import:
    importer: str  # module that imports
    imported: str  # module (or module.attribute) it names
    line: int


def modules(repo: Path, roots: dict[str, str] = ROOTS) -> dict[str, Path]:
    """Every module under the mapped folders, by dotted name."""
    out = {}
    for package, folder in roots.items():
        for path in sorted((repo / folder).rglob("*.py")):
            rel = path.relative_to(repo / folder).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            out[".".join([package, *parts])] = path
    return out


def imports(name: str, path: Path) -> Iterator[Import]:
    """The imports ``path`` (module ``name``) makes, absolute or relative, anywhere in its body."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield Import(name, alias.name, node.lineno)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")
                parent = parent[: len(parent) - (node.level - 1)]
                base = ".".join([*parent, base] if base else parent)
            for alias in node.names:
                yield Import(name, f"{base}.{alias.name}", node.lineno)


def imports_on_import(name: str, path: Path) -> list[Import]:
    """The imports that run when module ``name`` is imported: those of :func:`imports` less the ones inside a
    function (or lambda) and under ``if TYPE_CHECKING:``."""
    tree = ast.parse(path.read_text(), str(path))
    skipped: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
            skipped.update(id(n) for n in ast.walk(node))
        elif isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skipped.update(id(n) for part in node.body for n in ast.walk(part))
    lines = {n.lineno for n in ast.walk(tree) if isinstance(n, ast.Import | ast.ImportFrom) and id(n) not in skipped}
    return [imp for imp in imports(name, path) if imp.line in lines]


def layer_of(module: str, layers: list[tuple[str, ...]]) -> int | None:
    """Index of the layer whose prefixes match ``module`` most specifically (0 = top); None: not ours."""
    best, depth = None, -1
    for i, prefixes in enumerate(layers):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and prefix.count(".") > depth:
                best, depth = i, prefix.count(".")
    return best


def component_of(module: str, layer: tuple[str, ...]) -> str:
    return next(p for p in sorted(layer, key=len, reverse=True) if module == p or module.startswith(p + "."))


def violations(mods: dict[str, Path], layers: list[tuple[str, ...]], *, independent: set[int] = frozenset(),
               allowed_within: dict[str, set[str]] | None = None) -> list[str]:
    """Imports that run upwards, or sideways between components of a layer in ``independent``.

    ``allowed_within``: component -> components of its own layer it may import (e.g. the store uses common).
    """
    allowed_within = allowed_within or {}
    found = []
    for name, path in mods.items():
        mine = layer_of(name, layers)
        if mine is None:
            continue
        for imp in imports(name, path):
            theirs = layer_of(imp.imported, layers)
            if theirs is None or theirs > mine:
                continue
            if theirs < mine:
                found.append(f"{name}:{imp.line} imports {imp.imported} (a higher layer)")
                continue
            a, b = component_of(name, layers[mine]), component_of(imp.imported, layers[mine])
            if a != b and (mine in independent or b not in allowed_within.get(a, set())):
                found.append(f"{name}:{imp.line} imports {imp.imported} (a sibling: {a} -> {b})")
    return found


def dependencies(name: str, path: Path, mods: dict[str, Path]) -> set[str]:
    """The modules of ``mods`` that ``name`` imports anywhere (function-level and ``TYPE_CHECKING`` imports too: a
    cycle they hide is still a cycle in the design). ``from pkg import x`` names ``pkg.x`` when that is a module,
    else ``pkg`` itself."""
    out = set()
    for imp in imports(name, path):
        target = imp.imported if imp.imported in mods else imp.imported.rpartition(".")[0]
        if target in mods and target != name:
            out.add(target)
    return out


def import_cycles(mods: dict[str, Path]) -> list[list[str]]:
    """The import cycles among ``mods``: Tarjan's strongly connected components of two or more modules, each
    sorted; [] when no module depends on itself through others."""
    graph = {name: sorted(dependencies(name, path, mods)) for name, path in mods.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def strong(v: str) -> None:  # recursive: the graph's paths are a few dozen modules deep at most
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                out.append(sorted(group))

    for v in graph:
        if v not in index:
            strong(v)
    return sorted(out)
