"""Every way in: the OpenAI Python client (streaming and not), the gRPC Gateway, the REST bridge, grpcurl and
health on the real services, bad input, traces, and the demo itself."""

from __future__ import annotations

import json
import re

import grpc
import httpx
import pytest
from kvshuttle.services.devtools.demo import run_demo
from kvshuttle.services.gateway.tokens.tokenizer import GatewayTokenizer
from kvshuttle.v1 import gateway_pb2, gateway_pb2_grpc, scheduler_pb2
from openai import AsyncOpenAI, BadRequestError

from tests.support.e2e import flush_prefill, new_session, user_turn
from tests.support.grpcurl import check_serving

pytestmark = pytest.mark.e2e
SYSTEM = {"role": "system", "content": "You are terse."}


def openai_client(stack) -> AsyncOpenAI:
    return AsyncOpenAI(base_url=f"{stack.base_url}/v1", api_key="unused", timeout=300)


async def test_openai_client_streams_and_pulls_on_the_second_turn(stack):
    client = openai_client(stack)
    session = new_session("openai")
    model = (await client.models.list()).data[0].id
    messages = [SYSTEM, user_turn(2)]
    first = await client.chat.completions.create(model=model, messages=messages, max_tokens=12, temperature=0,
                                                 extra_headers={"X-Session-ID": session})
    answer = first.choices[0].message.content
    assert first.usage.completion_tokens == 12 and answer
    assert first.model_extra["kvshuttle"]["record"] == "recorded"  # what the next turn pulls
    messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": "And then?"}]
    raw = await client.chat.completions.with_raw_response.create(
        model=model, messages=messages, max_tokens=12, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_headers={"X-Session-ID": session})
    assert raw.headers["x-kv-decision"] == "pull", raw.headers["x-kv-reason"]
    pieces, usage = [], None
    async for chunk in raw.parse():
        pieces += [c.delta.content or "" for c in chunk.choices]
        usage = chunk.usage or usage
    assert "".join(pieces) and usage.completion_tokens == 12
    completion = await client.completions.create(model=model, prompt="def main():", max_tokens=5, temperature=0)
    assert completion.choices[0].text and completion.usage.prompt_tokens > 0


@pytest.mark.parametrize("fields, named", [
    ({"tools": [{"type": "function", "function": {"name": "now", "parameters": {"type": "object"}}}]}, "tools"),
    ({"functions": [{"name": "now", "parameters": {"type": "object"}}]}, "functions"),
    ({"prediction": {"type": "content", "content": "x"}}, "prediction"),
    # sent as vLLM's own router sends it (the SDK's extra_body): only the scheduler decides what P pulls
    ({"extra_body": {"kv_transfer_params": {"remote_host": "10.9.9.9", "remote_port": 1}}}, "kv_transfer_params"),
])
async def test_openai_fields_the_gateway_does_not_apply_are_a_400_naming_them(stack, fields, named):
    client = openai_client(stack)
    model = (await client.models.list()).data[0].id
    with pytest.raises(BadRequestError) as err:
        await client.chat.completions.create(model=model, messages=[user_turn(1)], max_tokens=4, **fields)
    error = err.value.body
    assert err.value.status_code == 400 and error["param"] == named and named in error["message"], error


async def test_openai_sampling_fields_are_applied_on_prefill_and_decode(stack):
    client = openai_client(stack)
    model = (await client.models.list()).data[0].id
    tok = GatewayTokenizer(stack.model_dir)
    word = tok.encode(" wor")[0]
    eos = tok.eos_token_ids[0]

    async def ask(max_tokens: int = 6, **fields):
        r = await client.chat.completions.create(model=model, messages=[SYSTEM, user_turn(4)], max_tokens=max_tokens,
                                                 **fields)
        return r.choices[0], r.usage.completion_tokens

    # logit_bias: the token wins every step, the one P samples and all of D's
    choice, n = await ask(temperature=0, logit_bias={str(word): 100})
    assert choice.message.content == tok.decode([word]) * 6 and n == 6
    # stop_token_ids: P samples it first and the answer ends there; its text is left out
    choice, n = await ask(temperature=0, logit_bias={str(word): 100}, extra_body={"stop_token_ids": [word]})
    assert (choice.finish_reason, choice.message.content, n) == ("stop", "", 1)
    # min_tokens: neither P (its one token) nor D (min_tokens - 1 more) may stop before, then the forced stop comes
    for stopper in ({"stop_token_ids": [word]}, {}):
        bias = word if stopper else eos
        choice, n = await ask(max_tokens=8, temperature=0, logit_bias={str(bias): 100},
                              extra_body={"min_tokens": 3, **stopper})
        assert (choice.finish_reason, n) == ("stop", 4), (stopper, choice)
    # top_k=1 samples greedily at any temperature
    greedy, _ = await ask(max_tokens=12, temperature=0)
    top1, _ = await ask(max_tokens=12, temperature=1.5, seed=3, extra_body={"top_k": 1})
    assert top1.message.content == greedy.message.content
    # (presence/frequency/repetition penalties: their routing is checked in tests/unit/test_turns.py; no e2e check of
    # their effect yet: the tiny model's greedy answer does not repeat itself, so there is nothing for them to change)
    # min_p 1 keeps only the most likely token: greedy again
    choice, _ = await ask(max_tokens=12, temperature=1.5, seed=3, extra_body={"min_p": 1.0})
    assert choice.message.content == greedy.message.content


