"""The tests' own layout: shared fakes and helpers live in tests/support/, and no test module imports another.

Read from the source with ``ast`` (tests/support/import_graph.py), function-level and relative imports included:
every module under tests/ may import ``tests.support.*`` and nothing else of ``tests.*``. Modules named in strings
count too (``python -m tests.x.y`` entry points, hooks loaded by name, code run in a subprocess), when the string
names a module that exists outside tests/support. (Fixtures need no import: pytest injects them from conftest.)
The second test shows the check catching the imports one might add.

And the folders' rule: tests/unit/ is the quick loop (``pytest -n 2 tests/unit``, well under a minute), so nothing
there starts a process or builds a model. A module under tests/unit/, or any tests.support module it imports (and
so on), must not import ``subprocess``/``multiprocessing``/``pty`` nor use ``sys.executable``, ``os.system``,
``os.fork``, ``os.exec*``, ``os.spawn*``, ``os.posix_spawn*`` or ``asyncio.create_subprocess_*`` (that covers
``buf``, child interpreters and the vLLM/Harmony reference parsers), and must not build the test models
(``build_model``, the conftest fixtures that build them: ``MODEL_FIXTURES``) nor import torch,
transformers, vLLM or NIXL. Such tests go to tests/slow/ (marked ``slow`` by its conftest). tests/unit/conftest.py
also refuses any process a unit test starts at run time, through whatever code (the check here reads only source).
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
# What a unit test (or the support it imports) may not use: modules that start processes or load models, the calls
# that start processes, and the conftest fixtures and function that build (train) the test models.
SPAWNING_MODULES = ("subprocess", "multiprocessing", "pty", "concurrent.futures.process")
MODEL_MODULES = ("torch", "transformers", "vllm", "nixl")
SPAWNING_NAMES = re.compile(r"^(sys\.executable|os\.(system|popen|fork|forkpty|exec\w*|spawn\w*|posix_spawnp?)"
                            r"|asyncio\.create_subprocess_\w+)$")
MODEL_FIXTURES = ("model_dir", "agent_model_dir", "tools_model_dir", "smollm2_model_dir")
MODEL_BUILDER = "build_model"
GUARD = "tests.unit.conftest"  # refuses processes at run time, so it names them


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


def _within(name: str, prefixes: tuple[str, ...]) -> str | None:
    return next((p for p in prefixes if name == p or name.startswith(p + ".")), None)


def _own_violations(name: str, path: Path) -> list[str]:
    """What module ``name`` itself does that a unit test may not: start a process, load or build a model."""
    found = []
    for imp in imports(name, path):
        if hit := _within(imp.imported, SPAWNING_MODULES + MODEL_MODULES):
            found.append(f"{imp.line} imports {hit}")
        elif SPAWNING_NAMES.match(imp.imported) or imp.imported.rpartition(".")[2] == MODEL_BUILDER:
            found.append(f"{imp.line} imports {imp.imported}")
    tree = ast.parse(path.read_text(), str(path))
    defined = {n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)}
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            dotted = f"{node.value.id}.{node.attr}"
            if SPAWNING_NAMES.match(dotted) or node.attr == MODEL_BUILDER:
                found.append(f"{node.lineno} uses {dotted}")
        elif isinstance(node, ast.Name) and node.id == MODEL_BUILDER:
            found.append(f"{node.lineno} uses {MODEL_BUILDER}")
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            for arg in node.args.args + node.args.kwonlyargs:
                if arg.arg in MODEL_FIXTURES and arg.arg not in defined:  # a module's own fixture of the name is fine
                    found.append(f"{arg.lineno} takes the fixture {arg.arg} (it builds a test model)")
    return list(dict.fromkeys(found))


def unit_violations(repo: Path) -> list[str]:
    """What the modules under ``repo``/tests/unit do, themselves or through the tests.support modules they import
    (transitively), that belongs in tests/slow: start processes, load or build models."""
    mods = test_modules(repo)
    found = []
    for name, path in mods.items():
        if not name.startswith("tests.unit.") or name == GUARD:
            continue
        found += [f"{path.relative_to(repo)}:{v}" for v in _own_violations(name, path)]
        seen, todo = {name}, [(name, path, "")]
        while todo:
            importer, importer_path, via = todo.pop()
            for imp in imports(importer, importer_path):
                target = _module_named(imp.imported, mods)
                if target is None or target in seen or not target.startswith(SUPPORT + "."):
                    continue
                seen.add(target)
                chain = f"{via}{target} (line {imp.line})" if not via else f"{via} -> {target}"
                found += [f"{path.relative_to(repo)}: imports {chain}, whose line {v}"
                          for v in _own_violations(target, mods[target])]
                todo.append((target, mods[target], chain))
    return found


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


def test_unit_tests_start_no_process_and_build_no_model():
    assert unit_violations(REPO) == []
    assert (REPO / "tests" / "slow" / "test_protos.py").is_file()  # what starts buf lives in tests/slow


def test_the_unit_check_fails_on_a_process_or_a_model(tmp_path):
    for folder in ("unit", "slow", "support"):
        (tmp_path / "tests" / folder).mkdir(parents=True)
        (tmp_path / "tests" / folder / "__init__.py").write_text("")
    files = {
        "unit/test_buf.py": "import subprocess\n\n\ndef test_lint():\n    subprocess.run(['buf', 'lint'])\n",
        "unit/test_child.py": "import sys\n\n\ndef test_child():\n    assert sys.executable\n",
        "unit/test_async.py": "import asyncio\n\n\nasync def test_a():\n    await asyncio.create_subprocess_exec('ls')\n",
        "unit/test_model.py": "def test_tok(model_dir):\n    pass\n",
        "unit/test_build.py": "from kvshuttle.workers.model_builder import build_model\n",
        "unit/test_torch.py": "def test_t():\n    import torch.nn\n",
        "support/child.py": "from subprocess import Popen\n",
        "support/parsers.py": "from tests.support import child\n",
        "unit/test_parsers.py": "from tests.support.parsers import x\n",
        # allowed: a module's own fixture named model_dir, a docstring naming subprocess, support that spawns nothing,
        # and the same code in tests/slow
        "unit/test_ok.py": ('"""Not a subprocess."""\nimport pytest\n\n\n@pytest.fixture\ndef model_dir(tmp_path):\n'
                            '    return tmp_path\n\n\ndef test_ok(model_dir):\n    pass\n'),
        "support/waits.py": "import time\n",
        "unit/test_waits.py": "from tests.support.waits import until\n",
        "slow/test_buf.py": "import subprocess\nimport sys\n\n\ndef test_b(model_dir):\n    sys.executable\n",
    }
    for name, text in files.items():
        (tmp_path / "tests" / name).write_text(text)
    found = unit_violations(tmp_path)
    assert found == [
        "tests/unit/test_async.py:5 uses asyncio.create_subprocess_exec",
        "tests/unit/test_buf.py:1 imports subprocess",
        "tests/unit/test_build.py:1 imports kvshuttle.workers.model_builder.build_model",
        "tests/unit/test_child.py:5 uses sys.executable",
        "tests/unit/test_model.py:1 takes the fixture model_dir (it builds a test model)",
        "tests/unit/test_parsers.py: imports tests.support.parsers (line 1) -> tests.support.child, whose line 1 imports "
        "subprocess",
        "tests/unit/test_torch.py:2 imports torch",
    ], found
