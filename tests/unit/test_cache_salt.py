"""Per-tenant prefix-cache salts: the derivation, the keys file's cache groups, and the worker-side pieces of the vLLM
patch (the metadata it reads, the requests it refuses, the engine hook). The patch on a real vLLM: tests/e2e/
test_tenant_cache.py."""

from __future__ import annotations

import json
import re

import pytest
from hypothesis import given
from hypothesis import strategies as st
from kvshuttle.control_plane import cache_salt
from kvshuttle.services.common.config import ConfigError
from kvshuttle.services.gateway.edge import auth
from kvshuttle.workers import vllm_call_options as patch
from smg_grpc_proto import vllm_engine_pb2

IDS = st.text(alphabet="abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789._:@=+-", min_size=1,
              max_size=64)


@given(IDS, IDS)
def test_salts_are_valid_stable_and_apart(a, b):
    salt = cache_salt.for_tenant(a)
    assert cache_salt.valid(salt) and salt == cache_salt.for_tenant(a)
    assert re.fullmatch(r"kvs1-[0-9a-f]{32}", salt)  # a digest: no tenant name on the workers
    # A tenant, and a group of the same name, get different salts; so do different tenants or groups.
    assert cache_salt.for_tenant(a) != cache_salt.for_tenant("x", cache_group=a)
    assert (cache_salt.for_tenant(a) == cache_salt.for_tenant(b)) == (a == b)
    # In a group, the tenant no longer matters.
    assert cache_salt.for_tenant(a, "g") == cache_salt.for_tenant(b, "g") != cache_salt.for_tenant(a)
    assert cache_salt.FREE_READ not in {cache_salt.for_tenant(a), cache_salt.for_tenant(a, b)}


def test_valid_salts():
    assert cache_salt.valid("kvs1-0123abcd") and cache_salt.valid(cache_salt.FREE_READ)
    for bad in ("", "a b", "a/b", "x" * 129, "é", "a\nb"):
        assert not cache_salt.valid(bad), bad


def _ring(tmp_path, *entries: dict) -> auth.KeyRing:
    path = tmp_path / "keys.json"
    path.write_text(json.dumps({"keys": list(entries)}))
    return auth.KeyRing.load(str(path))


def test_keys_file_cache_groups(tmp_path):
    ring = _ring(tmp_path, auth.entry("k-a", "acme", cache_group="shared"), auth.entry("k-a2", "acme", name="ci",
                                                                                          cache_group="shared"),
                 auth.entry("k-b", "globex", cache_group="shared"), auth.entry("k-c", "initech"))
    assert ring.principal("k-a").cache_group == "shared" and ring.principal("k-c").cache_group == ""
    assert ring.cache_group("acme") == ring.cache_group("globex") == "shared"
    assert ring.cache_group("initech") == "" and ring.cache_group("nobody") == ""
    with pytest.raises(ConfigError, match="same cache_group"):
        _ring(tmp_path, auth.entry("k-a", "acme", cache_group="one"), auth.entry("k-a2", "acme"))
    with pytest.raises(ConfigError, match="characters outside"):
        _ring(tmp_path, {**auth.entry("k-a", "acme"), "cache_group": "a/b"})
    with pytest.raises(ConfigError, match="must be a string"):
        _ring(tmp_path, {**auth.entry("k-a", "acme"), "cache_group": 3})
    with pytest.raises(auth.session_rules.InvalidArgument):
        auth.entry("k", "acme", cache_group="no spaces")


def test_hash_key_prints_the_cache_group(monkeypatch, capsys):
    monkeypatch.setattr("sys.stdin", type("In", (), {"readline": staticmethod(lambda: "kvs-some-key\n")})())
    auth.main(["--tenant", "acme", "--cache-group", "partners"])
    assert json.loads(capsys.readouterr().out)["cache_group"] == "partners"


def test_the_worker_reads_one_valid_salt_from_the_metadata():
    key = cache_salt.METADATA_KEY
    assert patch.salt_of(None) == (None, "") and patch.salt_of([("traceparent", "x")]) == (None, "")
    assert patch.salt_of([(key, "kvs1-ab"), ("x", "y"), (key, "kvs1-ab")]) == ("kvs1-ab", "")
    for metadata, words in (([(key, "a"), (key, "b")], "more than once"), ([(key, "a b")], "1-128 characters"),
                            ([(key, b"raw")], "1-128 characters")):
        salt, problem = patch.salt_of(metadata)
        assert salt is None and words in problem


def test_the_worker_salts_token_input_only():
    tokens = vllm_engine_pb2.GenerateRequest(request_id="r", tokenized=vllm_engine_pb2.TokenizedInput(input_ids=[1]))
    assert patch.refusal(tokens) == ""
    assert "token-id input" in patch.refusal(vllm_engine_pb2.GenerateRequest(request_id="r", text="hi"))
    with_media = vllm_engine_pb2.GenerateRequest()
    with_media.CopyFrom(tokens)
    with_media.mm_inputs.SetInParent()
    assert "multimodal" in patch.refusal(with_media)


class _Engine:
    """Records what vLLM's AsyncLLM.generate would receive."""

    def __init__(self):
        self.seen: list[dict] = []

    def generate(self, *, prompt, request_id, **kwargs):
        self.seen.append(prompt)
        self.kwargs = kwargs
        return request_id


def test_the_engine_hook_salts_only_the_request_it_was_given():
    engine = _Engine()
    waiting = patch.engine_options(engine)
    assert patch.engine_options(engine) is waiting  # hooked once
    waiting["r1"] = patch.Options(salt="kvs1-aa")
    rendered = {"type": "token", "prompt_token_ids": [1, 2]}
    assert engine.generate(prompt=rendered, request_id="r2") == "r2"  # another request: unchanged
    assert engine.generate(prompt=rendered, request_id="r1") == "r1"
    assert engine.seen == [rendered, {**rendered, "cache_salt": "kvs1-aa"}] and "cache_salt" not in rendered
    assert waiting == {}  # taken: the servicer wrapper knows it was applied
    waiting["r3"] = patch.Options(salt="kvs1-bb")
    with pytest.raises(ValueError, match="cannot take a cache salt"):
        engine.generate(prompt={**rendered, "cache_salt": "mm"}, request_id="r3")