async def test_grpc_sampling_options_are_applied(stack):
    word = GatewayTokenizer(stack.model_dir).encode(" wor")[0]
    request = gateway_pb2.CompleteRequest(prompt="Once upon a time", sampling=gateway_pb2.SamplingOptions(
        max_tokens=5, logit_bias={word: 100.0}, min_tokens=2, stop_token_ids=[word]))
    async with grpc.aio.insecure_channel(stack.gateway_grpc) as channel:
        reply = await gateway_pb2_grpc.GatewayStub(channel).Complete(request)
    assert reply.finish_reason == "stop" and len(reply.token_ids) == 3 and reply.token_ids[-1] == word


async def test_grpc_gateway_unary_and_stream(stack):
    session = new_session("grpc")
    request = gateway_pb2.ChatCompleteRequest(
        session_id=session, messages=[gateway_pb2.ChatMessage(**SYSTEM), gateway_pb2.ChatMessage(**user_turn(3))],
        sampling=gateway_pb2.SamplingOptions(max_tokens=8))
    async with grpc.aio.insecure_channel(stack.gateway_grpc) as channel:
        stub = gateway_pb2_grpc.GatewayStub(channel)
        first = await stub.ChatComplete(request)
        assert first.kv.decision == scheduler_pb2.DECISION_RECOMPUTE and len(first.token_ids) == 8
        assert (first.kv.record, first.kv.record_error) == ("recorded", "")
        request.messages.add(role="assistant", content=first.message.content)
        request.messages.add(role="user", content="Go on.")
        call = stub.ChatCompleteStream(request)
        metadata = dict(await call.initial_metadata())
        events = [e async for e in call]
    assert metadata["x-kv-decision"] == "pull"
    assert events[0].WhichOneof("event") == "started" and events[0].started.kv.decision == scheduler_pb2.DECISION_PULL
    assert events[-1].WhichOneof("event") == "finished" and events[-1].finished.usage.completion_tokens == 8
    assert events[-1].finished.kv.record == "recorded" and not events[0].started.kv.record  # known at the end
    streamed = [t for e in events if e.WhichOneof("event") == "delta" for t in e.delta.token_ids]
    assert len(streamed) == 8
    # P computed none of the first prompt's whole blocks: it had them in its own cache or pulled them from D (the
    # pull loads over NIXL only what P's cache lacks: pulled_tokens counts that)
    done = events[-1].finished
    assert done.kv.pulled_tokens > 0
    assert done.usage.prompt_tokens - done.kv.computed_tokens >= len(first.prompt_token_ids) // 128 * 128 > 0


