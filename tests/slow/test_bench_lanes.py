"""The benchmark's lanes replay agentic conversations (tools, forced tool calls, tool results) the same way in every
mode: the gateway lanes through the OpenAI API (a mock gateway here), the direct and ideal lanes on engines (fakes
here) with the same prompts, constraints and sampling the gateway would use."""

from __future__ import annotations

import asyncio
import json
import shutil
from pathlib import Path

import httpx
import pytest
from kvshuttle.control_plane.constraints import CALL_SYNTAX, forced_tool_calls
from kvshuttle.services.devtools.bench import lanes
from kvshuttle.services.devtools.bench.workload import CALL_MIN_TOKENS, Conversation, Turn, agentic_conversations
from kvshuttle.services.engine.client import Chunk, Final
from kvshuttle.services.gateway.tokens.tokenizer import GatewayTokenizer
from kvshuttle.workers.agent_script import AGENT_CHAT_TEMPLATE

SMALL = dict(max_history_tokens=3000, system_tokens=1000, turn_tokens=(100, 300), max_tokens=16)
FINAL_TEXT = "All done."


@pytest.fixture(scope="module")
def tools_tokenizer(model_dir: Path, tmp_path_factory) -> GatewayTokenizer:
    """The tiny model's tokenizer with the agent chat template: the tiny-tools model's tokenizer files."""
    out = tmp_path_factory.mktemp("tiny-tools")
    for name in ("tokenizer.json", "tokenizer_config.json", "config.json", "generation_config.json"):
        shutil.copy(model_dir / name, out / name)
    (out / "chat_template.jinja").write_text(AGENT_CHAT_TEMPLATE)
    return GatewayTokenizer(out)


@pytest.fixture(scope="module")
def conversation() -> Conversation:
    conv = agentic_conversations(count=1, seed=3, **SMALL)[0]
    assert len(conv.turns) >= 4 and conv.turns[-1].call is None
    return conv


def call_text(name: str) -> str:
    syntax = CALL_SYNTAX["hermes"]
    return f"{syntax.begin}{name}{syntax.middle}{{}}{syntax.end}"


class FakeEngine:
    """Answers a forced call with the call (``{}`` arguments, as the biased grammar makes it), anything else with
    FINAL_TEXT (a decode worker after P's first token: the rest of it); records every request."""

    def __init__(self, tokenizer: GatewayTokenizer, decode: bool = False):
        self.tok = tokenizer
        self.decode = decode
        self.requests: list[dict] = []

    def _answer(self, constraint) -> list[int]:
        if constraint is None:
            text = FINAL_TEXT
        else:
            [tag] = json.loads(constraint[1])["format"]["tags"]
            text = call_text(tag["begin"].split('"name": "')[1].split('"')[0])
        return self.tok.encode(text) + [self.tok.eos_token_ids[0]]

    async def generate(self, request_id, prompt_ids, *, max_tokens, kv_transfer_params=None, stream=True,
                       constraint=None, **sampling):
        self.requests.append({"id": request_id, "prompt": list(prompt_ids), "max_tokens": max_tokens,
                              "params": kv_transfer_params, "constraint": constraint, "sampling": sampling})
        out = self._answer(constraint)[1 if self.decode and constraint is None else 0:][:max_tokens]
        for token in out:
            yield Chunk([token], len(prompt_ids), 0)
        handle = {"do_remote_decode": True, "remote_block_ids": [list(range(1000))], "remote_host": "127.0.0.1",
                  "remote_port": 1, "remote_engine_id": "d", "remote_num_tokens": len(prompt_ids) + len(out) - 1}
        yield Final(out, "stop", len(prompt_ids), len(out), 0, handle)

    async def prefill(self, request_id, prompt_ids, *, kv_transfer_params, **sampling):
        self.requests.append({"id": request_id, "prompt": list(prompt_ids), "params": kv_transfer_params,
                              "sampling": sampling, "prefill": True})
        pulled = kv_transfer_params.get("remote_num_tokens", 0) if kv_transfer_params.get("do_remote_decode") else 0
        return Final(self._answer(None)[:1], "length", len(prompt_ids), 1, pulled, {"do_remote_prefill": True})


def run_lane(lane, conv: Conversation) -> list:
    async def go():
        return [await lane.turn(turn) for turn in conv.turns]
    return asyncio.run(go())


