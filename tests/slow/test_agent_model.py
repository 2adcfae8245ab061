"""The "agent" test model really calls tools: greedy decoding reproduces every step of the agent script, its template
renders the same in transformers and in the gateway, the echoed history re-renders what was generated, and the
build is byte-identical on rebuild. The tiny and medium recipes are untouched by the variant.

The model is built once into ``var/models/agent`` (kept between runs, rebuilt on recipe change; ~10 s), or where
``KVSHUTTLE_TEST_AGENT_MODEL_DIR`` says, like conftest's ``agent_model_dir`` but needing only torch and transformers.
"""

from __future__ import annotations

import fcntl
import importlib.util
import json
import os
import sys
from pathlib import Path

import pytest
from kvshuttle.services.gateway.tokens.tokenizer import ChatTemplateError, GatewayTokenizer
from kvshuttle.workers import agent_script as script
from kvshuttle.workers import model_builder

REPO = Path(__file__).resolve().parents[2]
# Computed with the builder before the agent variant existed: recipe hashes without the corpus (any Python), and
# with this interpreter's standard library as the corpus (checked on that Python version only).
RECIPES_WITHOUT_CORPUS = {
    "tiny": "9ac3d6e7aa1e53141c8f9e30b8993f7676520d42c1d6ef6b5ffe84665cc80ec1",
    "medium": "0f44007e491107361c4ac6621c8ac4e826e816aff2dd0231eac326074254984a",
}
CORPUS_PYTHON = (3, 11, 7)
RECIPES = {
    "tiny": "22d31b23159d2283faf0d4be60cecbd9bc6be3f936546ca6164fef2c6ee08c16",
    "medium": "2005d750262cf8104daa1011f30b8b313cc6fdee3229431e8aec5e82f3e2c610",
}
STEPS = [(conv, step) for conv in script.CONVERSATIONS for step in range(len(conv.steps))]
STEP_IDS = [f"{conv.name}-{step}" for conv, step in STEPS]


def _require(module: str) -> None:
    if importlib.util.find_spec(module) is not None:
        return
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(f"{module} is not installed: CI runs every test (make install installs it)", pytrace=False)
    pytest.skip(f"{module} is not installed")


@pytest.fixture(scope="module")
def agent_dir() -> Path:
    for module in ("torch", "transformers"):
        _require(module)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    out = Path(os.environ.get("KVSHUTTLE_TEST_AGENT_MODEL_DIR", REPO / "var" / "models" / "agent"))
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.parent / f".{out.name}.lock", "w") as lock:  # parallel sessions build it once
        fcntl.flock(lock, fcntl.LOCK_EX)
        return model_builder.build_model(out, "agent")


@pytest.fixture(scope="module")
def hf_tokenizer(agent_dir):
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast.from_pretrained(agent_dir)


@pytest.fixture(scope="module")
def gateway_tokenizer(agent_dir) -> GatewayTokenizer:
    return GatewayTokenizer(agent_dir)


@pytest.fixture(scope="module")
def model(agent_dir):
    import torch
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM.from_pretrained(agent_dir, dtype=torch.float32).eval()


@pytest.mark.parametrize("variant", sorted(RECIPES))
def test_other_recipes_are_unchanged(variant):
    assert model_builder.recipe_hash(model_builder.recipe(variant, [])) == RECIPES_WITHOUT_CORPUS[variant]
    if sys.version_info[:3] == CORPUS_PYTHON:
        assert model_builder.recipe_hash(model_builder.recipe(variant, model_builder.corpus_files())) == RECIPES[variant]


def test_agent_recipe_covers_template_tokens_training_and_script(monkeypatch, tmp_path):
    def agent_hash() -> str:
        return model_builder.recipe_hash(model_builder.recipe("agent", []))

    base = agent_hash()
    assert base != RECIPES_WITHOUT_CORPUS["tiny"]
    for name, value in [("AGENT_CHAT_TEMPLATE", model_builder.AGENT_CHAT_TEMPLATE + " "),
                        ("AGENT_ADDED_TOKENS", [*model_builder.AGENT_ADDED_TOKENS, "<x>"]),
                        ("AGENT_TRAINING", {**model_builder.AGENT_TRAINING, "lr": 1e-3}),
                        ("AGENT_VERSION", model_builder.AGENT_VERSION + 1)]:
        with monkeypatch.context() as m:
            m.setattr(model_builder, name, value)
            assert agent_hash() != base, name
    edited = tmp_path / "agent_script.py"
    edited.write_bytes(Path(script.__file__).read_bytes() + b"\n")
    monkeypatch.setattr(script, "__file__", str(edited))
    assert agent_hash() != base


def test_tokenizer_adds_tool_and_think_tokens_not_special(agent_dir, gateway_tokenizer):
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(agent_dir / "tokenizer.json"))
    for i, token in enumerate(script.ADDED_TOKENS):
        assert tok.encode(token, add_special_tokens=False).ids == [model_builder.VOCAB_SIZE + i]
    ids = tok.encode("<think>\nx\n</think>\n\n<tool_call>\n{}\n</tool_call><|im_end|>", add_special_tokens=False).ids
    assert tok.decode(ids, skip_special_tokens=True) == "<think>\nx\n</think>\n\n<tool_call>\n{}\n</tool_call>"
    config = json.loads((agent_dir / "config.json").read_text())
    assert config["vocab_size"] % 8 == 0 and 0 <= config["vocab_size"] - tok.get_vocab_size() < 8
    assert gateway_tokenizer.eos_token_ids == [tok.token_to_id("<|im_end|>")]
    assert json.loads((agent_dir / "tokenizer_config.json").read_text())["chat_template"] == script.AGENT_CHAT_TEMPLATE
    stamp = json.loads((agent_dir / model_builder.STAMP).read_text())
    assert stamp["training"]["min_margin"] >= model_builder.AGENT_TRAINING["min_margin"]


