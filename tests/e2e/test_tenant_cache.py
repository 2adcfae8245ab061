"""Each tenant's own prefix cache on the real stack (real vLLM P/D with NIXL): a tenant that sends another tenant's
exact history hits none of its blocks (``cached_tokens`` 0, nothing pulled, P's counters: all computed), the owner's
next turn still pulls and hits its own, and tenants of one cache group share their prefixes.

A gateway with an API keys file joins the shared stack (as in test_security): acme, globex, and initech and umbrella
in the cache group "partners".
"""

from __future__ import annotations

import json
import secrets
import time

import httpx
import pytest
from kvshuttle.services.devtools.etcd_process import free_port
from kvshuttle.services.gateway.edge import auth

from tests.support.e2e import flush_prefill, new_session, prompt_token_sources, user_turn

pytestmark = pytest.mark.e2e
KEYS = {tenant: f"kvs-e2e-{tenant}-{secrets.token_hex(12)}" for tenant in ("acme", "globex", "initech", "umbrella")}
GROUPS = {"initech": "partners", "umbrella": "partners"}


@pytest.fixture(scope="module")
async def keyed(stack, tmp_path_factory):
    """The keyed gateway's base URL."""
    path = tmp_path_factory.mktemp("keys") / "keys.json"
    path.write_text(json.dumps({"keys": [auth.entry(k, t, cache_group=GROUPS.get(t, "")) for t, k in KEYS.items()]}))
    http, grpc_address = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
    child = await stack._spawn("gateway-tenant-cache", "gateway", "--grpc-listen", grpc_address, "--http-listen",
                               http, "--max-model-len", str(stack.cfg.max_model_len), "--api-keys-file", str(path))
    try:
        await stack.wait_grpc(child, grpc_address, time.monotonic() + 120, internal=False)
        yield f"http://{http}"
    finally:
        await child.stop()
        stack.children.remove(child)


async def turn(stack, client: httpx.AsyncClient, tenant: str, session: str, messages: list[dict]) -> tuple[dict, dict]:
    """One chat turn as ``tenant``: the response body, and P's prompt tokens by source during it."""
    before = prompt_token_sources(stack)
    resp = await client.post("/v1/chat/completions", headers={
        "Authorization": f"Bearer {KEYS[tenant]}", "X-Session-ID": session},
        json={"messages": messages, "max_tokens": 8, "temperature": 0})
    assert resp.status_code == 200, resp.text
    after = prompt_token_sources(stack)
    return resp.json(), {k: after.get(k, 0) - before.get(k, 0) for k in set(after) | set(before)}


def cached(body: dict) -> int:
    return body["usage"]["prompt_tokens_details"]["cached_tokens"]


def continued(messages: list[dict], body: dict, text: str) -> list[dict]:
    return [*messages, {"role": "assistant", "content": body["choices"][0]["message"]["content"]},
            {"role": "user", "content": text}]


async def test_another_tenant_hits_nothing_of_a_tenants_history(stack, keyed):
    system = {"role": "system", "content": f"You review code. Case {secrets.token_hex(4)}."}
    session = new_session("tenant-cache-a")
    await flush_prefill(stack)
    async with httpx.AsyncClient(base_url=keyed, timeout=300) as client:
        first, _ = await turn(stack, client, "acme", session, [system, user_turn(7)])
        assert first["kvshuttle"]["decision"] == "recompute" and first["usage"]["prompt_tokens"] > 3 * 128
        history = continued([system, user_turn(7)], first, "And the edge cases?")

        # globex sends acme's exact history, even under acme's session id: P holds acme's first prompt in its prefix
        # cache, and D acme's whole turn, yet globex's prompt hits none of it and pulls nothing.
        other, sources = await turn(stack, client, "globex", session, history)
        kv = other["kvshuttle"]
        assert cached(other) == 0, other["usage"]
        assert kv["decision"] == "recompute" and kv["pulled_tokens"] == 0, kv
        assert sources.get("local_cache_hit", 0) == 0 and sources.get("external_kv_transfer", 0) == 0, sources
        assert sources.get("local_compute") == other["usage"]["prompt_tokens"], sources

        # acme's own next turn still pulls its history from D, and P's own cache still serves acme's first prompt.
        second, sources = await turn(stack, client, "acme", session, history)
        kv = second["kvshuttle"]
        assert kv["decision"] == "pull" and not kv["retried_as_recompute"] and kv["pulled_tokens"] > 0, kv
        assert cached(second) >= 128, second["usage"]
        assert sources.get("local_cache_hit", 0) >= 128, sources  # its first prompt's blocks, kept on P


async def test_tenants_of_one_cache_group_share_their_prefixes(stack, keyed):
    system = {"role": "system", "content": f"You answer briefly. Case {secrets.token_hex(4)}."}
    messages = [system, user_turn(8)]
    await flush_prefill(stack)
    async with httpx.AsyncClient(base_url=keyed, timeout=300) as client:
        first, _ = await turn(stack, client, "initech", new_session("tenant-cache-c"), messages)
        assert cached(first) == 0
        # umbrella, in initech's cache group, sends the same prompt in a session of its own: P's cache serves it.
        shared, sources = await turn(stack, client, "umbrella", new_session("tenant-cache-d"), messages)
        assert shared["kvshuttle"]["decision"] == "recompute" and shared["kvshuttle"]["pulled_tokens"] == 0
        whole_blocks = first["usage"]["prompt_tokens"] // 128 * 128
        assert cached(shared) >= whole_blocks - 128 > 0, shared["usage"]
        assert sources.get("local_cache_hit", 0) >= whole_blocks - 128, sources
        # acme, outside the group, gets nothing of it.
        alone, sources = await turn(stack, client, "acme", new_session("tenant-cache-e"), messages)
        assert cached(alone) == 0 and sources.get("local_cache_hit", 0) == 0, (alone["usage"], sources)