def check_history(history: lanes._History, conv: Conversation) -> None:
    """Each non-final turn's answer is its forced call; each tool message answers the call just before it."""
    messages = history.messages
    assert messages[0] == {"role": "system", "content": conv.system}
    assistants = [m for m in messages if m["role"] == "assistant"]
    assert len(assistants) == len(conv.turns)
    for answer, turn in zip(assistants, conv.turns, strict=True):
        if turn.call:
            assert answer["content"] is None
            assert [(c["function"]["name"], c["function"]["arguments"]) for c in answer["tool_calls"]] == [
                (turn.call, "{}")]
        else:
            assert answer["content"] == FINAL_TEXT and "tool_calls" not in answer
    last_ids: list[str] = []
    results = []
    for m in messages[1:]:
        if m["role"] == "assistant":
            last_ids = [c["id"] for c in m.get("tool_calls") or []]
        elif m["role"] == "tool":
            assert m["tool_call_id"] in last_ids
            results.append(m["content"])
    assert results == [r for t in conv.turns for r in t.tool_results]


def test_ideal_lane_forces_each_call_like_the_gateway_and_continues_the_exact_ids(tools_tokenizer, conversation):
    engine = FakeEngine(tools_tokenizer)
    bias = lanes.forced_call_bias(tools_tokenizer)
    assert sorted(tools_tokenizer.decode([i]) for i in bias) == ["{", "}"] and set(bias.values()) == {100.0}
    lane = lanes.IdealLane(engine, tools_tokenizer, conversation.id, conversation.system, conversation.tools, bias)
    samples = run_lane(lane, conversation)
    assert len(engine.requests) == len(conversation.turns)
    for req, turn in zip(engine.requests, conversation.turns, strict=True):
        assert req["max_tokens"] == turn.answer_tokens == (CALL_MIN_TOKENS if turn.call else SMALL["max_tokens"])
        if turn.call:
            forced = forced_tool_calls(CALL_SYNTAX["hermes"], conversation.tools, turn.call)
            assert req["constraint"] == (forced.kind, forced.value)
            assert req["sampling"] == {"temperature": 0.0, "logprobs": 0, "logit_bias": bias}
        else:
            assert req["constraint"] is None and req["sampling"] == {"temperature": 0.0, "logprobs": 0}
    # Every prompt continues the previous prompt and answer, token for token.
    for (a, b), sample in zip(zip(engine.requests, engine.requests[1:]), samples[1:], strict=True):
        answer = engine._answer(a["constraint"])
        assert b["prompt"][:len(a["prompt"]) + len(answer)] == a["prompt"] + answer
        assert sample.history_tokens == len(a["prompt"]) + len(answer)
    check_history(lane.history, conversation)
    assert [s.turn for s in samples] == list(range(1, len(conversation.turns) + 1))


def test_direct_lane_lets_d_sample_a_forced_call_from_its_first_token_and_pulls_every_later_turn(
        tools_tokenizer, conversation):
    p, d = FakeEngine(tools_tokenizer), FakeEngine(tools_tokenizer, decode=True)
    bias = lanes.forced_call_bias(tools_tokenizer)
    lane = lanes.DirectLane(p, d, 16, tools_tokenizer, conversation.id, conversation.system, conversation.tools, bias)
    samples = run_lane(lane, conversation)
    assert len(p.requests) == len(d.requests) == len(conversation.turns)
    for k, (pr, dr, turn, sample) in enumerate(zip(p.requests, d.requests, conversation.turns, samples,
                                                   strict=True)):
        assert "constraint" not in pr  # P computes the prompt's KV; a constraint is D's
        if turn.call:
            assert pr["sampling"]["logit_bias"] == bias and dr["sampling"]["logit_bias"] == bias
            assert dr["prompt"] == pr["prompt"] and dr["constraint"] is not None  # P's token is dropped
            assert dr["max_tokens"] == CALL_MIN_TOKENS
        else:
            assert dr["prompt"] == [*pr["prompt"], p._answer(None)[0]] and dr["constraint"] is None
            assert dr["max_tokens"] == SMALL["max_tokens"] - 1
        assert (sample.decision, sample.pulled_tokens > 0) == (("pull", True) if k else ("recompute", False))
    check_history(lane.history, conversation)


def sse(*chunks: dict | str) -> bytes:
    return b"".join(f"data: {c if isinstance(c, str) else json.dumps(c)}\n\n".encode() for c in chunks)