def _chats():
    """Every prompt of both conversations, plus each whole conversation."""
    for conv in script.CONVERSATIONS:
        for step in range(len(conv.steps) + 1):
            yield conv, script.messages_after(step, conv)


@pytest.mark.parametrize("with_tools", [True, False])
@pytest.mark.parametrize("extra", [{}, {"enable_thinking": False}, {"enable_thinking": True}])
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_gateway_renders_like_transformers(hf_tokenizer, gateway_tokenizer, with_tools, extra, add_generation_prompt):
    for conv, messages in _chats():
        tools = (conv.tools or script.TOOLS) if with_tools else None
        want = hf_tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=add_generation_prompt,
                                                tokenize=False, **extra)
        assert gateway_tokenizer.render_chat(messages, add_generation_prompt, tools=tools, **extra) == want
    if with_tools:
        assert want.startswith(f"<|im_start|>system\n{script.SYSTEM}\n\n# Tools\n<tools>\n{json.dumps(script.WEATHER_TOOL)}")
    if add_generation_prompt:
        thinking_off = extra.get("enable_thinking") is False
        assert want.endswith("<|im_start|>assistant\n" + ("<think>\n\n</think>\n\n" if thinking_off else ""))


def test_unknown_role_is_refused(hf_tokenizer, gateway_tokenizer):
    messages = [{"role": "robot", "content": "beep"}]
    with pytest.raises(ChatTemplateError, match="unknown role: robot"):
        gateway_tokenizer.render_chat(messages, True, tools=script.TOOLS)
    with pytest.raises(Exception, match="unknown role: robot"):
        hf_tokenizer.apply_chat_template(messages, tools=script.TOOLS, tokenize=False)


@pytest.mark.parametrize(("conv", "step"), STEPS, ids=STEP_IDS)
def test_echoed_history_rerenders_the_generated_text(gateway_tokenizer, conv, step):
    prompt = gateway_tokenizer.render_chat(script.messages_after(step, conv), True, tools=conv.tools)
    after = gateway_tokenizer.render_chat(script.messages_after(step + 1, conv), False, tools=conv.tools)
    assert after.startswith(prompt + script.assistant_text(step, conv) + "\n")
    # The ids too: the reply's tokens are those of the whole conversation at that place.
    reply = gateway_tokenizer.encode(script.assistant_text(step, conv))
    assert gateway_tokenizer.encode(after)[:len(gateway_tokenizer.encode(prompt)) + len(reply)] == (
        gateway_tokenizer.encode(prompt) + reply)


@pytest.mark.parametrize(("conv", "step"), STEPS, ids=STEP_IDS)
def test_greedy_decoding_reproduces_the_script(hf_tokenizer, model, conv, step):
    import torch

    prompt = hf_tokenizer.apply_chat_template(script.messages_after(step, conv), tools=conv.tools,
                                              add_generation_prompt=True, tokenize=False)
    prompt_ids = hf_tokenizer.encode(prompt, add_special_tokens=False)
    want_text = script.assistant_text(step, conv)
    want_ids = hf_tokenizer.encode(want_text, add_special_tokens=False)
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt_ids]), attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
                             do_sample=False, max_new_tokens=len(want_ids) + 8)
    got_ids = out[0, len(prompt_ids):].tolist()
    assert hf_tokenizer.decode(got_ids, skip_special_tokens=False) == want_text
    assert got_ids == want_ids
    # What a server returns with skip_special_tokens: the tool-call and think tags stay for the parsers.
    assert hf_tokenizer.decode(got_ids, skip_special_tokens=True) == want_text.removesuffix("<|im_end|>")


def test_script_helpers():
    assert len(script.TURNS) >= 6 and script.TURNS is script.AGENT.steps
    assert [len(s.tool_calls) for s in script.TURNS][:3] == [1, 0, 2]
    assert script.assistant_text(1) == ("<think>\nThe tool says 21 °C and sunny.\n</think>\n\n"
                                        "It is 21 °C and sunny in Paris.<|im_end|>")
    echoed = script.assistant_message(2)
    assert echoed["content"] is None and [c["function"]["arguments"] for c in echoed["tool_calls"]] == [
        '{"city": "Oslo"}', '{"city": "Rome"}']
    assert [m["tool_call_id"] for m in script.inputs(3, call_ids=["a", "b"])] == ["a", "b"]
    assert script.tool_calls(0) == [{"name": "get_weather", "arguments": {"city": "Paris"}}]
    assert script.messages_after(0, script.PLAIN) == [{"role": "system", "content": script.SYSTEM},
                                                      {"role": "user", "content": "Say hello."}]


def test_rebuild_is_byte_identical(agent_dir):
    assert model_builder.verify_rebuild(agent_dir, "agent") == []
