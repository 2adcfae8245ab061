"""The offline test model rebuilds byte-identical, and a complete directory is not rebuilt."""

from __future__ import annotations

from kvshuttle.workers import model_builder


def test_rebuild_is_byte_identical(model_dir, tmp_path):
    fresh = model_builder.build_model(tmp_path / "again", "tiny", force=True)
    assert model_builder.file_hashes(fresh) == model_builder.file_hashes(model_dir)
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= set(
        model_builder.file_hashes(fresh))


def test_complete_dir_is_kept(model_dir, tmp_path):
    out = model_builder.build_model(tmp_path / "m", "tiny")
    stamp = (out / model_builder.STAMP).stat().st_mtime_ns
    model_builder.build_model(out, "tiny")
    assert (out / model_builder.STAMP).stat().st_mtime_ns == stamp
    (out / "config.json").write_text("{}")  # damaged: rebuilt
    model_builder.build_model(out, "tiny")
    assert (out / model_builder.STAMP).stat().st_mtime_ns != stamp
    assert model_builder.file_hashes(out) == model_builder.file_hashes(model_dir)


def test_tiny_tools_is_the_tiny_model_with_the_agent_chat_template(model_dir, tmp_path):
    """What `kvshuttle bench` runs: tiny's tokenizer, config and weights byte for byte, and a chat template that
    renders tools, hermes tool calls and tool results; the tiny model itself (and its template, which the tests'
    exact prompts rely on) is unchanged."""
    import json

    from kvshuttle.services.devtools.stack import MODEL_VARIANTS
    from kvshuttle.workers.agent_script import AGENT_CHAT_TEMPLATE

    out = model_builder.build_model(tmp_path / "tiny-tools", "tiny-tools")
    tiny, tools = model_builder.file_hashes(model_dir), model_builder.file_hashes(out)
    assert {name for name in tiny.keys() | tools.keys() if tiny.get(name) != tools.get(name)} == {
        "chat_template.jinja", "tokenizer_config.json"}
    assert (out / "chat_template.jinja").read_text() == AGENT_CHAT_TEMPLATE
    assert json.loads((out / "tokenizer_config.json").read_text())["chat_template"] == AGENT_CHAT_TEMPLATE
    assert json.loads((model_dir / "tokenizer_config.json").read_text())["chat_template"] == model_builder.CHAT_TEMPLATE
    assert model_builder.is_complete(model_dir, model_builder.recipe_hash(
        model_builder.recipe("tiny", model_builder.corpus_files())))
    assert set(MODEL_VARIANTS) == set(model_builder.VARIANTS)