def gateway_stream(body: dict, turn_no: int, *, forced_as_content: bool = False) -> bytes:
    """What the gateway streams back for ``body``: a forced call as a tool call (or, if told, as content), else
    FINAL_TEXT; a chunk carrying only logprobs first (the parser holds the call's text)."""
    base = {"id": f"chatcmpl-{turn_no}", "object": "chat.completion.chunk", "created": 0, "model": "m"}
    choice = body["tool_choice"]
    chunks: list[dict | str] = [{**base, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                                      "finish_reason": None}]},
                                {**base, "choices": [{"index": 0, "delta": {}, "finish_reason": None,
                                                      "logprobs": {"content": [{"token": "<"}]}}]}]
    if isinstance(choice, dict) and not forced_as_content:
        name = choice["function"]["name"]
        chunks += [{**base, "choices": [{"index": 0, "finish_reason": None, "delta": {"tool_calls": [
                       {"index": 0, "id": f"chatcmpl-tool-{turn_no}", "type": "function",
                        "function": {"name": name, "arguments": ""}}]}}]},
                   {**base, "choices": [{"index": 0, "finish_reason": None, "delta": {"tool_calls": [
                       {"index": 0, "function": {"arguments": "{}"}}]}}]}]
        finish = "tool_calls"
    else:
        text = call_text(choice["function"]["name"]) if forced_as_content else FINAL_TEXT
        chunks.append({**base, "choices": [{"index": 0, "delta": {"content": text}, "finish_reason": None}]})
        finish = "stop"
    kv = {"decision": "pull" if turn_no > 1 else "recompute", "pulled_tokens": 100 * (turn_no - 1),
          "computed_tokens": 50, "timings_ms": {"plan_ms": 1.0}}
    chunks += [{**base, "choices": [{"index": 0, "delta": {}, "finish_reason": finish}], "kvshuttle": kv},
               {**base, "choices": [], "usage": {"prompt_tokens": 1000 * turn_no, "completion_tokens": 20,
                                                 "total_tokens": 1000 * turn_no + 20}},
               "[DONE]"]
    return sse(*chunks)


def test_gateway_lane_sends_tools_and_tool_choice_and_echoes_the_gateways_calls(conversation):
    bodies: list[dict] = []

    def handle(request: httpx.Request) -> httpx.Response:
        if request.method == "DELETE":
            return httpx.Response(200, json={})
        body = json.loads(request.content)
        bodies.append(body)
        return httpx.Response(200, content=gateway_stream(body, len(bodies)),
                              headers={"content-type": "text/event-stream"})

    bias = {93: 100.0, 95: 100.0}

    async def go():
        async with httpx.AsyncClient(transport=httpx.MockTransport(handle), base_url="http://gw") as client:
            lane = lanes.GatewayLane(client, "pull", conversation.id, conversation.system, "run",
                                     tools=conversation.tools, call_bias=bias)
            samples = [await lane.turn(turn) for turn in conversation.turns]
            await lane.close()
            return lane, samples

    lane, samples = asyncio.run(go())
    assert len(bodies) == len(conversation.turns)
    for k, (body, turn) in enumerate(zip(bodies, conversation.turns, strict=True)):
        assert body["tools"] == conversation.tools and body["stream"] and body["logprobs"] is True
        assert body["max_tokens"] == turn.answer_tokens and body["temperature"] == 0 and not body["disable_pull"]
        if turn.call:
            assert body["tool_choice"] == {"type": "function", "function": {"name": turn.call}}
            assert body["logit_bias"] == {"93": 100.0, "95": 100.0}
        else:
            assert body["tool_choice"] == "auto" and "logit_bias" not in body
        if k:  # the previous answer echoed back whole (the gateway's call id), then the tool result answering it
            echoed = [m for m in body["messages"] if m["role"] == "assistant"][-1]
            assert echoed == {"role": "assistant", "content": None, "tool_calls": [
                {"id": f"chatcmpl-tool-{k}", "type": "function",
                 "function": {"name": conversation.turns[k - 1].call, "arguments": "{}"}}]}
            tool_msgs = [m for m in body["messages"][body["messages"].index(echoed):] if m["role"] == "tool"]
            assert tool_msgs == [{"role": "tool", "tool_call_id": f"chatcmpl-tool-{k}", "content": r}
                                 for r in turn.tool_results]
    check_history(lane.history, conversation)
    for k, sample in enumerate(samples):
        assert sample.prompt_tokens == 1000 * (k + 1) and sample.history_tokens == (1000 * k + 20 if k else 0)
        assert 0 < sample.ttft_ms <= sample.latency_ms
    # The gateway's answers and an engine lane's answers to the same turns have the same digests (ids aside).
    direct = lanes.message_digest(lanes.answer_message(call_text(conversation.turns[0].call), conversation.tools, 1))
    assert samples[0].output_digest == direct
    assert samples[-1].output_digest == lanes.message_digest({"role": "assistant", "content": FINAL_TEXT})


