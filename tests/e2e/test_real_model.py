"""A real model end to end: SmolLM2-135M-Instruct (``make-model --variant smollm2``, workers/gguf_model.py) on a stack
of its own: etcd, registry, scheduler, gateway and a vLLM prefill + decode pair with the NIXL connector. The other
e2e tests run random test models, whose answers are tokens, not language; here every answer is a sentence with a known
answer word, later turns still pull their history from D, and every answer is the recompute twin's, token for token
(fp32, greedy). Kept short: ~370 tokens of notes, then two follow-up questions, at most 16 tokens an answer."""

from __future__ import annotations

import subprocess

import httpx
import pytest
from kvshuttle.services.common.config import from_namespace
from kvshuttle.services.devtools.demo import GEOGRAPHY_SYSTEM, country_notes
from kvshuttle.services.devtools.stack import Stack, StackConfig

from tests.support.e2e import flush_prefill, new_session, prompt_token_sources, tokens

pytestmark = pytest.mark.e2e
# The demo's notes on Europe with the first question (three KV blocks of 128 tokens), then follow-ups that lean on
# the history ("And the capital of Germany?"); each with the word its answer must hold.
TURNS = (("What is the capital of France?", "Paris"), ("And the capital of Germany?", "Berlin"),
         ("What currency does Spain use?", "euro"))


@pytest.fixture(scope="module")
async def smollm2_stack(smollm2_model_dir, tmp_path_factory):
    work = tmp_path_factory.mktemp("smollm2-stack")
    cfg = from_namespace(StackConfig, environ={
        "KVSHUTTLE_STACK_WORK_DIR": str(work), "KVSHUTTLE_MODEL_DIR": str(smollm2_model_dir),
        "KVSHUTTLE_STACK_MODEL_VARIANT": "smollm2", "KVSHUTTLE_STACK_HTTP_PORT": "0",
        "KVSHUTTLE_STACK_GRPC_PORT": "0", "KVSHUTTLE_STACK_MAX_MODEL_LEN": "2048",
    })
    # Idle sessions keep their KV: freeing it reads a block on P, which P's counters compared here would count.
    stack = Stack(cfg, scheduler_env={"KVSHUTTLE_SCHEDULER_POLICY": "threshold",
                                      "KVSHUTTLE_SCHEDULER_KV_IDLE_LIMIT_S": "0"})
    try:
        await stack.start()
        yield stack
    finally:
        await stack.stop()
    leftover = subprocess.run(["pgrep", "-af", str(work)], capture_output=True, text=True).stdout.strip()
    assert not leftover, f"processes left running after the stack stopped:\n{leftover}"


async def converse(stack, session: str, disable_pull: bool) -> list[tuple[httpx.Response, dict, dict]]:
    """The conversation through the gateway, P's prefix cache flushed before every turn (so whatever P does not
    compute came over NIXL): each turn's response, its body and the change of P's prompt-token counters."""
    messages = [{"role": "system", "content": GEOGRAPHY_SYSTEM}]
    out = []
    async with httpx.AsyncClient(base_url=stack.base_url, timeout=300) as client:
        for n, (question, _) in enumerate(TURNS):
            content = f"My notes on Europe:\n{country_notes('Europe')}\n\n{question}" if n == 0 else question
            messages.append({"role": "user", "content": content})
            await flush_prefill(stack)
            before = prompt_token_sources(stack)
            resp = await client.post("/v1/chat/completions", headers={"X-Session-ID": session}, json={
                "messages": messages, "max_tokens": 16, "temperature": 0, "logprobs": True,
                "disable_pull": disable_pull})
            assert resp.status_code == 200, resp.text
            after = prompt_token_sources(stack)
            body = resp.json()
            out.append((resp, body, {k: after.get(k, 0) - before.get(k, 0) for k in set(after) | set(before)}))
            messages.append({"role": "assistant", "content": body["choices"][0]["message"]["content"]})
    return out


def answer_tokens(body: dict) -> list[tuple[str, tuple[int, ...]]]:
    return [(entry["token"], tuple(entry["bytes"] or ())) for entry in body["choices"][0]["logprobs"]["content"]]


async def test_a_real_model_answers_and_its_later_turns_pull_and_answer_like_a_recompute(smollm2_stack):
    pulled = await converse(smollm2_stack, new_session("smollm2"), disable_pull=False)
    recomputed = await converse(smollm2_stack, new_session("smollm2-recompute"), disable_pull=True)

    for (_, word), (_, body, _), (_, twin, _) in zip(TURNS, pulled, recomputed, strict=True):
        choice = body["choices"][0]
        # Language, not tokens: a sentence that names the answer and ends where the model ends it (EOS).
        assert word in choice["message"]["content"], choice["message"]["content"]
        assert choice["finish_reason"] == "stop" and body["usage"]["completion_tokens"] < 16, body
        # The same answer as the recompute twin's, token for token (their logprobs equal up to fp32 rounding).
        assert len(answer_tokens(body)) == body["usage"]["completion_tokens"] - 1  # all but the EOS
        assert answer_tokens(body) == answer_tokens(twin)
        assert choice["message"] == twin["choices"][0]["message"]
        assert tokens(body["usage"]) == tokens(twin["usage"])
        for mine, theirs in zip(choice["logprobs"]["content"], twin["choices"][0]["logprobs"]["content"], strict=True):
            assert abs(mine["logprob"] - theirs["logprob"]) < 1e-3, (mine, theirs)

    assert pulled[0][0].headers["X-KV-Decision"] == "recompute"
    for resp, body, delta in pulled[1:]:
        kv, prompt_tokens = body["kvshuttle"], body["usage"]["prompt_tokens"]
        assert resp.headers["X-KV-Decision"] == "pull", kv["reason"]
        assert kv["pulled_tokens"] > 256 and kv["pulled_tokens"] == kv["covered_tokens"], kv
        # P's own counters: the history came over NIXL, P computed only the new question.
        assert delta.get("external_kv_transfer") == kv["pulled_tokens"], delta
        assert delta.get("local_compute") == prompt_tokens - kv["pulled_tokens"] == kv["computed_tokens"], delta
        assert kv["computed_tokens"] < 64, kv
    for resp, body, delta in recomputed:
        assert resp.headers["X-KV-Decision"] == "recompute" and body["kvshuttle"]["pulled_tokens"] == 0
        assert delta.get("external_kv_transfer", 0) == 0 and delta["local_compute"] == body["usage"]["prompt_tokens"]
