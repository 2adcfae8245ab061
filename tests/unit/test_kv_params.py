import json

import pytest
from kvshuttle.control_plane import kv_params


def handle(num_tokens=300, blocks=(10, 11, 12)):
    return {
        "do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": "d-engine",
        "remote_block_ids": [list(blocks)], "remote_host": "127.0.0.1", "remote_port": 5700,
        "remote_num_tokens": num_tokens, "remote_blocks_expiry_time": 123.4, "tp_size": 1,
    }


def test_parse_handle_reads_fields():
    h = kv_params.parse_handle(json.dumps(handle()))
    assert (h.engine_id, h.host, h.port, h.num_tokens) == ("d-engine", "127.0.0.1", 5700, 300)
    assert h.block_groups == ((10, 11, 12),)


@pytest.mark.parametrize("bad", [
    "not json", "[1]", json.dumps({**handle(), "do_remote_decode": False}),
    json.dumps({**handle(), "remote_block_ids": []}), json.dumps({**handle(), "remote_num_tokens": 0}),
    json.dumps({k: v for k, v in handle().items() if k != "remote_port"}),
])
def test_parse_handle_rejects(bad):
    with pytest.raises(kv_params.HandleError):
        kv_params.parse_handle(bad)


def test_pull_params_trim_blocks_to_tokens():
    h = kv_params.parse_handle(handle(num_tokens=300))
    full = kv_params.pull_params(h, 300, 128)
    assert full["remote_block_ids"] == [[10, 11, 12]] and full["remote_num_tokens"] == 300
    part = kv_params.pull_params(h, 256, 128)
    assert part["remote_block_ids"] == [[10, 11]] and part["remote_num_tokens"] == 256
    # The original handle is untouched.
    assert h.raw["remote_block_ids"] == [[10, 11, 12]]


def test_pull_params_drop_surplus_blocks_of_a_full_handle():
    # D may list a block for the last generated token that remote_num_tokens does not cover.
    h = kv_params.parse_handle(handle(num_tokens=256, blocks=(1, 2, 3)))
    assert kv_params.pull_params(h, 256, 128)["remote_block_ids"] == [[1, 2]]


def test_pull_params_refuse_impossible_pulls():
    h = kv_params.parse_handle(handle(num_tokens=300, blocks=(1, 2)))
    with pytest.raises(kv_params.HandleError):
        kv_params.pull_params(h, 300, 128)  # 3 blocks needed, 2 held: would kill P's engine
    with pytest.raises(kv_params.HandleError):
        kv_params.pull_params(h, 301, 128)


def test_d_can_continue_after_p_s_token_only_when_p_sent_a_block_for_it():
    from kvshuttle.control_plane.kv_params import covers_extra_token

    assert covers_extra_token({"remote_block_ids": [[1, 2, 3]]}, 256, 128)  # 257 tokens fit in 3 blocks
    assert not covers_extra_token({"remote_block_ids": [[1, 2]]}, 256, 128)  # the prompt fills 2 blocks exactly
    assert covers_extra_token({"remote_block_ids": [[1, 2]]}, 255, 128)
    assert not covers_extra_token({"remote_block_ids": [[1, 2, 3], [4, 5]]}, 256, 128)  # every group counts
    for params in (None, {}, {"remote_block_ids": None}, {"remote_block_ids": ["x"]}):
        assert not covers_extra_token(params, 10, 128)
    assert not covers_extra_token({"remote_block_ids": [[1]]}, 10, 0)


def test_the_freeing_read_takes_the_first_block_or_all_of_a_shorter_handle():
    handle = kv_params.parse_handle({"do_remote_decode": True, "remote_engine_id": "d", "remote_host": "h",
                                     "remote_port": 1, "remote_num_tokens": 300, "remote_block_ids": [[7, 8, 9]]})
    params, prompt = kv_params.free_read(handle, list(range(301)), 128)
    assert (params["remote_num_tokens"], params["remote_block_ids"], prompt) == (128, [[7]], list(range(129)))
    short = kv_params.parse_handle({**handle.raw, "remote_num_tokens": 40, "remote_block_ids": [[7]]})
    params, prompt = kv_params.free_read(short, list(range(41)), 128)
    assert (params["remote_num_tokens"], params["remote_block_ids"], prompt) == (40, [[7]], list(range(41)))
    with pytest.raises(kv_params.HandleError):  # the token after the pulled ones must be known
        kv_params.free_read(short, list(range(40)), 128)


def test_the_loaded_token_count_is_taken_out_of_ps_params_and_bounded():
    """P's returned params carry the tokens it loaded over NIXL (kvshuttle's plugin); the gateway takes the key out
    (D gets vLLM's own params) and never reports more than P's cached tokens; absent or malformed: unknown."""
    from kvshuttle.control_plane.kv_params import LOADED_TOKENS_KEY, take_loaded_tokens

    params = {"remote_block_ids": [[1]], LOADED_TOKENS_KEY: 256}
    assert take_loaded_tokens(params, 900) == 256 and params == {"remote_block_ids": [[1]]}
    assert take_loaded_tokens({LOADED_TOKENS_KEY: 5000}, 900) == 900
    assert take_loaded_tokens({LOADED_TOKENS_KEY: -3}, 900) == 0
    assert take_loaded_tokens({"remote_block_ids": [[1]]}, 900) is None and take_loaded_tokens(None, 900) is None
    bad = {LOADED_TOKENS_KEY: "256"}
    assert take_loaded_tokens(bad, 900) is None and bad == {}
