"""Each install's code imports only what that install brings: every third-party module imported (module level or in
a function) by a module an install is meant to run (kvshuttle.services.commands.installs), or by any kvshuttle module
that one imports, comes from pyproject.toml's dependencies plus the install's extras, or from what those require.

Read with ``ast`` (tests/support/install_imports.py); import names are mapped to distributions, and requirements
followed, in the installed metadata of the project's venv (tests/support/distributions.py). The venv has every extra
(dev included), so an import that only the dev extra brings passes every other test: this one names it. The installs
themselves, really installed: tests/deploy/test_installs.py.
"""

from __future__ import annotations

from pathlib import Path

from kvshuttle.services.commands import cli
from kvshuttle.services.commands.installs import ALTERNATIVES, INSTALLS, Install, install_of, missing, runs

from tests.support.distributions import pyproject
from tests.support.import_graph import ROOTS, modules
from tests.support.install_imports import violations

REPO = Path(__file__).resolve().parents[2]


def test_every_install_imports_only_what_it_brings():
    assert len(modules(REPO)) > 100
    found = violations(REPO)
    assert not found, "\n".join(found)


def test_the_check_finds_an_import_only_the_dev_extra_brings(tmp_path):
    """A base module (the gateway's) importing schemathesis in a helper's function; a worker module importing
    matplotlib (bench); a base module importing torch; a base module importing a worker module that imports torch
    at import time. Not: the worker module's own torch, a worker module's function-level torch import that a base
    module reaches (only the worker install runs that function)."""
    for folder in ROOTS.values():
        (tmp_path / folder).mkdir()
    gateway = tmp_path / "services" / "gateway"
    gateway.mkdir()
    (gateway / "__init__.py").write_text("")
    (gateway / "server.py").write_text("import grpc\nfrom kvshuttle.services.gateway import helper\n"
                                       "from kvshuttle.workers import builder\n")
    (gateway / "helper.py").write_text("import json\n\ndef f():\n    import schemathesis\n")
    (tmp_path / "workers" / "builder.py").write_text("import json\n\ndef build():\n    import torch\n")
    (tmp_path / "workers" / "agent.py").write_text("import torch\n")
    (tmp_path / "workers" / "plots.py").write_text("import torch\nfrom matplotlib import pyplot\n")
    (tmp_path / "services" / "uses_torch.py").write_text("from torch import nn\n")
    (tmp_path / "services" / "starts_agent.py").write_text("def main():\n    from kvshuttle.workers import agent\n")
    found = violations(tmp_path)
    expected = [
        "kvshuttle.services.gateway.helper:4 imports schemathesis (schemathesis), which `pip install kvshuttle` does "
        "not bring",
        "kvshuttle.services.uses_torch:1 imports torch.nn (torch), which `pip install kvshuttle` does not bring",
        "kvshuttle.workers.agent:1 imports torch (torch), which `pip install kvshuttle` does not bring; "
        "kvshuttle.services.starts_agent is meant to run from it",
        "kvshuttle.workers.plots:2 imports matplotlib.pyplot (matplotlib), which `pip install 'kvshuttle[worker]'` "
        "does not bring",
    ]
    assert all(any(v.startswith(e) for v in found) for e in expected), found
    assert len(found) == len(expected), found


def test_the_declaration_names_real_modules_and_extras():
    mods = modules(REPO)
    extras = pyproject()["optional-dependencies"]
    assert INSTALLS[0] == Install((), ("kvshuttle",)), "the plain install runs everything not named elsewhere"
    for install in INSTALLS:
        assert set(install.extras) <= extras.keys(), install
        for prefix in install.modules:
            assert any(m == prefix or m.startswith(prefix + ".") for m in mods), f"{install.name}: no module {prefix}"
    for extra, alternatives in ALTERNATIVES.items():
        assert {extra, *alternatives} <= extras.keys()
    assert len({i.extras for i in INSTALLS}) == len(INSTALLS)


def test_each_command_has_the_install_it_needs():
    """The control plane's commands run from the plain install; what starts vLLM or builds a model needs the worker
    extra; the benchmark's plots the bench extra too."""
    install = {name: install_of(module).name for name, (module, _) in cli.COMMANDS.items()}
    for name in ("registry", "scheduler", "gateway", "hash-key", "smoke-test", "health-check", "traces", "simulate"):
        assert install[name] == "kvshuttle", name
    for name in ("worker", "make-model", "demo", "up", "bench-gateway"):
        assert install[name] == "kvshuttle[worker]", name
    assert install["bench"] == install["soak"] == "kvshuttle[worker,bench]"
    plain, worker = INSTALLS[0], install_of("kvshuttle.workers.agent")
    assert runs(worker, "kvshuttle.services.gateway.server") and not runs(plain, "kvshuttle.workers.model_builder")


def test_missing_reads_what_is_installed():
    """The project's venv has every extra but CUDA vLLM: the worker install is there (through its CPU extra), the
    worker-cuda extra on its own is not."""
    assert [missing(i) for i in INSTALLS] == [[]] * len(INSTALLS)
    assert missing(Install(("worker-cuda",), ())) == ["vllm"]