def test_a_forced_call_that_comes_back_as_content_fails_the_turn(conversation):
    def handle(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        return httpx.Response(200, content=gateway_stream(body, 1, forced_as_content=True),
                              headers={"content-type": "text/event-stream"})

    async def go():
        async with httpx.AsyncClient(transport=httpx.MockTransport(handle), base_url="http://gw") as client:
            lane = lanes.GatewayLane(client, "pull", conversation.id, conversation.system, "run",
                                     tools=conversation.tools)
            await lane.turn(conversation.turns[0])

    with pytest.raises(lanes.LaneError, match=f"turn 1: the forced call of {conversation.turns[0].call} came back as "
                                              f"no tool call \\(finish_reason stop"):
        asyncio.run(go())


def test_tool_results_need_a_call_to_answer(conversation):
    history = lanes._History(None, conversation.tools)
    with pytest.raises(lanes.LaneError, match="turn 1 carries tool results, but the answer before it called no tool"):
        history.add_inputs(Turn(["result"], None, None, 8))


def test_the_gateway_renders_and_constrains_what_the_engine_lanes_do(tools_tokenizer, conversation):
    """The gateway lane's requests, read by the gateway's own request model, render to the prompt the direct and
    ideal lanes render, and force the same constraint: all modes see the same token ids."""
    from kvshuttle.services.gateway.apis.openai.models import ChatCompletionIn

    bias = lanes.forced_call_bias(tools_tokenizer)
    gw = lanes.GatewayLane(None, "pull", conversation.id, conversation.system, "r", tools=conversation.tools,
                           call_bias=bias)
    engine_lane = lanes._ExactIdsLane(tools_tokenizer, conversation.id, conversation.system, conversation.tools, bias)
    for k, turn in enumerate(conversation.turns):
        gw.history.add_inputs(turn)
        engine_lane.history.add_inputs(turn)
        parsed = ChatCompletionIn.model_validate(json.loads(json.dumps(gw.request(turn))))
        messages = [m.plain(f"messages.{i}") for i, m in enumerate(parsed.messages)]
        gateway_text = tools_tokenizer.render_chat(messages, True, **parsed.template_vars())
        ids, text, continues = asyncio.run(engine_lane._prompt())
        assert text == gateway_text and continues == (k > 0)
        if turn.call:
            forced = forced_tool_calls(CALL_SYNTAX["hermes"], [t.template_dict() for t in parsed.tools],
                                       parsed.tool_choice.function.name)
            assert engine_lane._constraint(turn) == (forced.kind, forced.value)
            assert {int(i): b for i, b in parsed.logit_bias.items()} == engine_lane._sampling(turn)["logit_bias"]
        else:
            assert parsed.tool_choice == "auto" and engine_lane._constraint(turn) is None
        answer = tools_tokenizer.encode(call_text(turn.call) if turn.call else FINAL_TEXT)
        answer.append(tools_tokenizer.eos_token_ids[0])
        message = lanes.answer_message(tools_tokenizer.decode(answer[:-1], False), conversation.tools, k + 1)
        gw.history.add_answer({**message, "tool_calls": [{**c, "id": f"chatcmpl-tool-{k}"}
                                                         for c in message.get("tool_calls", [])]}
                              if turn.call else message, turn, "stop", 0, 0)
        engine_lane._finish("direct", turn, ids, text, answer, "stop", 0.0, 0.0, 0.0, 0, 0, "x")


def test_answer_message_reads_hermes_calls_as_the_gateway_does(conversation):
    tools = conversation.tools
    assert lanes.answer_message(call_text("grep"), tools, 4) == {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_4_0", "type": "function", "function": {"name": "grep", "arguments": "{}"}}]}
    two = '<tool_call>\n{"name": "grep", "arguments": {"pattern": "é"}}\n</tool_call>\n' + call_text("read_file")
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in
            lanes.answer_message(two, tools, 1)["tool_calls"]] == [("grep", '{"pattern": "é"}'), ("read_file", "{}")]
    broken = "<tool_call>\n{oops}\n</tool_call>"
    for text in ("plain words", call_text("grep") + " and more", call_text("nope"), broken):
        assert lanes.answer_message(text, tools, 1) == {"role": "assistant", "content": text}
    assert lanes.answer_message(call_text("grep"), None, 1) == {"role": "assistant", "content": call_text("grep")}


def test_check_template_needs_tools_calls_and_results(model_dir, tools_tokenizer, conversation):
    lanes.check_template(tools_tokenizer, conversation.tools)
    # The tiny model's plain template renders every message's content only (so the tool results, not the rest).
    with pytest.raises(ValueError, match=r"tiny does not render the tools, a tool call as '<tool_call>\\n\{\"name\": "
                                         r"\"read_file\", \"arguments\": \{\}\}\\n</tool_call>': the bench's"):
        lanes.check_template(GatewayTokenizer(model_dir), conversation.tools)


def test_each_forced_call_is_warmed_up_once_on_d_and_on_the_ideal_worker(tools_tokenizer):
    """vLLM sets up its grammar backend on a worker's first constrained request: the bench forces each distinct call
    once, through the gateway (D) and on the ideal worker, before it measures."""
    convs = agentic_conversations(count=3, seed=1, **SMALL)
    calls = lanes.forced_calls(convs)
    names = {t.call for c in convs for t in c.turns if t.call}
    assert sorted(name for _, name in calls) == sorted(names)  # the tools' parameters are the same in every session
    requests: list[httpx.Request] = []

    def handle(request: httpx.Request) -> httpx.Response:
        requests.append(request)
        if request.url.path.endswith("/end"):
            return httpx.Response(200, json={})
        return httpx.Response(200, content=gateway_stream(json.loads(request.content), 1),
                              headers={"content-type": "text/event-stream"})

    engine = FakeEngine(tools_tokenizer)
    bias = lanes.forced_call_bias(tools_tokenizer)

    async def go():
        async with httpx.AsyncClient(transport=httpx.MockTransport(handle), base_url="http://gw") as client:
            await lanes.warm_up_forced_calls(calls, bias, client=client, engine=engine, tokenizer=tools_tokenizer)

    asyncio.run(go())
    chats = [json.loads(r.content) for r in requests if r.url.path == "/v1/chat/completions"]
    ends = [r.url.path for r in requests if r.url.path.endswith("/end")]
    assert [b["tool_choice"]["function"]["name"] for b in chats] == [name for _, name in calls]
    assert all(b["max_tokens"] == CALL_MIN_TOKENS and b["logit_bias"] == {str(k): v for k, v in bias.items()}
               and b["stream"] for b in chats)
    assert len(ends) == len(calls) and all(p.startswith("/v1/sessions/bench-warm-up-") for p in ends)
    assert [r["constraint"] for r in engine.requests] == [
        (c.kind, c.value) for c in (forced_tool_calls(CALL_SYNTAX["hermes"], tools, name) for tools, name in calls)]
    assert all(r["sampling"]["logit_bias"] == bias for r in engine.requests)


def test_on_a_template_without_tools_the_bench_replays_plain_chats(smollm2_model_dir, tools_tokenizer, conversation):
    """`kvshuttle bench --model-variant smollm2`: SmolLM2's chat template renders no tools, so with --tools auto the
    conversations are replayed as plain chats (the tool results in the user's messages, no forced calls); a template
    with tools keeps them, and --tools on/off decide either way."""
    from kvshuttle.services.devtools.bench.multiturn import plain_if_needed

    smollm2 = GatewayTokenizer(smollm2_model_dir)
    with pytest.raises(ValueError, match="does not render"):
        lanes.check_template(smollm2, conversation.tools)
    (plain,) = plain_if_needed([conversation], smollm2, "auto")
    assert plain.tools is None and not any(t.call or t.tool_results for t in plain.turns)
    assert len(plain.turns) == len(conversation.turns) and conversation.tools[0]["function"]["name"] in plain.system
    assert plain_if_needed([conversation], smollm2, "on") == [conversation]
    assert plain_if_needed([conversation], tools_tokenizer, "auto") == [conversation]
    assert plain_if_needed([conversation], tools_tokenizer, "off")[0].tools is None
