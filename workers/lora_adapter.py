"""Build the offline test LoRA adapter of a test model (``kvshuttle make-model DIR --variant tiny-lora``).

A PEFT-format adapter (``adapter_config.json`` + ``adapter_model.safetensors``, what vLLM's ``--lora-modules`` and
``LoRARequest`` load) for the tiny test model's architecture: rank 8 on every attention projection of every layer,
weights drawn from a fixed seed and large enough that greedy answers under the adapter differ from the base model's
(what the end-to-end test checks, so it knows the adapter was applied). Byte-identical on rebuild; the stamp works as
the models' does (workers/model_builder.py). The adapter's files hold no tokenizer: vLLM and the gateway use the
base model's.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

VERSION = 1
SEED = 20261207
RANK, ALPHA, STD = 8, 16, 0.1
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
# adapter variant -> the model variant it adapts
ADAPTERS = {"tiny-lora": "tiny"}


def recipe(variant: str, arch: dict) -> dict:
    return {"version": VERSION, "variant": variant, "base_variant": ADAPTERS[variant], "arch": arch, "seed": SEED,
            "rank": RANK, "alpha": ALPHA, "std": STD, "targets": list(TARGETS)}


def _shapes(arch: dict) -> dict[str, tuple[int, int]]:
    """(in, out) features of each target projection."""
    hidden, head_dim = arch["hidden_size"], arch["head_dim"]
    q, kv = arch["num_attention_heads"] * head_dim, arch["num_key_value_heads"] * head_dim
    return {"q_proj": (hidden, q), "k_proj": (hidden, kv), "v_proj": (hidden, kv), "o_proj": (q, hidden)}


def write(out_dir: Path, variant: str, arch: dict) -> None:
    """Write the adapter's config and weights into ``out_dir``."""
    import torch
    from safetensors.torch import save_file

    gen = torch.Generator().manual_seed(SEED)
    tensors = {}
    shapes = _shapes(arch)
    for layer in range(arch["num_hidden_layers"]):
        for target in TARGETS:
            fan_in, fan_out = shapes[target]
            prefix = f"base_model.model.model.layers.{layer}.self_attn.{target}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn((RANK, fan_in), generator=gen) * STD
            tensors[f"{prefix}.lora_B.weight"] = torch.randn((fan_out, RANK), generator=gen) * STD
    save_file(dict(sorted(tensors.items())), str(out_dir / "adapter_model.safetensors"),
              metadata={"format": "pt"})
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": RANK, "lora_alpha": ALPHA, "lora_dropout": 0.0,
              "bias": "none", "target_modules": list(TARGETS), "fan_in_fan_out": False, "modules_to_save": None,
              "base_model_name_or_path": ADAPTERS[variant], "inference_mode": True,
              "kvshuttle_recipe_sha256": hashlib.sha256(json.dumps(recipe(variant, arch),
                                                                   sort_keys=True).encode()).hexdigest()}
    (out_dir / "adapter_config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
