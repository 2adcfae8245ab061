"""KV that no turn will read is freed on the decode worker at once, not at the end of its TTL (real stack).

A decode worker keeps each finished turn's KV for the next turn's pull, for ``decoder_kv_blocks_ttl`` (minutes).
Ending a conversation (``POST /v1/sessions/{id}/end``) frees it now: the gateway claims the handle and a prefill
worker reads its first block, after which vLLM frees all of the handle's blocks. Measured on the decode worker's own
count of used KV tokens (vLLM ``GetLoads``).
"""

from __future__ import annotations

import argparse
import inspect

import httpx
import pytest
from kvshuttle.services.engine.client import EngineClient
from kvshuttle.v1 import common_pb2

from tests.support.e2e import new_session
from tests.support.waits import until

pytestmark = pytest.mark.e2e


async def used_tokens(engine: EngineClient) -> int:
    loads = await engine.get_loads()
    return sum(int(x.get("num_used_tokens", 0)) for x in loads.get("loads", []))


async def test_ending_a_session_frees_its_kv_on_the_decode_worker(stack):
    decode = next(w for w in stack.workers if w.role == common_pb2.WORKER_ROLE_DECODE)
    engine = EngineClient(decode.grpc_address, timeout_s=10)
    session = new_session("end")
    messages = [{"role": "user", "content": inspect.getsource(argparse)[30000:39000] + "\nSummarize."}]
    try:
        async with httpx.AsyncClient(base_url=stack.base_url, timeout=300) as client:
            before = await used_tokens(engine)
            resp = await client.post("/v1/chat/completions", headers={"X-Session-ID": session},
                                     json={"messages": messages, "max_tokens": 8, "temperature": 0})
            assert resp.status_code == 200, resp.text
            prompt_tokens = resp.json()["usage"]["prompt_tokens"]
            held = await used_tokens(engine)
            ended = await client.post(f"/v1/sessions/{session}/end")
            assert ended.status_code == 200, ended.text
            assert ended.json() == {"deleted": True, "kvReleased": True}
            async def freed() -> tuple[int] | None:  # (a tuple: 0 tokens used is a fine answer)
                after = await used_tokens(engine)
                return (after,) if held - after >= prompt_tokens // 2 else None

            (after,) = await until(freed, 10, "the ended session's KV to be freed on the decode worker", interval_s=0.2)
            print(f"\nD's used KV tokens: {before} before the turn, {held} after it ({prompt_tokens} prompt tokens), "
                  f"{after} after ending the session")
            assert held - after >= prompt_tokens // 2, "the ended session's KV is still held on the decode worker"
            # Ending it again: nothing left to delete or free; the session is simply unknown now.
            again = await client.post(f"/v1/sessions/{session}/end")
            assert again.status_code == 200, again.text
            assert not again.json().get("deleted") and not again.json().get("kvReleased"), again.text
            gone = await client.get(f"/v1/sessions/{session}")
            assert gone.status_code == 404, gone.text
    finally:
        await engine.close()