async def test_an_answer_without_a_limit_runs_to_the_end_of_the_context(stack):
    """No max_tokens (what agent frameworks send): up to the context left after the prompt, as vLLM does, on chat,
    Responses and gRPC, each saying which limit applied. The prompt leaves a few hundred tokens; the chat asks vLLM's
    ignore_eos so the tiny random model writes them all."""
    client = openai_client(stack)
    model = (await client.models.list()).data[0].id
    context = stack.cfg.max_model_len
    filler = " ".join(f"step {i}: read the next file." for i in range(410))
    chat = await client.chat.completions.create(model=model, messages=[{"role": "user", "content": filler}],
                                                temperature=0, extra_body={"ignore_eos": True})
    left = context - chat.usage.prompt_tokens
    assert 100 < left < 400, left
    assert chat.usage.completion_tokens == left and chat.choices[0].finish_reason == "length"
    extra = chat.model_extra["kvshuttle"]
    assert (extra["max_tokens"], extra["max_tokens_source"]) == (left, "context")
    resp = await client.responses.create(model=model, input=filler, temperature=0, store=False)
    assert resp.max_output_tokens == context - resp.usage.input_tokens
    assert resp.usage.output_tokens == resp.max_output_tokens or resp.status == "completed", resp.usage
    async with grpc.aio.insecure_channel(stack.gateway_grpc) as channel:
        reply = await gateway_pb2_grpc.GatewayStub(channel).Complete(gateway_pb2.CompleteRequest(
            prompt=filler, sampling=gateway_pb2.SamplingOptions(ignore_eos=True)))
    assert len(reply.token_ids) == reply.max_tokens == context - len(reply.prompt_token_ids)
    assert reply.max_tokens_source == "context" and reply.finish_reason == "length"


async def test_prompts_that_fill_their_last_block_exactly(stack):
    """A prompt of a whole number of KV blocks: P (prefix caching on) hands D exactly the prompt's blocks, so D must
    sample the first token itself (prompt + P's token would need one more block; vLLM's connector asserts on that
    and its engine dies). Then the next turn pulls, and the decode worker still serves."""
    block = stack.workers[0].block_size
    session = new_session("whole-blocks")
    async with grpc.aio.insecure_channel(stack.gateway_grpc) as channel:
        stub = gateway_pb2_grpc.GatewayStub(channel)

        async def turn(prompt: list[int]) -> gateway_pb2.CompleteResponse:
            resp = await stub.Complete(gateway_pb2.CompleteRequest(
                session_id=session, prompt_token_ids=prompt, sampling=gateway_pb2.SamplingOptions(max_tokens=4)))
            assert list(resp.prompt_token_ids) == prompt and len(resp.token_ids) == 4
            return resp

        first = await turn([(7 * i) % 500 + 10 for i in range(2 * block)])
        # the next turn extends what D holds (prompt + answer) with new tokens, up to exactly 3 blocks again
        history = list(first.prompt_token_ids) + list(first.token_ids)
        second = await turn(history + [(11 * i) % 500 + 10 for i in range(3 * block - len(history))])
        assert second.kv.decision == scheduler_pb2.DECISION_PULL, second.kv.reason


async def test_rest_bridge_serves_annotated_registry_reads(stack):
    session = new_session("rest")
    async with httpx.AsyncClient(base_url=stack.base_url, timeout=300) as client:
        workers = (await client.get("/v1/workers")).json()["workers"]
        assert {w["role"] for w in workers} == {"WORKER_ROLE_PREFILL", "WORKER_ROLE_DECODE"}
        assert all(w["blockSize"] > 0 and w["engineId"] for w in workers)
        missing = await client.get(f"/v1/sessions/{session}")
        assert missing.status_code == 404 and missing.json()["error"]["status"] == "NOT_FOUND"
        turn = await client.post("/v1/chat/completions", headers={"X-Session-ID": session},
                                 json={"messages": [SYSTEM, user_turn(1)], "max_tokens": 4, "temperature": 0})
        assert turn.status_code == 200
        record = (await client.get(f"/v1/sessions/{session}", params={"include_token_ids": "true"})).json()
        prompt_tokens = turn.json()["usage"]["prompt_tokens"]
        assert len(record["session"]["tokenIds"]) == prompt_tokens + 4
        assert record["session"]["coveredTokens"] == prompt_tokens + 3  # D holds KV for all but the last token
        assert record["expiresInS"] > 0
        deleted = await client.delete(f"/v1/sessions/{session}")
        assert deleted.status_code == 200 and deleted.json()["deleted"] is True


def test_grpcurl_lists_describes_and_health_checks_every_service(stack):
    check_serving(stack.registry_address, ["kvshuttle.v1.SessionRegistry"], stack.grpcurl_args())
    check_serving(stack.scheduler_address, ["kvshuttle.v1.TransferScheduler"], stack.grpcurl_args())
    check_serving(stack.gateway_grpc, ["kvshuttle.v1.Gateway"])


