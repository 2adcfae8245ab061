"""The gateway's tokenizer: HF `tokenizer.json` + chat template, with only `tokenizers` and `jinja2` (no transformers).

Rendering follows transformers' chat-template environment (sandboxed, ``trim_blocks``/``lstrip_blocks``,
``raise_exception``, ``strftime_now``, a ``tojson`` that keeps non-ASCII, the special tokens as variables, and the
``{% generation %}`` block) so prompts match what the model was trained to see. The sandbox takes shortcuts for the
lookups chat templates make most (``message.role``, ``content.strip``, ``loop.first``) that give the same results as
its general path (tests/unit/test_tokenizer_render.py compares the two).
"""

from __future__ import annotations

import json
import types
from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime
from functools import cached_property
from pathlib import Path
from typing import Any

import jinja2
from jinja2 import nodes
from jinja2.ext import Extension
from jinja2.runtime import Context, LoopContext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from kvshuttle.services.gateway.tokens.byte_pieces import byte_tables
from kvshuttle.services.gateway.tokens.first_messages import FirstMessages, safe_markers
from tokenizers import Tokenizer

# Special tokens that end a message, in template families whose EOS tokens end only the model's answers: gpt-oss's
# Harmony ends every message with <|end|> (answers with <|return|> or <|call|>, its EOS tokens).
MESSAGE_END_TOKENS = ("<|end|>",)
SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token")


class ChatTemplateError(ValueError):
    """The template refused the conversation (``raise_exception``) or failed to render."""


def _raise_exception(message: str) -> None:
    raise ChatTemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _GenerationBlock(Extension):
    """``{% generation %}...{% endgeneration %}`` (HF's assistant-mask marker): renders its body unchanged."""

    tags = {"generation"}

    def parse(self, parser: Any) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.Scope(body, lineno=lineno)


# Names that ``getattr`` finds on a plain dict (its own and object's attributes): any other name is a key lookup.
_DICT_ATTRIBUTES = frozenset(name for cls in dict.__mro__ for name in vars(cls))
# The str methods the sandbox allows as they are: public ones, except format/format_map (which it wraps).
_PLAIN_STR_METHODS = frozenset(name for name in vars(str) if not name.startswith("_")) - {"format", "format_map"}
# The loop variable's public attributes (``loop.first``, ``loop.nextitem``, ...), all safe for the sandbox.
_LOOP_ATTRIBUTES = frozenset(name for name in vars(LoopContext) if not name.startswith("_"))


class _ChatTemplateEnvironment(ImmutableSandboxedEnvironment):
    """transformers' sandbox, with fast paths for what chat templates do most that give the same results.

    Chat templates read dict keys as attributes (``message.role``): the sandbox first tries ``getattr`` on the dict,
    which raises AttributeError (slow), then indexes it. For a plain ``dict`` and a name that is no dict attribute
    that ``getattr`` must fail, so the key is looked up at once. ``str`` methods such as ``strip`` are allowed by the
    sandbox unchanged (only format/format_map are wrapped), and calling them needs no context; so are the public
    attributes of ``loop`` (its items still pass the format wrapper). Everything else (other types, dict attributes
    such as ``items``, underscore names, format) takes the sandbox's own path.
    """

    def getattr(self, obj: Any, attribute: str) -> Any:
        cls = type(obj)
        if cls is dict and attribute not in _DICT_ATTRIBUTES:
            try:
                return obj[attribute]
            except (TypeError, LookupError):
                return self.undefined(obj=obj, name=attribute)
        if cls is str and attribute in _PLAIN_STR_METHODS:
            return getattr(obj, attribute)
        if cls is LoopContext and attribute in _LOOP_ATTRIBUTES:
            try:
                value = getattr(obj, attribute)
            except AttributeError:
                return super().getattr(obj, attribute)
            wrapped = self.wrap_str_format(value)  # previtem/nextitem are items of any kind
            return value if wrapped is None else wrapped
        return super().getattr(obj, attribute)

    # Named as in jinja2 (``__self``...), so that the template's keyword arguments cannot clash with them.
    def call(__self, __context: Context, __obj: Any, *args: Any, **kwargs: Any) -> Any:
        if type(__obj) is types.BuiltinMethodType and type(__obj.__self__) is str \
                and __obj.__name__ in _PLAIN_STR_METHODS:
            kwargs.pop("_block_vars", None)
            kwargs.pop("_loop_vars", None)
            return __obj(*args, **kwargs)
        return super().call(__context, __obj, *args, **kwargs)


