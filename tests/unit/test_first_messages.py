"""A new conversation's first message is tokenized once per gateway and tenant (tokens/first_messages.py): the
prompt's ids are exactly the whole text's, for every tool-call family's template, and the cache stays off for a
tokenizer whose ids a split would change."""

from __future__ import annotations

import json

import pytest
from kvshuttle.services.devtools.bench.gateway_capacity import TOOLS
from kvshuttle.services.gateway.tokens.first_messages import FirstMessages
from kvshuttle.services.gateway.tokens.tokenizer import GatewayTokenizer
from kvshuttle.services.gateway.turns import TurnContext, TurnRequest, TurnRunner
from kvshuttle.services.gateway.turns import prompt as prompt_stage
from kvshuttle.services.gateway.turns.spans import tracer
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

from tests.support.family_templates import FAMILY_TEMPLATES
from tests.support.turn_fakes import Registry, Scheduler

SYSTEM = "You are a careful assistant. " * 12  # a first message long enough to be kept
MORE_TOOLS = [*TOOLS, {"type": "function", "function": {
    "name": "search", "description": "Search the web for a query and say what was found, in a few words",
    "parameters": {"type": "object", "properties": {"query": {"type": "string"}, "limit": {"type": "integer"}},
                   "required": ["query"]}}}]


CORPUS = [SYSTEM, "What is the weather in Paris? Search the web for a query.", json.dumps(MORE_TOOLS),
          "Call a tool as <tool_call> with its name and arguments. Ünïcödé, 中文, emoji 🙂."] * 4