@pytest.mark.parametrize("body,status,word", [
    ({"messages": []}, 400, "messages"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, 400, "role"),
    ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": -1}, 400, "max_tokens"),
    ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 10**9}, 400, "max_tokens"),
    ({"messages": [{"role": "user", "content": "hi"}], "temperature": "hot"}, 400, "temperature"),
    ({"messages": [{"role": "user", "content": "hi"}], "model": "gpt-7"}, 404, "does not exist"),
    ({"messages": [{"role": "user", "content": "hi"}], "conversation_id": "x" * 300}, 400, "conversation_id"),
    ({"prompt": "x" * 200_000, "max_tokens": 1}, 400, "context"),
    ({"messages": [{"role": "user", "content": "hi"}], "policy": "fastest"}, 400, "unknown policy 'fastest'"),
    ({"messages": [{"role": "user", "content": "hi"}], "policy": "a;b"}, 400, "policy"),
])
async def test_bad_input_gets_a_4xx_json_error(stack, body, status, word):
    path = "/v1/completions" if "prompt" in body else "/v1/chat/completions"
    async with httpx.AsyncClient(base_url=stack.base_url, timeout=60) as client:
        resp = await client.post(path, json=body)
    assert resp.status_code == status, resp.text
    assert word in resp.json()["error"]["message"]
    assert resp.json()["error"]["code"] == ("model_not_found" if status == 404 else status)


async def test_malformed_json_and_bad_grpc_input(stack):
    async with httpx.AsyncClient(base_url=stack.base_url, timeout=60) as client:
        resp = await client.post("/v1/chat/completions", content=b"{nope", headers={"content-type": "application/json"})
    assert resp.status_code == 400 and "error" in resp.json()
    async with grpc.aio.insecure_channel(stack.gateway_grpc) as channel:
        stub = gateway_pb2_grpc.GatewayStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.Complete(gateway_pb2.CompleteRequest())
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "prompt" in err.value.details()


async def test_one_trace_per_turn_with_the_decision(stack, otlp):
    session = new_session("trace")
    async with httpx.AsyncClient(base_url=stack.base_url, timeout=300) as client:
        resp = await client.post("/v1/chat/completions", headers={"X-Session-ID": session},
                                 json={"messages": [SYSTEM, user_turn(4)], "max_tokens": 4, "temperature": 0})
    turn_id = resp.json()["id"]
    assert turn_id

    def has_turn(spans):
        turns = [s for s in spans if s["name"] == "kvshuttle.turn" and s["attributes"].get("kvshuttle.session")
                 and s["attributes"].get("kvshuttle.prompt_tokens") == resp.json()["usage"]["prompt_tokens"]]
        if not turns:
            return False
        trace_id = turns[-1]["trace_id"]
        names = {s["name"] for s in spans if s["trace_id"] == trace_id}
        return {"plan", "prefill", "decode", "record", "scheduler.plan_turn"} <= names

    spans = await otlp.wait_for(has_turn)
    turn = [s for s in spans if s["name"] == "kvshuttle.turn"
            and s["attributes"].get("kvshuttle.prompt_tokens") == resp.json()["usage"]["prompt_tokens"]][-1]
    attrs = turn["attributes"]
    assert attrs["kvshuttle.decision"] == "recompute" and attrs["kvshuttle.reason"]
    assert session not in json.dumps(attrs)  # session ids are hashed in traces
    in_trace = [s for s in spans if s["trace_id"] == turn["trace_id"]]
    services = {s["service"] for s in in_trace}
    assert {"kvshuttle-gateway", "kvshuttle-scheduler", "kvshuttle-registry"} <= services
    children = {s["name"] for s in in_trace if s["parent_id"] == turn["span_id"]}
    assert {"plan", "prefill", "decode", "record"} <= children


async def test_the_demo_conversation_runs_on_the_stack(stack, capsys):
    await flush_prefill(stack)
    assert await run_demo(stack, stack.cfg) == 0
    out = capsys.readouterr().out
    assert "every turn after the first pulled its history: yes" in out
    assert "answers identical with and without pulls: yes" in out
    assert re.search(r"^metrics \(http://\S+/metrics\): turns pull \d+, recompute \d+; prompt tokens \d+ = pulled "
                     r"\d+ \(\d+%\) \+ cached \d+ \+ computed \d+$", out, re.M), out


