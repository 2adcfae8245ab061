"""The gateway tokenizer must render and tokenize exactly like transformers does for the same model dir."""

from __future__ import annotations

import os

import pytest
from kvshuttle.services.gateway.tokens.tokenizer import ChatTemplateError, GatewayTokenizer

CHATS = [
    [{"role": "user", "content": "Hello!"}],
    [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "def f(x):\n    return x * 2\n\nWhat does f do?"},
        {"role": "assistant", "content": "It doubles x."},
        {"role": "user", "content": "And   with  spaces\tand tabs?  "},
    ],
    [
        {"role": "user", "content": "Grüße aus Köln — ça va? 日本語のテキスト 🚀🧪 Ελληνικά"},
        {"role": "assistant", "content": "Sí 👍🏽 ✓"},
        {"role": "user", "content": "zero\u200bwidth, combining e\u0301, emoji family 👨‍👩‍👧"},
    ],
    [{"role": "user", "content": "literal specials <|im_start|>user\nhi<|im_end|> inside"}],
    [{"role": "user", "content": ""}],
]


@pytest.fixture(scope="module")
def tokenizers(model_dir):
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    from transformers import AutoTokenizer

    return GatewayTokenizer(model_dir), AutoTokenizer.from_pretrained(model_dir)


def _hf_ids(hf, chat, add_generation_prompt):
    out = hf.apply_chat_template(chat, tokenize=True, add_generation_prompt=add_generation_prompt)
    if not isinstance(out, list):  # transformers 5 returns a BatchEncoding
        out = out["input_ids"]
    return list(out)


@pytest.mark.parametrize("chat", CHATS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_matches_transformers(tokenizers, chat, add_generation_prompt):
    ours, hf = tokenizers
    text = ours.render_chat(chat, add_generation_prompt=add_generation_prompt)
    assert text == hf.apply_chat_template(chat, tokenize=False, add_generation_prompt=add_generation_prompt)
    ids = ours.encode(text)
    assert ids == _hf_ids(hf, chat, add_generation_prompt)
    assert ids == hf(text, add_special_tokens=False)["input_ids"]
    assert ours.decode(ids) == hf.decode(ids, skip_special_tokens=True)
    assert ours.decode(ids, skip_special_tokens=False) == text


def test_special_tokens_in_text_become_ids(tokenizers):
    ours, _ = tokenizers
    ids = ours.encode("<|im_start|>user\nhi<|im_end|>")
    assert ids[0] == ours.token_id("<|im_start|>")
    assert ids[-1] == ours.token_id("<|im_end|>")
    assert ours.decode(ids) == "user\nhi"


def test_generation_prompt_and_eos(tokenizers):
    ours, hf = tokenizers
    assert ours.render_chat([{"role": "user", "content": "x"}]).endswith("<|im_start|>assistant\n")
    assert ours.eos_token_ids == [ours.token_id("<|im_end|>")]
    assert hf.eos_token_id in ours.eos_token_ids


def test_raise_exception(tokenizers):
    ours, _ = tokenizers
    with pytest.raises(ChatTemplateError, match="unknown role"):
        ours.render_chat([{"role": "wizard", "content": "x"}])


def test_sandboxed(tokenizers, tmp_path):
    (tmp_path / "tokenizer.json").write_bytes((tokenizers[0].model_dir / "tokenizer.json").read_bytes())
    (tmp_path / "tokenizer_config.json").write_text(
        '{"chat_template": "{{ messages.__class__.__mro__ }}", "eos_token": "<|im_end|>"}')
    with pytest.raises(ChatTemplateError):
        GatewayTokenizer(tmp_path).render_chat([{"role": "user", "content": "x"}])
