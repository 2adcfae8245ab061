"""How many bytes one token's KV takes, estimated from a model's config.json (pure)."""

from __future__ import annotations

DTYPE_BYTES = {"float32": 4, "float": 4, "float16": 2, "half": 2, "bfloat16": 2, "float8": 1, "fp8": 1}


def kv_bytes_per_token(config: dict, dtype: str = "") -> int:
    """Bytes of K and V per token over all layers, at ``dtype`` (e.g. the dtype the engine serves with; empty: the
    model's), for standard multi-head / grouped-query attention (2 x layers x KV heads x head dim x dtype size).
    0 when the config does not say (e.g. MLA models)."""
    config = config.get("text_config", config)  # multimodal configs nest the language model's
    try:
        layers, heads = int(config["num_hidden_layers"]), int(config["num_attention_heads"])
        kv_heads = int(config.get("num_key_value_heads") or heads)
        head_dim = int(config.get("head_dim") or int(config["hidden_size"]) // heads)
    except (KeyError, TypeError, ValueError, ZeroDivisionError):
        return 0
    size = DTYPE_BYTES.get(str(dtype or config.get("dtype") or config.get("torch_dtype") or "").removeprefix("torch."),
                           0)
    return 2 * layers * kv_heads * head_dim * size