async def test_logprobs_come_from_prefill_and_decode_alike(stack):
    """Greedy answers with logprobs: every token (P samples the first, D the rest) is the most likely at its
    position, the streamed entries are the whole answer's, and completions get the legacy lists."""
    client = openai_client(stack)
    model = (await client.models.list()).data[0].id
    messages = [SYSTEM, user_turn(5)]
    whole = await client.chat.completions.create(model=model, messages=messages, max_tokens=8, temperature=0,
                                                 logprobs=True, top_logprobs=3, extra_body={"ignore_eos": True})
    content = whole.choices[0].logprobs.content
    assert len(content) == 8
    if not any("\ufffd" in e.token for e in content):  # a byte of a longer character spells as U+FFFD alone
        assert "".join(e.token for e in content) == whole.choices[0].message.content
    for entry in content:
        assert len(entry.top_logprobs) == 3 and entry.logprob <= 0
        assert entry.logprob == pytest.approx(max(t.logprob for t in entry.top_logprobs), abs=1e-4), entry
    stream = await client.chat.completions.create(model=model, messages=messages, max_tokens=8, temperature=0,
                                                  logprobs=True, top_logprobs=3, stream=True,
                                                  extra_body={"ignore_eos": True})
    streamed = [e async for chunk in stream for c in chunk.choices for e in (c.logprobs.content if c.logprobs else [])]
    assert [e.token for e in streamed] == [e.token for e in content]
    assert [e.logprob for e in streamed] == pytest.approx([e.logprob for e in content], abs=1e-3)
    legacy = (await client.completions.create(model=model, prompt="def main():", max_tokens=4, temperature=0,
                                              logprobs=2, extra_body={"ignore_eos": True})).choices[0]
    assert len(legacy.logprobs.tokens) == 4 and legacy.logprobs.text_offset[0] == 0
    assert all(len(t) == 2 for t in legacy.logprobs.top_logprobs)


async def test_what_the_client_received_is_what_was_recorded(stack):
    """An answer with special tokens (skipped in its text) and bytes that are no character (U+FFFD) in it, streamed:
    the client echoes back exactly what it was streamed, the non-streamed answer is the same text, and the next turn
    continues the recorded ids (special tokens included) and pulls all of them."""
    client = openai_client(stack)
    model = (await client.models.list()).data[0].id
    tok = GatewayTokenizer(stack.model_dir)
    special, rocket = tok.token_id("<|endoftext|>"), tok.encode("🚀")
    messages = [SYSTEM, user_turn(6)]
    async with httpx.AsyncClient(base_url=stack.base_url, timeout=300) as http:
        # Two tokens pushed far above the rest: greedy picks between them by the model's own logits, a mix whose
        # exact shape depends on the weights, so the first offset that mixes both is used.
        for offset in (0.0, 0.25, 0.5, 1.0, 2.0, 4.0, -0.25, -0.5, -1.0, -2.0):
            bias = {str(special): 100, str(rocket[1]): 100 + offset}
            probe = (await http.post("/v1/chat/completions", json={
                "messages": messages, "max_tokens": 12, "temperature": 0, "logit_bias": bias, "ignore_eos": True,
                "return_token_ids": True})).json()
            ids = probe["choices"][0]["token_ids"]
            if special in ids and rocket[1] in ids:
                break
        else:
            pytest.fail(f"no bias offset mixed the two tokens (last answer ids {ids})")
    args = dict(model=model, messages=messages, max_tokens=12, temperature=0, logit_bias=bias,
                extra_body={"ignore_eos": True})
    session = new_session("echo")
    stream = await client.chat.completions.create(**args, stream=True, extra_headers={"X-Session-ID": session})
    streamed = "".join([c.delta.content or "" async for chunk in stream for c in chunk.choices])
    whole = await client.chat.completions.create(**args, extra_headers={"X-Session-ID": new_session("echo-twin")})
    assert whole.choices[0].message.content == streamed and "<|endoftext|>" not in streamed
    assert "\ufffd" in streamed  # bytes that are no character
    async with httpx.AsyncClient(base_url=stack.base_url, timeout=30) as http:
        record = (await http.get(f"/v1/sessions/{session}", params={"include_token_ids": "true"})).json()["session"]
    assert special in record["tokenIds"][-12:], "the record holds the special token (skipped in the text)"
    messages += [{"role": "assistant", "content": streamed}, {"role": "user", "content": "And then?"}]
    raw = await client.chat.completions.with_raw_response.create(model=model, messages=messages, max_tokens=4,
                                                                 temperature=0,
                                                                 extra_headers={"X-Session-ID": session})
    kv = raw.parse().model_extra["kvshuttle"]
    assert raw.headers["x-kv-decision"] == "pull", kv["reason"]
    assert kv["matched_tokens"] == kv["covered_tokens"] == int(record["coveredTokens"]), kv
