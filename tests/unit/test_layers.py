"""Imports run one way: commands → services → common runtime / engine client / store → control_plane → stubs.

Read from the source with ``ast`` (tests/support/import_graph.py), function-level imports included. The second test
shows the check catching the wrong-way imports one might add.
"""

from __future__ import annotations

from pathlib import Path

from tests.support.import_graph import ROOTS, import_cycles, imports, modules, violations

REPO = Path(__file__).resolve().parents[2]

LAYERS = [
    ("kvshuttle.services.commands", "kvshuttle.services.devtools"),  # what a user runs; the local stack and benches
    ("kvshuttle.services.gateway", "kvshuttle.services.registry", "kvshuttle.services.scheduler", "kvshuttle.workers"),
    ("kvshuttle.services.common", "kvshuttle.services.engine", "kvshuttle.services.store"),
    ("kvshuttle.control_plane",),  # pure domain logic: no network I/O, no service code
    ("kvshuttle.v1",),  # generated stubs
]
SERVICES = 1  # the services are independent of each other: the gateway never imports the registry's code
WITHIN = {
    "kvshuttle.services.commands": {"kvshuttle.services.devtools"},
    "kvshuttle.services.devtools": {"kvshuttle.services.commands"},
    "kvshuttle.services.store": {"kvshuttle.services.common"},
    "kvshuttle.services.engine": {"kvshuttle.services.common"},
}
OLD_TOP_LEVEL = ("services", "workers", "control_plane")
GATEWAY = "kvshuttle.services.gateway"
GATEWAY_LAYERS = [  # the gateway's folders (docs/development.md)
    (f"{GATEWAY}.server",),  # the process's wiring
    (f"{GATEWAY}.apis.http_app",),  # the HTTP app: the OpenAI routes on it, the other APIs added to it
    (f"{GATEWAY}.apis.openai", f"{GATEWAY}.apis.anthropic", f"{GATEWAY}.apis.responses", f"{GATEWAY}.apis.grpc_api",
     f"{GATEWAY}.apis.rest_bridge"),  # the front ends, never each other
    (f"{GATEWAY}.apis.state", f"{GATEWAY}.apis.request_model"),  # what the front ends share
    (f"{GATEWAY}.edge",),  # the HTTP edge: keys, limits, input checks, error shapes, SSE, metrics, tracing
    (f"{GATEWAY}.turns",),  # the turn: builder, tools, stages, runner
    (f"{GATEWAY}.tokens",),  # tokenizer and detokenizer
]


def check(repo: Path) -> list[str]:
    return violations(modules(repo), LAYERS, independent={SERVICES}, allowed_within=WITHIN)


def test_imports_run_one_way():
    mods = modules(REPO)
    assert len(mods) > 60 and "kvshuttle.services.gateway.server" in mods
    assert check(REPO) == []


def test_the_gateways_folders_import_one_way():
    """apis → edge → turns → tokens inside the gateway; no front end imports another."""
    mods = modules(REPO)
    assert f"{GATEWAY}.apis.responses.stored" in mods and f"{GATEWAY}.edge.http_guard" in mods
    assert violations(mods, GATEWAY_LAYERS, independent={2, 3}) == []


def test_no_module_depends_on_itself():
    """No import cycle anywhere in kvshuttle.*, counting function-level and TYPE_CHECKING imports: the turn's stages
    are typed against turns.services.TurnServices, not the runner that calls them."""
    assert import_cycles(modules(REPO)) == []


def test_the_cycle_check_finds_a_cycle_a_type_checking_import_hides(tmp_path):
    for folder in ROOTS.values():
        (tmp_path / folder).mkdir()
    (tmp_path / "services" / "runner.py").write_text("from kvshuttle.services import stage\n")
    (tmp_path / "services" / "stage.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from kvshuttle.services.runner import Runner\n")
    (tmp_path / "services" / "other.py").write_text("from kvshuttle.services import stage\n")
    assert import_cycles(modules(tmp_path)) == [["kvshuttle.services.runner", "kvshuttle.services.stage"]]


def test_the_check_fails_on_an_import_the_wrong_way(tmp_path):
    for folder in ROOTS.values():
        (tmp_path / folder).mkdir()
    (tmp_path / "control_plane" / "policy.py").write_text("def f():\n    from kvshuttle.services.gateway import turns\n")
    (tmp_path / "services" / "gateway").mkdir()
    (tmp_path / "services" / "gateway" / "__init__.py").write_text("")
    (tmp_path / "services" / "gateway" / "turns.py").write_text(
        "from kvshuttle.services.scheduler.claims import EtcdClaims\nfrom .. import common\n")
    (tmp_path / "services" / "common").mkdir()
    (tmp_path / "services" / "common" / "config.py").write_text("import kvshuttle.workers.agent\n")
    (tmp_path / "services" / "common" / "tls.py").write_text("from kvshuttle.services.engine import client\n")
    found = check(tmp_path)
    assert any("kvshuttle.control_plane.policy:2 imports kvshuttle.services.gateway.turns" in v for v in found), found
    assert any("sibling: kvshuttle.services.gateway -> kvshuttle.services.scheduler" in v for v in found), found
    assert any("kvshuttle.services.common.config:1 imports kvshuttle.workers.agent" in v for v in found), found
    assert any("sibling: kvshuttle.services.common -> kvshuttle.services.engine" in v for v in found), found
    assert len(found) == 4, found  # `from .. import common` (gateway -> services.common) runs the right way


def test_nothing_imports_the_old_top_level_names():
    """Only ``kvshuttle.*`` is importable from a wheel; the tests and tools use the same names."""
    sources = [p for d in (*ROOTS.values(), "tests", "deploy", "protos") for p in (REPO / d).rglob("*.py")
               if "protos/gen" not in p.as_posix()]
    wrong = [f"{p.relative_to(REPO)}:{imp.line} {imp.imported}" for p in sources for imp in imports("x.y", p)
             if imp.imported.split(".")[0] in OLD_TOP_LEVEL]
    assert wrong == []
