"""Log-probabilities and token ids (vLLM's return_token_ids) in OpenAI's shapes on both routes (whole and streamed, read by the official openai client), and
what the runner asks the engine for. The turn is a stand-in whose tokens are the answer's characters."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from kvshuttle.services.engine.client import TokenLogprob
from kvshuttle.services.gateway.apis.http_app import create_app
from kvshuttle.services.gateway.apis.openai.logprob_format import chat_content, completion_logprobs

from tests.support.auth import open_guard
from tests.support.turn_fakes import AnsweringRunner

ASK = [{"role": "user", "content": "hi"}]


def sdk(runner) -> openai.AsyncOpenAI:
    app = create_app(runner, "tiny", 16)
    http = httpx.AsyncClient(transport=httpx.ASGITransport(app=open_guard(app)), base_url="http://gw")
    return openai.AsyncOpenAI(api_key="none", base_url="http://gw/v1", http_client=http)


@pytest.mark.parametrize("pieces", [1, 2, 100])
async def test_chat_logprobs_whole_and_streamed(pieces):
    runner = AnsweringRunner("Hé!", pieces)
    async with sdk(runner) as api:
        whole = await api.chat.completions.create(model="tiny", messages=ASK, logprobs=True, top_logprobs=2)
        stream = await api.chat.completions.create(model="tiny", messages=ASK, logprobs=True, top_logprobs=2,
                                                   stream=True)
        streamed = [entry async for chunk in stream for choice in chunk.choices
                    for entry in (choice.logprobs.content if choice.logprobs else [])]
        plain = await api.chat.completions.create(model="tiny", messages=ASK)
    content = whole.choices[0].logprobs.content
    assert [(e.token, e.logprob, e.bytes) for e in content] == [("H", 0.0, [72]), ("é", -0.25, [195, 169]),
                                                                ("!", -0.5, [33])]
    assert [(t.token, t.logprob) for t in content[1].top_logprobs] == [("é", -0.25), ("?", -1.25)]
    assert [e.model_dump() for e in streamed] == [e.model_dump() for e in content]
    assert runner.requests[0].logprobs == 2 and plain.choices[0].logprobs is None
    assert runner.requests[2].logprobs is None


async def test_logprobs_without_top_and_the_refusals():
    runner = AnsweringRunner("ok")
    async with sdk(runner) as api:
        only = await api.chat.completions.create(model="tiny", messages=ASK, logprobs=True)
        assert only.choices[0].logprobs.content[0].top_logprobs == [] and runner.requests[0].logprobs == 0
        with pytest.raises(openai.BadRequestError) as err:
            await api.chat.completions.create(model="tiny", messages=ASK, top_logprobs=3)
        assert err.value.body["param"] == "top_logprobs" and "needs logprobs" in err.value.message
        with pytest.raises(openai.BadRequestError) as err:
            await api.chat.completions.create(model="tiny", messages=ASK, logprobs=True, top_logprobs=21)
        assert err.value.body["param"] == "top_logprobs"


@pytest.mark.parametrize("stream", [False, True])
async def test_completion_logprobs(stream):
    runner = AnsweringRunner("abc", 2)
    async with sdk(runner) as api:
        if stream:
            parts = [c.choices[0].logprobs async for c in await api.completions.create(
                model="tiny", prompt="x", logprobs=1, stream=True) if c.choices and c.choices[0].logprobs]
            tokens = [t for p in parts for t in p.tokens]
            offsets = [o for p in parts for o in p.text_offset]
            tops = [t for p in parts for t in p.top_logprobs]
        else:
            got = (await api.completions.create(model="tiny", prompt="x", logprobs=1)).choices[0].logprobs
            tokens, offsets, tops = got.tokens, got.text_offset, got.top_logprobs
    assert tokens == ["a", "b", "c"] and offsets == [0, 1, 2] and tops[2] == {"c": -0.5}
    assert runner.requests[0].logprobs == 1


def test_hidden_tokens_are_left_out():
    spell = {1: "a", 2: "<eos>"}.get
    lps = [TokenLogprob(1, -0.1), TokenLogprob(2, -0.2)]
    assert [e["token"] for e in chat_content(lps, spell, hidden={2})] == ["a"]
    assert completion_logprobs(lps, spell, hidden={2}, offset=5)["text_offset"] == [5]


@pytest.mark.parametrize("stream", [False, True])
async def test_return_token_ids(stream):
    runner = AnsweringRunner("abc", 2)
    app = create_app(runner, "tiny", 16)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=open_guard(app)), base_url="http://gw") as http:
        body = {"messages": ASK, "return_token_ids": True, "stream": stream}
        resp = await http.post("/v1/chat/completions", json=body)
        if not stream:
            got = resp.json()
            assert got["prompt_token_ids"] == [5, 6, 7] and got["choices"][0]["token_ids"] == [97, 98, 99]
            return
        chunks = [json.loads(line[6:]) for line in resp.text.splitlines()
                  if line.startswith("data: {")]
    assert chunks[0]["prompt_token_ids"] == [5, 6, 7]
    assert [i for c in chunks for ch in c["choices"] for i in ch.get("token_ids", [])] == [97, 98, 99]
