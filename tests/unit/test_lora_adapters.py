"""LoRA adapters on the worker side (issue #37): the agent's adapter list (workers/lora_modules.py), the worker's
vLLM command line, and the plugin's per-call adapter (workers/vllm_call_options.py: the name in call metadata, the
table the agent writes, the engine hook). A real vLLM serving an adapter: tests/e2e/test_several_models.py."""

from __future__ import annotations

import json

import grpc
import pytest
from kvshuttle.control_plane.models import ADAPTER_METADATA_KEY
from kvshuttle.services.common.config import ConfigError
from kvshuttle.workers import vllm_call_options as patch
from kvshuttle.workers.lora_modules import (
    AdapterError,
    AdapterSet,
    adapter_rank,
    parse_lora_modules,
    read_modules_file,
    vllm_rank,
)
from kvshuttle.workers.vllm_process import WorkerConfig, vllm_command


def adapter(path, rank: int = 8, **config) -> str:
    path.mkdir(parents=True)
    (path / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": rank, **config}))
    (path / "adapter_model.safetensors").write_bytes(b"weights")
    return str(path)


def test_lora_modules_entries_and_files():
    assert parse_lora_modules("") == {}
    assert parse_lora_modules("sql=/a/sql, chat-v2=/a/chat ,") == {"sql": "/a/sql", "chat-v2": "/a/chat"}
    for bad, words in (("sql", "not NAME=DIR"), ("=/a", "not NAME=DIR"), ("sql=", "not NAME=DIR"),
                       ("a=/x,a=/y", "named twice"), ("-x=/a", "must be 1-128"), ("a b=/x", "must be 1-128")):
        with pytest.raises(AdapterError, match=words):
            parse_lora_modules(bad)


def test_a_modules_file_is_an_object_of_names_and_directories(tmp_path):
    path = tmp_path / "lora.json"
    path.write_text(json.dumps({"sql": "/a/sql"}))
    assert read_modules_file(str(path)) == {"sql": "/a/sql"}
    for content, words in (("[1]", "JSON object"), ('{"sql": 3}', "JSON object"), ("{", "lora.json")):
        path.write_text(content)
        with pytest.raises(AdapterError, match=words):
            read_modules_file(str(path))
    with pytest.raises(AdapterError, match="missing.json"):
        read_modules_file(str(tmp_path / "missing.json"))


def test_an_adapter_directory_is_checked_and_its_rank_read(tmp_path):
    assert adapter_rank(adapter(tmp_path / "ok", rank=32)) == 32
    with pytest.raises(AdapterError, match="cannot read adapter_config.json"):
        adapter_rank(str(tmp_path / "none"))
    with pytest.raises(AdapterError, match="no rank"):
        adapter_rank(adapter(tmp_path / "norank", rank=0))
    with pytest.raises(AdapterError, match="is not LORA"):
        adapter_rank(adapter(tmp_path / "ia3", peft_type="IA3"))
    (tmp_path / "ok" / "adapter_model.safetensors").unlink()
    with pytest.raises(AdapterError, match="no adapter_model"):
        adapter_rank(str(tmp_path / "ok"))
    assert vllm_rank([]) == 16 and vllm_rank([8]) == 16 and vllm_rank([17, 4]) == 32 and vllm_rank([512]) == 512
    with pytest.raises(AdapterError, match="above vLLM's largest"):
        vllm_rank([1024])


def test_the_adapter_set_keeps_ids_and_writes_the_plugins_table(tmp_path):
    table_path = tmp_path / "work" / "lora-adapters.json"
    served = AdapterSet(table_path, max_rank=16)
    a, b = adapter(tmp_path / "a"), adapter(tmp_path / "b")
    assert served.apply({"a": a}) and not served.apply({"a": a})  # unchanged: nothing rewritten
    table = patch.AdapterTable(str(table_path))
    assert table.get("a") == patch.Adapter("a", 1, a) and table.get("b") is None
    assert served.apply({"b": b}) and table.get("a") is None and table.get("b") == patch.Adapter("b", 2, b)
    assert served.apply({"a": a, "b": b}) and [(r.name, r.id) for r in served.records()] == [("a", 1), ("b", 2)]
    big = adapter(tmp_path / "big", rank=64)
    with pytest.raises(AdapterError, match="rank 64, above this worker's --max-lora-rank 16"):
        served.apply({"big": big})
    with pytest.raises(AdapterError, match="cannot read"):
        served.apply({"a": a, "gone": str(tmp_path / "gone")})
    assert served.current == {"a": a, "b": b} and table.get("a").id == 1  # a refused change changes nothing


def test_the_worker_runs_vllm_with_lora_on_and_its_table_for_the_plugin(tmp_path):
    a = adapter(tmp_path / "a", rank=32)
    cfg = WorkerConfig(role="prefill", model="/models/tiny", lora_modules=f"sql={a}", work_dir=str(tmp_path / "w"))
    cfg.validate()
    argv, env = vllm_command(cfg)
    at = argv.index("--enable-lora")
    assert argv[at:at + 5] == ["--enable-lora", "--max-loras", "1", "--max-lora-rank", "32"]
    assert env[patch.ADAPTERS_ENV] == str((tmp_path / "w" / "lora-adapters.json").resolve())
    argv, env = vllm_command(WorkerConfig(role="prefill", model="/models/tiny"))
    assert "--enable-lora" not in argv and patch.ADAPTERS_ENV not in env
    listing = tmp_path / "lora.json"
    listing.write_text(json.dumps({"sql": a}))
    cfg = WorkerConfig(role="decode", model="/m", lora_modules_file=str(listing), max_loras=4, max_lora_rank=64)
    argv, _ = vllm_command(cfg)
    assert argv[argv.index("--enable-lora"):][:5] == ["--enable-lora", "--max-loras", "4", "--max-lora-rank", "64"]
    listing.write_text(json.dumps({"sql": str(tmp_path / "b")}))
    with pytest.raises(AdapterError, match="different directories"):
        WorkerConfig(role="decode", model="/m", lora_modules=f"sql={a}", lora_modules_file=str(listing)).lora_limits()


@pytest.mark.parametrize("settings, words", [
    ({"lora_modules": "sql"}, "not NAME=DIR"),
    ({"lora_modules": "a=/x", "max_lora_rank": 12}, "--max-lora-rank must be"),
    ({"lora_modules": "a=/x", "lora_modules_poll_s": 0}, "--lora-modules-poll-s must be > 0"),
])
def test_bad_lora_settings_are_refused(settings, words):
    with pytest.raises(ConfigError, match=words):
        WorkerConfig(role="prefill", model="/m", **settings).validate()


def test_lora_settings_without_adapters_are_refused(capsys):
    from kvshuttle.services.common.config import load

    for flags, words in ((["--max-lora-rank", "64"], "--max-lora-rank has no effect without --lora-modules"),
                         (["--lora-modules-poll-s", "5"], "has no effect without --lora-modules-file")):
        with pytest.raises(SystemExit):
            load(WorkerConfig, ["--role", "prefill", "--model", "/m", *flags], prog="kvshuttle worker")
        assert words in capsys.readouterr().err


def test_the_plugin_reads_one_adapter_name_and_finds_it_in_the_table(tmp_path, monkeypatch):
    assert patch.adapter_name_of(None) == (None, "") and patch.adapter_name_of([("x", "y")]) == (None, "")
    assert patch.adapter_name_of([(ADAPTER_METADATA_KEY, "sql"), (ADAPTER_METADATA_KEY, "sql")]) == ("sql", "")
    assert "more than once" in patch.adapter_name_of([(ADAPTER_METADATA_KEY, "a"), (ADAPTER_METADATA_KEY, "b")])[1]
    assert "must name an adapter" in patch.adapter_name_of([(ADAPTER_METADATA_KEY, "")])[1]
    table = tmp_path / "lora-adapters.json"
    table.write_text(json.dumps({"adapters": [{"name": "sql", "id": 3, "path": "/a/sql"}]}))
    monkeypatch.setenv(patch.ADAPTERS_ENV, str(table))
    options, code, problem = patch.options_of([(ADAPTER_METADATA_KEY, "sql"), ("kvshuttle-cache-salt", "kvs1-a")])
    assert code is None and options.adapter == patch.Adapter("sql", 3, "/a/sql") and options.salt == "kvs1-a"
    assert patch.options_of([("other", "x")]) == (None, None, "")
    options, code, problem = patch.options_of([(ADAPTER_METADATA_KEY, "chat")])
    assert options is None and code == grpc.StatusCode.NOT_FOUND and "no adapter named 'chat'" in problem
    table.write_text(json.dumps({"adapters": [{"name": "chat", "id": 4, "path": "/a/chat"}]}) + " ")  # rewritten
    assert patch.options_of([(ADAPTER_METADATA_KEY, "chat")])[0].adapter.id == 4
    table.write_text("{half")  # a table the plugin cannot read: the last good one stays
    assert patch.adapter_table().get("chat").id == 4
    monkeypatch.delenv(patch.ADAPTERS_ENV)
    assert patch.options_of([(ADAPTER_METADATA_KEY, "chat")])[1] == grpc.StatusCode.NOT_FOUND  # serves none
    for bad in ({"adapters": [{"name": "a", "id": 0, "path": "/p"}]}, {"adapters": [{"name": "a", "id": True,
                                                                                     "path": "/p"}]}, []):
        with pytest.raises(ValueError):
            patch.parse_adapters(bad)


def test_the_engine_hook_runs_the_request_it_was_given_under_its_adapter():
    class Engine:
        def generate(self, *, prompt, request_id, **kwargs):
            self.kwargs = kwargs
            return prompt

    engine = Engine()
    waiting = patch.engine_options(engine)
    waiting["r1"] = patch.Options(adapter=patch.Adapter("sql", 3, "/a/sql"))
    rendered = {"type": "token", "prompt_token_ids": [1, 2]}
    assert engine.generate(prompt=rendered, request_id="r1") == rendered  # no salt: the prompt unchanged
    lora = engine.kwargs["lora_request"]
    assert (lora.lora_name, lora.lora_int_id, lora.lora_path) == ("sql", 3, "/a/sql") and waiting == {}
    engine.generate(prompt=rendered, request_id="r2")
    assert "lora_request" not in engine.kwargs  # another request: the base model
    waiting["r3"] = patch.Options(adapter=patch.Adapter("sql", 3, "/a/sql"))
    with pytest.raises(ValueError, match="already runs under an adapter"):
        engine.generate(prompt=rendered, request_id="r3", lora_request=object())
