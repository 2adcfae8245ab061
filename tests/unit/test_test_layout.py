"""The tests' own layout: shared fakes and helpers live in tests/support/, and no test module imports another.

Read from the source with ``ast`` (tests/support/import_graph.py), function-level and relative imports included:
every module under tests/ may import ``tests.support.*`` and nothing else of ``tests.*``. Modules named in strings
count too (``python -m tests.x.y`` entry points, hooks loaded by name, code run in a subprocess), when the string
names a module that exists outside tests/support. (Fixtures need no import: pytest injects them from conftest.)
The second test shows the check catching the imports one might add.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

from tests.support.import_graph import imports

REPO = Path(__file__).resolve().parents[2]
SUPPORT = "tests.support"
# Imports of test modules in files this change could not touch (they belong to the metrics work going on at the
# same time); the modules they import re-export what moved to tests/support. To be removed once they import
# tests.support.scheduler / tests.support.auth / tests.support.turn_fakes.
NOT_YET_MOVED: dict[str, set[str]] = {}
NAMED_MODULE = re.compile(r"\btests(?:\.\w+)+")


def test_modules(repo: Path) -> dict[str, Path]:
    """Every module under ``repo``/tests, by dotted name."""
    out = {}
    for path in sorted((repo / "tests").rglob("*.py")):
        parts = [p for p in path.relative_to(repo).with_suffix("").parts if p != "__init__"]
        out[".".join(parts)] = path
    return out


test_modules.__test__ = False  # a helper, not a test


def _module_named(name: str, mods: dict[str, Path]) -> str | None:
    """The module of ``mods`` that dotted ``name`` is, or is an attribute of (longest match)."""
    while name:
        if name in mods:
            return name
        name = name.rpartition(".")[0]
    return None


def layout_violations(repo: Path, allowed: dict[str, set[str]] | None = None) -> list[str]:
    """Imports (and modules named in strings) of ``tests.*`` modules other than ``tests.support.*``."""
    allowed = allowed or {}
    mods = test_modules(repo)
    found = []
    for name, path in mods.items():
        for imp in imports(name, path):
            target = _module_named(imp.imported, mods) or imp.imported
            if target.split(".")[0] != "tests" or target == SUPPORT or target.startswith(SUPPORT + "."):
                continue
            if target not in allowed.get(name, set()):
                found.append(f"{path.relative_to(repo)}:{imp.line} imports {target}")
        if name == __name__:
            continue  # this module names modules as data
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                for named in NAMED_MODULE.findall(node.value):
                    target = _module_named(named, mods)  # a module, not a package (folders are named in docs)
                    if target and mods[target].name != "__init__.py" and not target.startswith(SUPPORT + "."):
                        found.append(f"{path.relative_to(repo)}:{node.lineno} names {target} in a string")
    return list(dict.fromkeys(found))  # one line per module a line names (``from m import a, b``: one)


def test_test_modules_import_only_the_shared_support():
    mods = test_modules(REPO)
    assert len(mods) > 80 and "tests.support.waits" in mods and "tests.unit.test_test_layout" in mods
    assert layout_violations(REPO, NOT_YET_MOVED) == []


def test_the_check_fails_on_a_test_module_imported_from_another(tmp_path):
    for folder in ("unit", "integration", "e2e", "support"):
        (tmp_path / "tests" / folder).mkdir(parents=True)
        (tmp_path / "tests" / folder / "__init__.py").write_text("")
    files = {
        "unit/test_b.py": "HISTORY = [1, 2]\n",
        "unit/test_a.py": "from tests.unit.test_b import HISTORY\n",
        "e2e/helpers.py": "def chat():\n    pass\n",
        "e2e/test_c.py": "import pytest\n\n\ndef test_c():\n    from .helpers import chat\n",
        "integration/stack_main.py": "print('runs as a subprocess')\n",
        "integration/test_d.py": 'import sys\nARGS = [sys.executable, "-m", "tests.integration.stack_main"]\n',
        "support/fakes.py": "import tests.e2e.test_c\n",
        # allowed: the shared support, conftest fixtures, a doc string naming a folder
        "support/waits.py": "def until():\n    pass\n",
        "unit/test_ok.py": '"""See tests.e2e for the real stack."""\nfrom tests.support.waits import until\n',
        "e2e/conftest.py": "from tests.support import waits\n",
    }
    for name, text in files.items():
        (tmp_path / "tests" / name).write_text(text)
    found = layout_violations(tmp_path)
    assert found == ["tests/e2e/test_c.py:5 imports tests.e2e.helpers",
                     "tests/integration/test_d.py:2 names tests.integration.stack_main in a string",
                     "tests/support/fakes.py:1 imports tests.e2e.test_c",
                     "tests/unit/test_a.py:1 imports tests.unit.test_b"], found
    # an exception covers exactly the import it names
    assert len(layout_violations(tmp_path, {"tests.unit.test_a": {"tests.unit.test_b"}})) == 3
