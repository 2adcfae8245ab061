"""Small tracing helpers: the server a gRPC client span names, and the KV-bytes-per-token estimate."""

from __future__ import annotations

from kvshuttle.control_plane.kv_size import kv_bytes_per_token
from kvshuttle.services.common.telemetry import server_attributes


def test_server_attributes_of_grpc_targets():
    assert server_attributes("10.0.0.7:50061") == {"server.address": "10.0.0.7", "server.port": 50061}
    assert server_attributes("[::1]:50051") == {"server.address": "::1", "server.port": 50051}
    assert server_attributes("dns:///registry.kvs.svc:50051") == {"server.address": "registry.kvs.svc",
                                                                  "server.port": 50051}
    assert server_attributes("unix:/run/kvs.sock") == server_attributes("registry") == {}


def test_kv_bytes_per_token_from_a_model_config():
    llama_8b = {"num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "hidden_size": 4096,
                "torch_dtype": "bfloat16"}
    assert kv_bytes_per_token(llama_8b) == 2 * 32 * 8 * 128 * 2  # 128 KiB a token
    tiny = {"num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
            "hidden_size": 256, "dtype": "float32"}
    assert kv_bytes_per_token(tiny) == 4096
    assert kv_bytes_per_token({"text_config": tiny}) == 4096
    assert kv_bytes_per_token({**tiny, "dtype": "int4-awq"}) == 0  # unknown dtype: no estimate
    assert kv_bytes_per_token({"kv_lora_rank": 512}) == 0  # not standard attention (MLA): no estimate