def _token_text(value: Any) -> str | None:
    if isinstance(value, Mapping):
        return value.get("content")
    return value


class GatewayTokenizer:
    """Tokenizer and chat template of one model directory (``chat_template``: another template instead of its own)."""

    def __init__(self, model_dir: str | Path, chat_template: str | None = None):
        root = Path(model_dir)
        self.model_dir = root
        self._tok = Tokenizer.from_file(str(root / "tokenizer.json"))
        cfg_path = root / "tokenizer_config.json"
        self.config: dict[str, Any] = json.loads(cfg_path.read_text()) if cfg_path.exists() else {}
        self.special_tokens = {key: _token_text(self.config.get(key)) for key in SPECIAL_TOKEN_KEYS}
        # Like transformers, a chat_template.jinja file wins over the config's field.
        jinja_path = root / "chat_template.jinja"
        template = jinja_path.read_text() if jinja_path.exists() else self.config.get("chat_template")
        if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}, ...]
            named = {t["name"]: t["template"] for t in template}
            template = named.get("default")
        template = chat_template or template
        if not template:
            raise ValueError(f"{root}: no chat template")
        self.chat_template: str = template
        env = _ChatTemplateEnvironment(trim_blocks=True, lstrip_blocks=True,
                                       extensions=[_GenerationBlock, "jinja2.ext.loopcontrols"])
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = _strftime_now
        self._template = env.from_string(template)

    def render_chat(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
                    **extra: Any) -> str:
        """The prompt text for ``messages`` (``extra`` passes e.g. ``tools`` to the template)."""
        # As in transformers: tools/documents are always defined (None when absent); special tokens as variables.
        variables: dict[str, Any] = {"tools": None, "documents": None}
        variables.update((k, v) for k, v in self.special_tokens.items() if v is not None)
        variables.update(extra)
        try:
            return self._template.render(messages=list(messages), add_generation_prompt=add_generation_prompt,
                                         **variables)
        except ChatTemplateError:
            raise
        except jinja2.TemplateError as exc:
            raise ChatTemplateError(f"chat template failed: {exc}") from exc

    @property
    def backend(self) -> Tokenizer:
        """The tokenizers library's tokenizer underneath (the detokenizer steps in it)."""
        return self._tok

    @cached_property
    def _byte_tables(self) -> dict[bool, list[bytes]] | None:
        return byte_tables(self._tok)

    def byte_table(self, skip_special_tokens: bool = True) -> list[bytes] | None:
        """Each id's bytes, for a byte-level tokenizer that provably decodes as their UTF-8 (else None): the
        detokenizer's per-token step (tokens/byte_pieces.py). Made on first use (a vocabulary's batch decode)."""
        tables = self._byte_tables
        return tables[skip_special_tokens] if tables is not None else None

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of ``text``; special tokens written in the text become their ids."""
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(ids if type(ids) is list else list(ids), skip_special_tokens=skip_special_tokens)

    def token_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    @cached_property
    def end_markers(self) -> list[str]:
        """Where a message ends in a rendered chat: the texts of the EOS tokens (where an answer ends in a recorded
        text), and the special tokens that end other messages in a template family whose EOS tokens do not
        (Harmony's ``<|end|>``). Finding sessions by content cuts prompts there."""
        eos = {text for i in self.eos_token_ids if (text := self._tok.id_to_token(i))}
        specials = {t.content for t in self._tok.get_added_tokens_decoder().values() if t.special}
        return sorted(eos | (specials & set(MESSAGE_END_TOKENS)))

    @cached_property
    def first_messages(self) -> FirstMessages | None:
        """The cache of new conversations' first messages' ids; None when no end marker splits a text safely."""
        markers = safe_markers(self, self.end_markers)
        return FirstMessages(markers) if markers else None

    @cached_property
    def eos_token_ids(self) -> list[int]:
        """The eos token of the tokenizer plus those of generation_config.json / config.json, sorted."""
        ids: set[int] = set()
        eos = self.special_tokens.get("eos_token")
        if eos is not None and self._tok.token_to_id(eos) is not None:
            ids.add(self._tok.token_to_id(eos))
        for name in ("generation_config.json", "config.json"):
            path = self.model_dir / name
            if not path.exists():
                continue
            value = json.loads(path.read_text()).get("eos_token_id")
            if isinstance(value, int):
                ids.add(value)
            elif isinstance(value, list):
                ids.update(v for v in value if isinstance(v, int))
        return sorted(ids)
