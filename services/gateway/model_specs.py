"""The gateway's ``--models`` flag: more models one gateway serves besides ``--model-dir``'s, each with its own
directory (tokenizer, chat template, config), parsers and context length.

``NAME=DIR[?key=value&...]`` entries separated by commas; the keys are ``tool_call_parser``, ``reasoning_parser``,
``chat_template`` (a file) and ``max_model_len``, e.g.
``agent=/models/agent?tool_call_parser=hermes&reasoning_parser=qwen3,tiny=/models/tiny``. Each model needs its own
prefill and decode workers (registered with ``Worker.model`` = NAME: the worker's ``--served-model-name``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import parse_qs

from kvshuttle.control_plane.kv_size import kv_bytes_per_token
from kvshuttle.control_plane.session import validate_model

KEYS = ("tool_call_parser", "reasoning_parser", "chat_template", "max_model_len")


class ModelSpecError(ValueError):
    pass


@dataclass(frozen=True)
class ModelSpec:
    name: str
    model_dir: str
    tool_call_parser: str = ""
    reasoning_parser: str = ""
    chat_template: str = ""
    max_model_len: int = 0  # 0: the model's max_position_embeddings

    def chat_template_text(self) -> str | None:
        return Path(self.chat_template).read_text() if self.chat_template else None

    def context_len(self) -> int:
        if self.max_model_len:
            return self.max_model_len
        config = json.loads(Path(self.model_dir, "config.json").read_text())
        return int(config.get("max_position_embeddings", 2048))

    def kv_bytes_per_token(self) -> int:
        """An estimate of one token's KV in bytes, from the model's config.json (0: unknown)."""
        try:
            return kv_bytes_per_token(json.loads(Path(self.model_dir, "config.json").read_text()))
        except (OSError, ValueError):
            return 0

    def problem(self) -> str | None:
        """What is wrong with the spec on this machine (None: nothing)."""
        if not Path(self.model_dir, "tokenizer.json").is_file():
            return f"--models: no tokenizer.json in {self.model_dir} (model {self.name!r})"
        if self.chat_template and not Path(self.chat_template).is_file():
            return f"--models: chat_template {self.chat_template!r} of model {self.name!r} is not a file"
        return None


def parse_models(text: str) -> list[ModelSpec]:
    """The specs of ``--models`` (see the module); ModelSpecError names what is wrong."""
    specs: list[ModelSpec] = []
    for entry in filter(None, (e.strip() for e in text.split(","))):
        head, _, query = entry.partition("?")
        name, sep, model_dir = head.partition("=")
        name, model_dir = name.strip(), model_dir.strip()
        if not sep or not name or not model_dir:
            raise ModelSpecError(f"--models: {entry!r} is not NAME=DIR[?key=value&...]")
        try:
            validate_model(name)
        except ValueError as exc:
            raise ModelSpecError(f"--models: {exc}") from None
        try:
            options = parse_qs(query, keep_blank_values=True, strict_parsing=True) if query else {}
        except ValueError:
            raise ModelSpecError(f"--models: model {name!r}: options {query!r} are not key=value&...") from None
        unknown = sorted(set(options) - set(KEYS))
        if unknown:
            raise ModelSpecError(f"--models: model {name!r}: unknown option {unknown[0]!r} (known: {', '.join(KEYS)})")
        fields = {k: v[-1] for k, v in options.items()}
        try:
            max_len = int(fields.pop("max_model_len", "0") or 0)
        except ValueError:
            raise ModelSpecError(f"--models: model {name!r}: max_model_len must be a whole number") from None
        if max_len < 0:
            raise ModelSpecError(f"--models: model {name!r}: max_model_len must be >= 0")
        specs.append(ModelSpec(name, model_dir, max_model_len=max_len, **fields))
    return specs
