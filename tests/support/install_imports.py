"""The third-party imports each install of kvshuttle runs, read from the source, and those it does not bring.

An install runs the modules kvshuttle.services.commands.installs declares for it (and for the smaller installs it
includes): all their imports, function-level ones too, and those of every kvshuttle module they import that the
install runs; of a module reached that only a larger install runs, the imports that run when it is imported. Names are
mapped to distributions, and requirements followed, in the project's venv (tests/support/distributions.py). Used by
tests/unit/test_install_imports.py (the check) and tests/deploy/test_installs.py (each name present in a real venv).
"""

from __future__ import annotations

from pathlib import Path

from kvshuttle.services.commands.installs import INSTALLS, Install, install_of, runs

from tests.support.distributions import closure, distribution_of, is_third_party, requirements
from tests.support.import_graph import Import, imports, imports_on_import, modules


def run_by(install: Install, name: str, mods: dict[str, Path],
           parsed: dict[tuple[str, bool], list[Import]] | None = None) -> list[Import]:
    """The third-party imports that run when ``install`` runs module ``name``: all of those of ``name`` and of every
    kvshuttle module it imports that ``install`` runs (function level too, as the imports between them), and the
    import-time ones of the modules reached that only a larger install runs (those must import; their functions
    belong to that install). Packages' ``__init__`` modules count as imported."""
    parsed = {} if parsed is None else parsed  # (module, all its imports or the import-time ones) -> imports
    out, seen, todo = [], set(), [name]
    while todo:
        module = todo.pop()
        if module in seen:
            continue
        seen.add(module)
        full = runs(install, module)
        if (module, full) not in parsed:
            path = mods[module]
            parsed[module, full] = list(imports(module, path)) if full else imports_on_import(module, path)
        found = parsed[module, full]
        out += [imp for imp in found if is_third_party(imp.imported)]
        parts = module.split(".")
        todo += [p for p in (".".join(parts[:n]) for n in range(1, len(parts))) if p in mods]
        for imp in found:
            target = imp.imported if imp.imported in mods else imp.imported.rpartition(".")[0]
            if target in mods:
                todo.append(target)
    return out


def violations(repo: Path, installs: tuple[Install, ...] = INSTALLS) -> list[str]:
    """One line per third-party import (importer:line) that an install meant to run it does not bring."""
    mods = modules(repo)
    parsed: dict[tuple[str, bool], list[Import]] = {}
    found: dict[tuple[str, str, int], str] = {}
    for install in installs:
        brings = closure(requirements(install.extras))
        for name in sorted(mods):
            if install_of(name) != install:  # each module with the smallest install meant to run it
                continue
            for imp in run_by(install, name, mods, parsed):
                dist = distribution_of(imp.imported)
                if dist not in brings:
                    found.setdefault((imp.importer, imp.imported, imp.line),
                                     f"{imp.importer}:{imp.line} imports {imp.imported} "
                                     f"({dist or 'no installed distribution ships it'}), which `{install.pip}` "
                                     f"does not bring; {name} is meant to run from it")
    return list(found.values())