@pytest.fixture(scope="module")
def bpe_dir(tmp_path_factory):
    """A byte-level BPE tokenizer as Qwen's and the tiny test model's are (trained here on a few lines, in well
    under a second), with ChatML's special tokens; the family's template goes in per test."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(CORPUS, trainer=trainers.BpeTrainer(
        vocab_size=600, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    root = tmp_path_factory.mktemp("bpe")
    tok.save(str(root / "tokenizer.json"))
    return root


def bpe_tokenizer(root, template: str) -> GatewayTokenizer:
    (root / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>", "chat_template": template}))
    return GatewayTokenizer(root)


def turn_runner(tokenizer) -> TurnRunner:
    return TurnRunner(tokenizer, Registry(), Scheduler(0), max_model_len=100_000)


async def build(r: TurnRunner, messages: list[dict], tenant: str = "", **template_vars) -> TurnContext:
    ctx = TurnContext("t", TurnRequest(messages=messages, tenant=tenant, template_vars=template_vars), 0.0,
                      span=tracer.start_span("test"))
    await prompt_stage.build(r, ctx)
    return ctx


def chats() -> list[tuple[list[dict], list | None]]:
    return [
        ([{"role": "system", "content": SYSTEM}, {"role": "user", "content": "What is the weather in Paris?"}], TOOLS),
        ([{"role": "system", "content": SYSTEM + " Ünïcödé, 中文, emoji 🙂."},
          {"role": "user", "content": "hi"}], MORE_TOOLS),
        ([{"role": "system", "content": SYSTEM}, {"role": "user", "content": "one"}], None),
        ([{"role": "user", "content": "A first user message that is long enough to be kept. " * 8}], MORE_TOOLS),
        ([{"role": "system", "content": SYSTEM}, {"role": "user", "content": "a"}, {"role": "user", "content": "b"}],
         TOOLS),
    ]


@pytest.mark.parametrize("family", sorted(FAMILY_TEMPLATES))
async def test_a_first_turn_s_ids_are_the_whole_text_s_with_the_first_message_kept(bpe_dir, family):
    spec = FAMILY_TEMPLATES[family]
    tok = bpe_tokenizer(bpe_dir, spec.template)
    assert tok.first_messages is not None and tok.first_messages.markers == ["<|im_end|>"]
    r = turn_runner(tok)
    for messages, tools in chats():
        variables = {**spec.template_kwargs, **({"tools": tools} if tools else {})}
        for tenant in ("a", "a", "b"):  # a miss, a hit, another tenant's miss
            ctx = await build(r, messages, tenant, **variables)
            assert ctx.prompt_ids == tok.encode(ctx.prompt_text), (family, messages)
            cut = ctx.prompt_text.rfind("<|im_end|>") + len("<|im_end|>")
            # the record's cut at the last message's end has the ids of the text up to there
            (chars, tokens, _), = [c for c in ctx.text_cuts if c[0] == cut]
            assert ctx.prompt_ids[:tokens] == tok.encode(ctx.prompt_text[:chars])
    assert tok.first_messages.hits >= len(chats()) and len(tok.first_messages) >= 3


async def test_a_cached_first_message_is_not_tokenized_again_and_is_kept_per_tenant(bpe_dir):
    tok = bpe_tokenizer(bpe_dir, FAMILY_TEMPLATES["hermes"].template)
    assert tok.first_messages is not None  # its markers checked (a few encodes of their own) before counting
    calls: list[str] = []
    encode = tok.encode
    tok.encode = lambda text, add_special_tokens=False: calls.append(text) or encode(text, add_special_tokens)
    r = turn_runner(tok)
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "hi"}]
    first = await build(r, messages, "t1", tools=TOOLS)
    system_part = first.prompt_text[:first.prompt_text.index("<|im_end|>") + len("<|im_end|>")]
    assert calls[0] == system_part and len(calls) == 3  # the first message, then the rest in two parts
    calls.clear()
    again = await build(r, [*messages[:1], {"role": "user", "content": "another question"}], "t1", tools=TOOLS)
    assert system_part not in "".join(calls) and again.prompt_ids == encode(again.prompt_text)
    calls.clear()
    await build(r, messages, "t2", tools=TOOLS)  # another tenant: its own entry
    assert calls[0] == system_part
    assert (tok.first_messages.hits, tok.first_messages.misses) == (1, 2)


def test_the_cache_keeps_long_first_messages_only_and_drops_the_least_recently_used():
    cache = FirstMessages(["<end>"], min_chars=12, max_ids=40)
    assert cache.end("short<end>rest") == 0 and cache.end("no marker at all, long enough") == 0
    assert cache.end("a long first message<end>x<end>") == len("a long first message<end>")
    cache.put("t", "one", list(range(10)))
    cache.put("t", "two", list(range(10)))
    assert cache.get("t", "one") == tuple(range(10))  # now the most recently used
    cache.put("t", "three", list(range(10)))
    cache.put("t", "big", list(range(11)))  # over a quarter of the bound: never kept
    assert cache.get("t", "big") is None
    cache.put("t", "four", list(range(10)))
    cache.put("t", "five", list(range(10)))  # 50 ids over a bound of 40: the least recently used goes
    assert cache.get("t", "two") is None and cache.get("t", "one") is not None and cache.kept_ids == 40
    assert cache.get("t", "five") is not None and cache.get("u", "five") is None


def _model_dir(tmp_path, scheme: str, rstrip: bool):
    """A SentencePiece-style word tokenizer (Metaspace, ``prepend_scheme``) whose end marker is ``</s>``."""
    vocab = {"[UNK]": 0, "▁": 1, "\n": 2, **{w: i + 3 for i, w in enumerate(
        ["▁x", "x", "▁y", "y", "▁system", "system", "▁user", "user", "▁hi", "hi", "▁long", "long"])}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme=scheme)
    tok.add_special_tokens([AddedToken("</s>", special=True, normalized=False, rstrip=rstrip)])
    tok.save(str(tmp_path / "tokenizer.json"))
    template = "{% for m in messages %}{{ m.role }}\n{{ m.content }}</s>\n{% endfor %}"
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>", "chat_template": template}))
    return tmp_path


@pytest.mark.parametrize(("scheme", "rstrip", "kept"), [("always", False, True), ("never", False, True),
                                                        ("first", False, False), ("always", True, False)])
async def test_no_cache_for_a_tokenizer_whose_ids_a_split_would_change(tmp_path, scheme, rstrip, kept):
    """Metaspace's ``first`` scheme puts a space before a text's first word only (a split text would get two); an
    end marker that eats the whitespace after it would eat none at the start of the rest."""
    tok = GatewayTokenizer(_model_dir(tmp_path, scheme, rstrip))
    assert (tok.first_messages is not None) is kept
    if not kept:
        return
    r = turn_runner(tok)
    messages = [{"role": "system", "content": "long " * 80}, {"role": "user", "content": "hi x y"}]
    for _ in range(2):
        ctx = await build(r, messages)
        assert ctx.prompt_ids == tok.encode(ctx.prompt_text)
    assert tok.first_messages.hits == 1
