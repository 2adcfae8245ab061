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
    assert set(MODEL_VARIANTS) == set(model_builder.VARIANTS) - set(model_builder.lora_adapter.ADAPTERS)


def test_tiny_lora_is_a_peft_adapter_of_the_tiny_model_byte_identical_on_rebuild(model_dir, tmp_path):
    """The test adapter (workers/lora_adapter.py): a PEFT LoRA vLLM loads (config, safetensors), one A and B of the
    tiny model's own shapes for every attention projection of every layer, the same bytes on every build."""
    import json

    from safetensors import safe_open

    out = model_builder.build_model(tmp_path / "tiny-lora", "tiny-lora")
    config = json.loads((out / "adapter_config.json").read_text())
    assert (config["peft_type"], config["r"], config["target_modules"]) == ("LORA", 8, ["q_proj", "k_proj", "v_proj",
                                                                                       "o_proj"])
    tiny = json.loads((model_dir / "config.json").read_text())
    with safe_open(str(out / "adapter_model.safetensors"), "pt") as f:
        shapes = {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}
    assert len(shapes) == tiny["num_hidden_layers"] * 4 * 2
    hidden, kv = tiny["hidden_size"], tiny["num_key_value_heads"] * tiny["head_dim"]
    layer = "base_model.model.model.layers.0.self_attn"
    assert shapes[f"{layer}.q_proj.lora_A.weight"] == (8, hidden) and shapes[f"{layer}.k_proj.lora_B.weight"] == (kv, 8)
    assert model_builder.verify_rebuild(out, "tiny-lora") == []


def test_smollm2_is_the_wheels_gguf_de_quantized_with_its_own_tokenizer_and_template(smollm2_model_dir):
    """The real model (workers/gguf_model.py): a complete directory is kept; what vLLM loads is plain fp32 (no GGUF
    quantization_config, the tied lm_head left out); the chat template is the GGUF's own, in tokenizer_config.json
    (what the gateway reads) too, and renders as transformers renders it; digits are split as SmolLM2's tokenizer
    splits them (transformers' GGUF converter alone would not)."""
    import json

    import torch
    from gguf import GGUFReader
    from kvshuttle.services.gateway.tokens.tokenizer import GatewayTokenizer
    from kvshuttle.workers import gguf_model
    from safetensors import safe_open
    from transformers import AutoTokenizer

    stamp = (smollm2_model_dir / model_builder.STAMP).stat().st_mtime_ns
    assert model_builder.build_model(smollm2_model_dir, "smollm2") == smollm2_model_dir
    assert (smollm2_model_dir / model_builder.STAMP).stat().st_mtime_ns == stamp
    assert model_builder.is_complete(smollm2_model_dir, model_builder.recipe_hash(model_builder.recipe("smollm2", [])))

    config = json.loads((smollm2_model_dir / "config.json").read_text())
    assert "quantization_config" not in config and config["architectures"] == ["LlamaForCausalLM"]
    assert config["tie_word_embeddings"] and config["dtype"] == "float32" and config["rms_norm_eps"] == 1e-5
    assert {k: config[k] for k in gguf_model.ARCH} == gguf_model.ARCH
    with safe_open(smollm2_model_dir / "model.safetensors", "pt") as weights:
        assert "lm_head.weight" not in weights.keys() and len(weights.keys()) == 272
        assert weights.get_tensor("model.embed_tokens.weight").dtype == torch.float32

    template = str(GGUFReader(str(gguf_model.gguf_path())).fields["tokenizer.chat_template"].contents())
    assert "You are a helpful AI assistant named SmolLM" in template
    assert json.loads((smollm2_model_dir / "tokenizer_config.json").read_text())["chat_template"] == template
    assert (smollm2_model_dir / "chat_template.jinja").read_text() == template
    ours, theirs = GatewayTokenizer(smollm2_model_dir), AutoTokenizer.from_pretrained(smollm2_model_dir)
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    text = ours.render_chat(messages, True)
    assert text == theirs.apply_chat_template(messages, add_generation_prompt=True, tokenize=False) == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n")
    assert ours.encode(text, False)[:1] == [theirs.convert_tokens_to_ids("<|im_start|>")]  # one special token
    # Digits first, one by one: the two spaces before "12" are one token (GPT-2's split alone gives two).
    assert theirs.convert_ids_to_tokens(theirs.encode("a  12", add_special_tokens=False)) == ["a", "ĠĠ", "1", "2"]
    assert ours.encode("a  12", False) == theirs.encode("a  12", add_special_tokens=False)
