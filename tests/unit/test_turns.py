"""TurnRunner's own logic with stand-ins for the scheduler, registry and engines: prompt continuation, the retry
of a failed pull as a recompute, what gets recorded. (The real path is covered end to end in tests/e2e.)"""

from __future__ import annotations

import asyncio
import dataclasses
import json

import grpc
import pytest
from kvshuttle.control_plane import cache_salt, kv_params
from kvshuttle.control_plane.continuation import text_key
from kvshuttle.control_plane.prefix import matched_prefix_tokens, prefix_digest
from kvshuttle.control_plane.session import DEFAULT_TENANT
from kvshuttle.services.engine.client import EngineError, Final
from kvshuttle.services.gateway.turns import Delta, Finished, TurnContext, TurnError, TurnRequest, TurnRunner
from kvshuttle.services.gateway.turns import record as record_stage
from kvshuttle.services.gateway.turns.context import KnownSession
from kvshuttle.v1 import common_pb2, registry_pb2, scheduler_pb2

from tests.support.turn_fakes import (
    BLOCK,
    PULL_PARAMS,
    DownRegistry,
    Engine,
    Registry,
    Scheduler,
    Tokenizer,
    recorded,
    resume_runner,
    run,
    runner,
)
from tests.support.waits import until


async def test_failed_pull_is_retried_once_as_a_recompute():
    p = Engine(fail_prefills=1)
    r, _, _ = runner(scheduler_pb2.DECISION_PULL, p)
    turn, events = await run(r, TurnRequest(session_id="s", prompt_text="hello", max_tokens=2))
    assert p.prefills[0] == PULL_PARAMS and p.prefills[1] == kv_params.prefill_request_params()
    assert turn.kv.decision == "recompute" and turn.kv.retried_as_recompute and turn.kv.pulled_tokens == 0
    assert "retried as recompute" in turn.kv.reason
    assert isinstance(events[-1], Finished) and "".join(e.text for e in events if isinstance(e, Delta)) == "ok"


async def test_a_failed_prefill_worker_with_none_left_is_a_503_with_retry_after():
    p = Engine(fail_prefills=1)
    r, scheduler, _ = runner(scheduler_pb2.DECISION_RECOMPUTE, p)
    with pytest.raises(TurnError) as err:
        await r.prepare(TurnRequest(session_id="s", prompt_text="hello", max_tokens=2))
    assert err.value.http_status == 503 and err.value.retry_after_s and len(p.prefills) == 1
    assert "prefill worker p failed" in err.value.message and "no worker left" in err.value.message
    assert list(scheduler.requests[-1].exclude_worker_ids) == ["p"]


async def test_a_failed_prefill_worker_is_replaced_and_the_turn_recomputes_there():
    p1, p2 = Engine(fail_prefills=1, fail_code=grpc.StatusCode.UNAVAILABLE), Engine()
    scheduler, registry = Scheduler(scheduler_pb2.DECISION_RECOMPUTE, prefills=("p", "p2")), Registry()
    r = TurnRunner(Tokenizer(), registry, scheduler, max_model_len=1000, first_token_from_prefill=False)
    r._engines = {"p:1": p1, "p2:1": p2, "d:1": Engine()}
    turn, events = await run(r, TurnRequest(session_id="s", prompt_text="hello", max_tokens=2))
    assert len(p1.prefills) == 1 and len(p2.prefills) == 1
    assert turn.kv.prefill_worker_id == "p2" and turn.kv.decision == "recompute"
    assert turn.kv.worker_failures == ["prefill worker p failed (UNAVAILABLE: engine said no); recomputed on p2"]
    retry = scheduler.requests[-1]
    assert list(retry.exclude_worker_ids) == ["p"] and retry.disable_pull
    assert "".join(e.text for e in events if isinstance(e, Delta)) == "ok"


@pytest.mark.parametrize("how", ["dies", "hangs"])
async def test_a_decode_worker_that_fails_mid_answer_is_resumed_on_another(how):
    # d streams "ab" and then dies (or stops answering); d2 is given the prompt plus "ab" and writes the rest.
    first = Engine(answer="abcdef", **({"die_after": 2} if how == "dies" else {"hang_after": 2}))
    second = Engine(answer="cdef")
    r, scheduler, registry = resume_runner(first, second, stall_s=0.2)
    prompt = [ord(c) for c in "hello"]
    turn, events = await run(r, TurnRequest(session_id="s", prompt_text="hello", max_tokens=6))
    assert "".join(e.text for e in events if isinstance(e, Delta)) == "abcdef"
    resumed_prompt, kw = second.calls[0]
    assert resumed_prompt == [*prompt, ord("a"), ord("b")] and kw["max_tokens"] == 4
    assert list(scheduler.requests[-1].exclude_worker_ids) == ["d"] and scheduler.requests[-1].disable_pull
    assert scheduler.prompts[-1] == resumed_prompt  # P prefilled the prompt plus what was already answered
    assert turn.kv.decode_worker_id == "d2" and len(turn.kv.worker_failures) == 1
    assert turn.kv.worker_failures[0].startswith("decode worker d failed after 2 tokens")
    record = registry.recorded[-1]
    assert record.decode_worker_id == "d2" and list(record.token_ids) == [*prompt, *map(ord, "abcdef")]
    assert isinstance(events[-1], Finished) and events[-1].output_ids == list(map(ord, "abcdef"))


async def test_a_decode_worker_failure_with_none_left_ends_the_stream_with_a_503():
    r, _, registry = resume_runner(Engine(answer="abcdef", die_after=2), None)
    turn = await r.prepare(TurnRequest(session_id="s", prompt_text="hello", max_tokens=6))
    got = []
    with pytest.raises(TurnError) as err:
        async for event in r.decode(turn):
            got.append(event)
    assert "".join(e.text for e in got if isinstance(e, Delta)) == "ab"
    assert err.value.http_status == 503 and err.value.retry_after_s
    assert "decode worker d failed after 2 tokens" in err.value.message and not registry.recorded


async def test_after_a_resume_p_s_first_token_is_kept_once():
    # P gives "a" (the first token), d dies before its first token, d2 continues after "a".
    r, _, _ = resume_runner(Engine(answer="bcd", die_after=0), Engine(answer="bcd"), first_token=True)
    turn, events = await run(r, TurnRequest(session_id="s", prompt_text="hello", max_tokens=4))
    assert events[-1].output_ids == list(map(ord, "abcd"))
    assert "".join(e.text for e in events if isinstance(e, Delta)) == "abcd"


MORE = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok"}, {"role": "user", "content": "more"}]
SUFFIX = [ord(c) for c in "<user>more<assistant>"]


async def test_next_prompt_continues_the_recorded_ids_and_the_exact_ids_are_recorded():
    # The recorded ids differ from what re-tokenizing the text would give: the prompt must reuse them.
    registry = Registry(recorded("<user>hi<assistant>ok", [900, 901, 902]))
    r, scheduler, _ = runner(scheduler_pb2.DECISION_RECOMPUTE, Engine(), registry)
    turn, events = await run(r, TurnRequest(session_id="s", messages=MORE, max_tokens=2))
    assert scheduler.prompts == [[900, 901, 902, *SUFFIX]]
    record = registry.recorded[-1]
    # This decode worker's handle covers nothing the gateway can digest: the whole history goes, and the registry
    # digests it.
    assert record.base_tokens == 0 and not record.prefix_digest
    assert list(record.token_ids) == registry.histories[-1] == [900, 901, 902, *SUFFIX, ord("o"), ord("k")]
    text = "<user>hi<assistant>ok<user>more<assistant>ok"
    assert not record.text and (record.text_chars, record.text_key) == (len(text), text_key(text))
    assert json.loads(record.kv_transfer_params_json) == {"do_remote_decode": True, "handle": 1}


async def test_a_continued_turn_sends_only_the_new_ids_and_the_digests_of_the_whole_history():
    previous = recorded("<user>hi<assistant>ok", [900, 901, 902], turn=4, covered_tokens=2,
                        checkpoints=[common_pb2.PrefixCheckpoint(tokens=1, digest=prefix_digest([900], 1))])
    registry = Registry(previous)
    r, scheduler, _ = runner(scheduler_pb2.DECISION_RECOMPUTE, Engine(), registry, decode=HandingDecode())
    turn, _ = await run(r, TurnRequest(session_id="s", messages=MORE, max_tokens=2))
    whole = [900, 901, 902, *SUFFIX, ord("o"), ord("k")]
    covered = len(whole) - 1  # D's handle: all but its last token
    (record,) = registry.recorded
    assert (record.base_tokens, record.base_turn) == (3, 4)
    assert list(record.token_ids) == whole[3:]  # the registry's history store has the first 3
    assert record.prefix_digest == prefix_digest(whole, covered)
    # checkpoints: the previous ones and the previous covered/history lengths, and where this turn's prompt ended
    lengths = [1, 2, 3, 3 + len(SUFFIX)]
    assert [(cp.tokens, cp.digest) for cp in record.checkpoints] == [(n, prefix_digest(whole, n)) for n in lengths]
    assert matched_prefix_tokens(covered, BLOCK, [*whole, 5], record.prefix_digest,
                                 [(cp.tokens, cp.digest) for cp in record.checkpoints]) == covered
    assert registry.histories == [whole] and registry.session.turn == 5
    # the gateway's own copy keeps the whole history: its next turn continues it without a read
    assert list(r.own_record("default", "s").token_ids) == whole


async def test_a_continued_turn_whose_record_changed_meanwhile_sends_the_whole_history():
    registry = Registry(recorded("<user>hi<assistant>ok", [900, 901, 902]))

    class Moving(HandingDecode):
        async def generate(self, request_id, prompt_ids, **kw):
            registry.session.turn += 1  # another gateway recorded a turn of this session meanwhile
            async for item in super().generate(request_id, prompt_ids, **kw):
                yield item

    r, _, _ = runner(scheduler_pb2.DECISION_RECOMPUTE, Engine(), registry, decode=Moving())
    await run(r, TurnRequest(session_id="s", messages=MORE, max_tokens=2))
    whole = [900, 901, 902, *SUFFIX, ord("o"), ord("k")]
    first, second = registry.recorded
    assert first.base_tokens == 3 and list(first.token_ids) == whole[3:]  # refused: history changed
    assert second.base_tokens == second.base_turn == 0 and list(second.token_ids) == whole
    assert second.prefix_digest == first.prefix_digest == prefix_digest(whole, len(whole) - 1)
    assert registry.histories == [whole]


async def test_a_history_the_store_lost_is_tokenized_again_and_recorded_whole():
    registry = Registry(recorded("<user>hi<assistant>ok", [900, 901, 902]))
    registry.history_missing = "the history store no longer holds the session's ids"
    r, scheduler, _ = runner(scheduler_pb2.DECISION_RECOMPUTE, Engine(), registry, decode=HandingDecode())
    await run(r, TurnRequest(session_id="s", messages=MORE, max_tokens=2))
    text = "<user>hi<assistant>ok<user>more<assistant>"
    assert scheduler.prompts == [[ord(c) for c in text]]
    assert r.degraded["history_missing"] == 1
    (record,) = registry.recorded
    assert record.base_tokens == 0 and list(record.token_ids) == [*map(ord, text), ord("o"), ord("k")]


async def test_edited_history_is_tokenized_from_scratch():
    registry = Registry(recorded("<user>hi<assistant>ok", [900, 901, 902]))
    r, scheduler, _ = runner(scheduler_pb2.DECISION_RECOMPUTE, Engine(), registry, decode=HandingDecode())
    messages = [{"role": "user", "content": "HI"}, {"role": "assistant", "content": "ok"}]
    await run(r, TurnRequest(session_id="s", messages=messages, max_tokens=2))
    assert scheduler.prompts[0][:3] == [ord(c) for c in "<us"]
    (record,) = registry.recorded
    assert record.base_tokens == 0 and list(record.token_ids) == registry.histories[-1]  # nothing continued
    assert list(record.token_ids[:3]) == [ord(c) for c in "<us"]


@pytest.mark.parametrize("req,words", [
    (TurnRequest(prompt_text="x", max_tokens=0), "max_tokens"),
    (TurnRequest(prompt_text="x" * 999, max_tokens=5), "context"),
    (TurnRequest(prompt_text="x", temperature=3.0), "temperature"),
    (TurnRequest(prompt_ids=[-1]), "token id -1 is negative"),
    (TurnRequest(prompt_text="x", stop=[""]), "stop strings must be 1 to 512 characters long"),
    (TurnRequest(prompt_text="x", stop=["a"] * 33), "at most 32 stop strings"),
    (TurnRequest(prompt_ids=[5, 70_000]), "token id 70000 is outside the model's vocabulary (ids 0 to 65535)"),
    (TurnRequest(messages=[]), "messages"),
    (TurnRequest(prompt_text="x", top_k=-2), "top_k must be 0 or -1"),
    (TurnRequest(prompt_text="x", min_p=1.5), "min_p must be in [0, 1]"),
    (TurnRequest(prompt_text="x", presence_penalty=2.5), "presence_penalty must be in [-2, 2]"),
    (TurnRequest(prompt_text="x", frequency_penalty=-2.5), "frequency_penalty must be in [-2, 2]"),
    (TurnRequest(prompt_text="x", frequency_penalty=float("nan")), "frequency_penalty"),
    (TurnRequest(prompt_text="x", repetition_penalty=0.0), "repetition_penalty must be"),
    (TurnRequest(prompt_text="x", repetition_penalty=float("inf")), "repetition_penalty must be"),
    (TurnRequest(prompt_text="x", max_tokens=4, min_tokens=5), "min_tokens must be between 0 and max_tokens (4)"),
    (TurnRequest(prompt_text="x", min_tokens=-1), "min_tokens"),
    (TurnRequest(prompt_text="x", stop_token_ids=[65536]), "stop_token_ids: token id 65536 is outside"),
    (TurnRequest(prompt_text="x", stop_token_ids=[-1]), "stop_token_ids: token id -1"),
    (TurnRequest(prompt_text="x", stop_token_ids=list(range(1025))), "at most 1024 stop_token_ids"),
    (TurnRequest(prompt_text="x", logit_bias={70000: 1.0}), "logit_bias: token id 70000 is outside"),
    (TurnRequest(prompt_text="x", logit_bias={5: 101.0}), "logit_bias: the bias of token id 5 must be in [-100, 100]"),
])
async def test_bad_requests_are_400(req, words):
    r, _, _ = runner(scheduler_pb2.DECISION_RECOMPUTE, Engine())
    with pytest.raises(TurnError) as err:
        await r.prepare(req)
    assert err.value.http_status == 400 and words in err.value.message


async def test_no_session_records_nothing():
    r, _, registry = runner(scheduler_pb2.DECISION_RECOMPUTE, Engine())
    await run(r, TurnRequest(prompt_text="hello", max_tokens=2))
    assert registry.recorded == []


class HandingDecode(Engine):
    """A decode worker whose last message carries a real handle (bi-directional KV transfer) for what it holds."""

    async def generate(self, request_id, prompt_ids, **kw):
        async for item in super().generate(request_id, prompt_ids, **kw):
            if isinstance(item, Final):
                covered = len(prompt_ids) + len(item.output_ids) - 1
                item = dataclasses.replace(item, kv_transfer_params={
                    "do_remote_decode": True, "remote_engine_id": "d", "remote_host": "h", "remote_port": 1,
                    "remote_num_tokens": covered, "remote_block_ids": [list(range(-(-covered // BLOCK)))]})
            yield item


@pytest.mark.parametrize("prompt, free", [("hello world", True), ("h", True), ("hello world", False)])
async def test_a_turn_nothing_records_has_its_kv_freed_on_the_decode_worker(prompt, free):
    """No session id: no record will ever point at D's handle, so D would hold the blocks until its TTL, unseen."""
    p = Engine()
    r, _, registry = runner(scheduler_pb2.DECISION_RECOMPUTE, p, decode=HandingDecode(answer="okay"))
    r.free_unrecorded_kv = free
    turn, _ = await run(r, TurnRequest(prompt_text=prompt, max_tokens=3))
    await asyncio.gather(*r._reports)
    reads = [(ids, kw) for ids, kw in p.calls if kw.get("kv_transfer_params")]
    assert registry.recorded == []
    if not free:
        assert reads == [] and r.released_handles == 0
        return
    [(ids, kw)] = reads  # one read of the handle's first block (all of it when it covers less), then cancelled
    held = [*turn.prompt_ids, *(ord(c) for c in "oka")]
    n = min(len(held) - 1, BLOCK)
    assert n == (BLOCK if len(prompt) > 1 else 3)  # "h": the handle covers 3 tokens, less than a block
    assert kw["kv_transfer_params"]["remote_num_tokens"] == n and kw["kv_transfer_params"]["remote_block_ids"] == [[0]]
    assert ids == held[:n + 1] and kw["stream"] and r.released_handles == 1


CHAT = [{"role": "user", "content": "hi"}]


async def test_the_next_turn_plans_with_the_record_this_gateway_wrote_without_reading_it():
    r, scheduler, registry = runner(scheduler_pb2.DECISION_RECOMPUTE, Engine())
    await run(r, TurnRequest(session_id="s", messages=CHAT, max_tokens=2))
    assert registry.reads == 1  # the first turn asks (NOT_FOUND) and says so to the scheduler
    assert scheduler.requests[0].session_not_found
    second = [*CHAT, {"role": "assistant", "content": "ok"}, {"role": "user", "content": "and?"}]
    await run(r, TurnRequest(session_id="s", messages=second, max_tokens=2))
    assert registry.reads == 1
    snapshot = scheduler.requests[1].session_snapshot
    assert snapshot.session.revision == 11 and snapshot.session.kv_transfer_params_json
    assert not snapshot.session.token_ids  # the digests are what gets checked, not the ids
    assert snapshot.session.history_tokens == len(registry.histories[0])
    assert scheduler.prompts[1][:len(registry.recorded[0].token_ids)] == list(registry.recorded[0].token_ids)


async def test_a_stale_record_is_read_again_and_the_turn_planned_again():
    r, scheduler, registry = runner(scheduler_pb2.DECISION_RECOMPUTE, Engine())
    await run(r, TurnRequest(session_id="s", messages=CHAT, max_tokens=2))
    scheduler.stale = 1
    turn, _ = await run(r, TurnRequest(session_id="s", messages=CHAT, max_tokens=2))
    assert registry.reads == 2 and len(scheduler.requests) == 3
    assert scheduler.requests[2].session_snapshot.session.revision == 11 and turn.kv.reason == "test"


async def test_a_pull_consumes_the_gateway_s_copy_of_the_record():
    r, scheduler, registry = runner(scheduler_pb2.DECISION_PULL, Engine())
    await run(r, TurnRequest(session_id="s", messages=CHAT, max_tokens=2))
    registry.session = None  # e.g. deleted meanwhile
    failing = r._engines["d:1"]

    async def broken(*a, **kw):
        raise EngineError(grpc.StatusCode.UNAVAILABLE, "decode worker gone")
        yield  # pragma: no cover

    failing.generate = broken
    turn = await r.prepare(TurnRequest(session_id="s", messages=CHAT, max_tokens=2))
    with pytest.raises(TurnError):
        async for _ in r.decode(turn):
            pass
    await r.prepare(TurnRequest(session_id="s", messages=CHAT, max_tokens=2))
    assert registry.reads == 2  # the pulled (claimed) record was not planned with again


async def test_the_first_token_comes_from_p_and_d_continues_after_it():
    # P samples "a"; D, given prompt + "a", continues with "bc" (a stand-in: each engine answers what it is told).
    p, d = Engine(answer="abc"), Engine(answer="bc")
    r, scheduler, registry = runner(scheduler_pb2.DECISION_RECOMPUTE, p, decode=d, first_token_from_prefill=True)
    turn, events = await run(r, TurnRequest(session_id="s", prompt_text="hi", max_tokens=3, temperature=0.5, seed=7))
    assert p.sampling == {**TurnRequest(temperature=0.5, seed=7).engine_sampling(), "min_tokens": 0,
                          "timeout_s": 120.0, "cache_salt": cache_salt.for_tenant(DEFAULT_TENANT)}
    assert p.sampling["temperature"] == 0.5 and p.sampling["seed"] == 7 and p.sampling["top_k"] == 0
    (d_prompt, d_kw), = d.calls
    assert d_prompt == [*[ord(c) for c in "hi"], ord("a")] and d_kw["max_tokens"] == 2
    assert d_kw["kv_transfer_params"]["for"] == "decode" and d_kw["cache_salt"] == p.sampling["cache_salt"]
    deltas = [e.text for e in events if isinstance(e, Delta)]
    assert deltas[0] == "a" and "".join(deltas) == "abc" and "ttft_ms" in turn.timings
    finished = events[-1]
    assert finished.output_ids == [ord(c) for c in "abc"] and finished.text == "abc"
    assert list(registry.recorded[-1].token_ids) == [ord(c) for c in "hiabc"]


async def test_p_and_d_get_the_tenant_s_salt_and_a_cache_group_shares_one():
    p, d = Engine(answer="ab"), Engine(answer="b")
    r, _, _ = runner(scheduler_pb2.DECISION_RECOMPUTE, p, decode=d)
    r.cache_group_of = {"b": "g", "c": "g"}.get
    salts = {}
    for tenant in ("a", "b", "c"):
        await run(r, TurnRequest(session_id="s", tenant=tenant, prompt_text="hi", max_tokens=2))
        assert d.calls[-1][1]["cache_salt"] == p.sampling["cache_salt"]
        salts[tenant] = p.sampling["cache_salt"]
    assert salts["a"] == cache_salt.for_tenant("a") != salts["b"] == salts["c"] == cache_salt.for_tenant("b", "g")


async def test_an_answer_that_ends_at_p_s_token_still_leaves_the_kv_on_d():
    p, d = Engine(answer="$"), Engine(answer="zz")  # "$" plays the end-of-sequence token
    r, _, registry = runner(scheduler_pb2.DECISION_RECOMPUTE, p, decode=d, first_token_from_prefill=True)
    _, events = await run(r, TurnRequest(session_id="s", prompt_text="hi", max_tokens=5))
    (d_prompt, d_kw), = d.calls
    assert d_prompt[-1] == ord("$") and d_kw["max_tokens"] == 1
    finished = events[-1]
    assert finished.finish_reason == "stop" and finished.output_ids == [ord("$")]  # D's own tokens are dropped
    assert list(registry.recorded[-1].token_ids) == [*[ord(c) for c in "hi"], ord("$")]


async def test_when_p_sent_no_block_for_its_token_d_samples_the_first_token_itself():
    # "hiya" fills its 4-token block exactly; P's handle lists that one block only: D's prompt "hiya" + "a" would need
    # a second block, and vLLM's connector would assert and kill D's engine
    p, d = Engine(answer="abc", tight_blocks=True), Engine(answer="abc")
    r, _, _ = runner(scheduler_pb2.DECISION_RECOMPUTE, p, decode=d, first_token_from_prefill=True)
    await run(r, TurnRequest(session_id="s", prompt_text="hiya", max_tokens=3))
    (d_prompt, d_kw), = d.calls
    assert d_prompt == [ord(c) for c in "hiya"] and d_kw["max_tokens"] == 3
    # one token shorter, the block has room: D continues after P's token
    p, d = Engine(answer="abc", tight_blocks=True), Engine(answer="bc")
    r, _, _ = runner(scheduler_pb2.DECISION_RECOMPUTE, p, decode=d, first_token_from_prefill=True)
    await run(r, TurnRequest(session_id="s", prompt_text="hiy", max_tokens=3))
    (d_prompt, d_kw), = d.calls
    assert d_prompt == [*[ord(c) for c in "hiy"], ord("a")] and d_kw["max_tokens"] == 2


async def test_with_stop_strings_d_samples_the_first_token_itself():
    p, d = Engine(answer="abc"), Engine(answer="abc")
    r, _, _ = runner(scheduler_pb2.DECISION_RECOMPUTE, p, decode=d, first_token_from_prefill=True)
    await run(r, TurnRequest(session_id="s", prompt_text="hi", max_tokens=3, stop=["\n"]))
    (d_prompt, d_kw), = d.calls
    assert d_prompt == [ord(c) for c in "hi"] and d_kw["max_tokens"] == 3


async def test_each_prefill_is_reported_to_the_scheduler():
    r, scheduler, _ = runner(scheduler_pb2.DECISION_PULL, Engine())
    turn, _ = await run(r, TurnRequest(session_id="s", prompt_text="hello", max_tokens=2))
    await until(lambda: scheduler.outcomes, 1.0, "the outcome report (sent off the turn's path)")
    (report,) = scheduler.outcomes
    assert report.prefill_worker_id == "p" and report.decision == scheduler_pb2.DECISION_PULL
    assert report.prompt_tokens == 5 and report.pulled_tokens == 3 and report.computed_tokens == 5
    assert report.prefill_ms == turn.timings["prefill_ms"]


async def test_a_request_the_engine_finds_invalid_is_a_400_not_a_503():
    r, _, _ = runner(scheduler_pb2.DECISION_RECOMPUTE, Engine(fail_prefills=1,
                                                              fail_code=grpc.StatusCode.INVALID_ARGUMENT))
    with pytest.raises(TurnError) as err:
        await r.prepare(TurnRequest(session_id="s", prompt_text="hi", max_tokens=2))
    assert err.value.http_status == 400 and "refused the request: engine said no" in str(err.value)
    r, _, _ = runner(scheduler_pb2.DECISION_RECOMPUTE, Engine(fail_prefills=1))  # anything else: the worker's fault
    with pytest.raises(TurnError) as err:
        await r.prepare(TurnRequest(session_id="s", prompt_text="hi", max_tokens=2))
    assert err.value.http_status == 503


async def test_turns_without_the_session_store_succeed_and_are_counted():
    from kvshuttle.control_plane.session import STORE_UNAVAILABLE

    r, scheduler, _ = runner(scheduler_pb2.DECISION_RECOMPUTE, Engine(), registry=DownRegistry())
    reason = f"{STORE_UNAVAILABLE} (UNAVAILABLE): could not read the session via etcd: recompute"
    plain = scheduler.PlanTurn

    async def plan(request, timeout=None):
        resp = await plain(request, timeout)
        resp.reason = reason if request.session_id != "other" else "no recorded KV for this session"
        return resp
    scheduler.PlanTurn = plan
    assert r.degraded == {"session_read_failed": 0, "recomputed_store_unavailable": 0, "record_failed": 0,
                          "history_missing": 0}
    for _ in range(2):
        turn, events = await run(r, TurnRequest(session_id="s", prompt_text="hello", max_tokens=2))
        assert isinstance(events[-1], Finished) and turn.kv.decision == "recompute" and turn.kv.reason == reason
    await run(r, TurnRequest(session_id="other", prompt_text="hello", max_tokens=2))
    assert r.degraded == {"session_read_failed": 3, "recomputed_store_unavailable": 2, "record_failed": 3,
                          "history_missing": 0}


class ClaimingRegistry(Registry):
    def __init__(self, session=None, claimable: bool = True):
        super().__init__(session)
        self.claims, self.claimable, self.order = [], claimable, []

    async def ClaimSession(self, request, timeout=None):
        self.claims.append(request)
        self.order.append("claim")
        return registry_pb2.ClaimSessionResponse(claimed=self.claimable, reason="" if self.claimable else "changed")

    async def RecordTurn(self, request, timeout=None):
        self.order.append("record")
        return await super().RecordTurn(request, timeout)


class AliveSourceScheduler(Scheduler):
    async def PlanTurn(self, request, timeout=None):
        plan = await super().PlanTurn(request, timeout)
        plan.figures.source_worker_alive = True
        return plan


def recorded_session(tokens: list[int], covered: int, text: str = "") -> common_pb2.Session:
    from kvshuttle.control_plane.session import set_seconds

    handle = {"do_remote_decode": True, "remote_engine_id": "d", "remote_host": "h", "remote_port": 1,
              "remote_num_tokens": covered, "remote_block_ids": [list(range(-(-covered // BLOCK)))]}
    session = recorded(text, tokens, kv_transfer_params_json=json.dumps(handle), covered_tokens=covered,
                       block_size=BLOCK, revision=7, decode_worker_id="d", prefix_digest=prefix_digest(tokens, covered),
                       head_token_ids=tokens[:BLOCK + 1])
    import time as _time

    set_seconds(session.expires_at, _time.time() + 300)
    return session


@pytest.mark.parametrize("case", ["released", "first block differs", "claim lost", "pulled"])
async def test_a_recompute_frees_the_previous_unused_handle_on_its_decode_worker(case):
    """D would hold an unread handle's blocks until its TTL: after a recompute the gateway claims the old handle and
    has P read its first block (D frees all of a handle's blocks after any read)."""
    history = [ord(c) for c in "<user>hello there<assistant>ok"]
    prompt_ids = history + [ord(c) for c in "<user>more"]
    if case == "first block differs":
        prompt_ids = [ord("X"), *prompt_ids[1:]]
    registry = ClaimingRegistry(recorded_session(history, len(history) - 1), claimable=case != "claim lost")
    scheduler = AliveSourceScheduler(scheduler_pb2.DECISION_PULL if case == "pulled"
                                     else scheduler_pb2.DECISION_RECOMPUTE)
    p = Engine()
    r = TurnRunner(Tokenizer(), registry, scheduler, max_model_len=1000, first_token_from_prefill=False)
    r._engines = {"p:1": p, "d:1": Engine()}
    known = KnownSession(registry_pb2.GetSessionResponse(session=registry.session, expires_in_s=300))
    plan = await scheduler.PlanTurn(scheduler_pb2.PlanTurnRequest(session_id="s", prompt_token_ids=prompt_ids))
    ctx = TurnContext("t1", TurnRequest(session_id="s"), 0.0, prompt_ids=prompt_ids, known_session=known, plan=plan)
    task = record_stage.release_unused_handle(r, ctx)  # the record stage alone, on a context built by hand
    if case in ("first block differs", "pulled"):
        assert task is None and not registry.claims
        return
    await task
    assert registry.claims[-1].revision == 7
    if case == "claim lost":
        assert p.calls == [] and r.released_handles == 0
        return
    prompt, kw = p.calls[-1]  # a streamed read, cancelled at its first token
    assert kw["kv_transfer_params"]["remote_block_ids"] == [[0]] and kw["stream"]
    assert kw["kv_transfer_params"]["remote_num_tokens"] == BLOCK and prompt == prompt_ids[:BLOCK + 1]
    assert r.released_handles == 1


async def test_the_release_claims_the_old_record_before_the_turn_records_the_new_one():
    history = [ord(c) for c in "<user>hi<assistant>ok"]
    registry = ClaimingRegistry(recorded_session(history, len(history) - 1, text="<user>hi<assistant>ok"))
    r = TurnRunner(Tokenizer(), registry, AliveSourceScheduler(scheduler_pb2.DECISION_RECOMPUTE), max_model_len=1000,
                   first_token_from_prefill=False)
    p = Engine()
    r._engines = {"p:1": p, "d:1": Engine()}
    await run(r, TurnRequest(session_id="s", messages=[{"role": "user", "content": "hi"},
                                                       {"role": "assistant", "content": "ok"},
                                                       {"role": "user", "content": "more"}], max_tokens=2))
    assert registry.order == ["claim", "record"] and r.released_handles == 1
    assert p.calls[-1][1]["kv_transfer_params"]["remote_num_tokens"] == BLOCK


async def test_ending_a_session_frees_its_handle_then_deletes_the_record():
    history = [ord(c) for c in "<user>hello there<assistant>ok"]

    class EndRegistry(ClaimingRegistry):
        async def DeleteSession(self, request, timeout=None):
            self.order.append("delete")
            return registry_pb2.DeleteSessionResponse(deleted=True)

    registry = EndRegistry(recorded_session(history, len(history) - 1))
    scheduler = AliveSourceScheduler(scheduler_pb2.DECISION_RECOMPUTE)
    p = Engine()
    r = TurnRunner(Tokenizer(), registry, scheduler, max_model_len=1000)
    r._engines = {"p:1": p, "d:1": Engine()}
    assert await r.end_session("default", "s") == (True, True)
    assert registry.order == ["claim", "delete"]
    assert scheduler.prompts[-1] == history[:BLOCK + 1]  # a prefill worker is asked for with the record's own ids
    assert p.calls[-1][0] == history[:BLOCK + 1] and p.calls[-1][1]["kv_transfer_params"]["remote_num_tokens"] == BLOCK
    with pytest.raises(TurnError) as err:
        await r.end_session("default", "bad id with spaces")
    assert err.value.http_status == 400


SAMPLING = dict(top_k=3, min_p=0.1, repetition_penalty=1.3, stop_token_ids=[ord("!")], logit_bias={ord("b"): 5.0},
                skip_special_tokens=False, spaces_between_special_tokens=False)


async def test_sampling_fields_reach_p_and_d_and_min_tokens_is_split_between_them():
    """P samples token 1 (min_tokens 1 keeps it from ending the answer there); D needs min_tokens - 1 more."""
    p, d = Engine(answer="abc"), Engine(answer="bc")
    r, _, _ = runner(scheduler_pb2.DECISION_RECOMPUTE, p, decode=d, first_token_from_prefill=True)
    await run(r, TurnRequest(session_id="s", prompt_text="hi", max_tokens=3, min_tokens=3, **SAMPLING))
    (d_prompt, d_kw), = d.calls
    assert d_prompt[-1] == ord("a") and d_kw["max_tokens"] == 2 and d_kw["min_tokens"] == 2
    assert p.sampling["min_tokens"] == 1
    for kw in (p.sampling, d_kw):
        assert {k: kw[k] for k in SAMPLING} == SAMPLING
        assert kw["presence_penalty"] == kw["frequency_penalty"] == 0.0


async def test_without_min_tokens_neither_worker_gets_one():
    p, d = Engine(answer="abc"), Engine(answer="bc")
    r, _, _ = runner(scheduler_pb2.DECISION_RECOMPUTE, p, decode=d, first_token_from_prefill=True)
    await run(r, TurnRequest(session_id="s", prompt_text="hi", max_tokens=3))
    (_, d_kw), = d.calls
    assert p.sampling["min_tokens"] == 0 and d_kw["min_tokens"] == 0 and d_kw["top_k"] == 0
    assert d_kw["repetition_penalty"] == 1.0 and d_kw["logit_bias"] == {} and d_kw["skip_special_tokens"]


@pytest.mark.parametrize("penalty", ["presence_penalty", "frequency_penalty"])
async def test_with_output_penalties_d_samples_the_first_token_itself(penalty):
    """They count the answer's tokens: D must see all of them, so P's token is dropped and D gets all of min_tokens."""
    p, d = Engine(answer="abc"), Engine(answer="abc")
    r, _, _ = runner(scheduler_pb2.DECISION_RECOMPUTE, p, decode=d, first_token_from_prefill=True)
    _, events = await run(r, TurnRequest(session_id="s", prompt_text="hi", max_tokens=3, min_tokens=2,
                                         **{penalty: 0.5}))
    (d_prompt, d_kw), = d.calls
    assert d_prompt == [ord(c) for c in "hi"] and d_kw["max_tokens"] == 3 and d_kw["min_tokens"] == 2
    assert d_kw[penalty] == 0.5 and p.sampling[penalty] == 0.5
    assert events[-1].text == "abc"


async def test_the_text_of_a_stop_token_id_is_left_out_unless_asked_for():
    # D ends the answer at "!", a stop token id: the token counts, its text is not shown (as vLLM does)
    for include, text in ((False, "ab"), (True, "ab!")):
        r, _, _ = runner(scheduler_pb2.DECISION_RECOMPUTE, Engine(answer="ab!"), decode=Engine(answer="b!"),
                         first_token_from_prefill=True)
        _, events = await run(r, TurnRequest(prompt_text="hi", max_tokens=5, stop_token_ids=[ord("!")],
                                             include_stop_str_in_output=include))
        assert events[-1].output_ids == [ord(c) for c in "ab!"] and events[-1].text == text
        assert "".join(e.text for e in events if isinstance(e, Delta)) == text


async def test_skip_special_tokens_reaches_the_detokenizer():
    seen = []

    class Recording(Tokenizer):
        def decode(self, ids, skip_special_tokens=True):
            seen.append(skip_special_tokens)
            return super().decode(ids)

    for skip in (True, False):
        seen.clear()
        r, _, _ = runner(scheduler_pb2.DECISION_RECOMPUTE, Engine())
        r.tokenizer = Recording()
        await run(r, TurnRequest(prompt_text="hi", max_tokens=2, skip_special_tokens=skip))
        assert seen and set(seen) == {skip}  # every decoding of the answer's text


def test_the_turn_span_carries_the_genai_sampling_attributes():
    from kvshuttle.services.gateway.turns.spans import request_attributes
    attrs = request_attributes(TurnRequest(prompt_text="x", top_k=5, presence_penalty=0.5, frequency_penalty=-1.0,
                                            stop=["\n"]), "m")
    assert attrs["gen_ai.request.top_k"] == 5.0 and attrs["gen_ai.request.presence_penalty"] == 0.5
    assert attrs["gen_ai.request.frequency_penalty"] == -1.0 and attrs["gen_ai.request.stop_sequences"] == ["\n"]
    plain = request_attributes(TurnRequest(prompt_text="x"), "m")
    assert not any(k in plain for k in ("gen_ai.request.top_k", "gen_ai.request.presence_penalty"))


async def test_the_next_turn_on_this_gateway_hashes_only_its_new_ids(monkeypatch):
    """The record stage keeps its digest state over the recorded history: the session's next turn here resumes it
    (its digests equal a full pass over the whole history), and a history it did not hash starts from scratch."""
    from kvshuttle.control_plane.prefix import PrefixHasher

    starts = []
    real = PrefixHasher.digests_along

    def spy(self, ids, lengths):
        starts.append(self.length)
        return real(self, ids, lengths)

    monkeypatch.setattr(PrefixHasher, "digests_along", spy)
    registry = Registry(recorded("<user>hi<assistant>ok", [900, 901, 902], turn=4, covered_tokens=2))
    r, _, _ = runner(scheduler_pb2.DECISION_RECOMPUTE, Engine(), registry, decode=HandingDecode())
    await run(r, TurnRequest(session_id="s", messages=MORE, max_tokens=2))
    first = registry.histories[-1]
    again = [*MORE, {"role": "assistant", "content": "ok"}, {"role": "user", "content": "again"}]
    await run(r, TurnRequest(session_id="s", messages=again, max_tokens=2))
    whole = registry.histories[-1]
    assert whole[:len(first)] == first and len(whole) > len(first)
    assert starts == [0, len(first)]  # the first turn here hashed everything, the second only its new ids
    record = registry.recorded[-1]
    assert record.base_tokens == len(first) and record.prefix_digest == prefix_digest(whole, len(whole) - 1)
    assert [(cp.tokens, cp.digest) for cp in record.checkpoints] == [(cp.tokens, prefix_digest(whole, cp.tokens))
                                                                      for cp in record.checkpoints]
    assert len(first) in [cp.tokens for cp in record.checkpoints]
    registry.session.history_generation += 1  # another lineage (e.g. another gateway replaced the history)
    r.forget_record("default", "s")
    third = [*again, {"role": "assistant", "content": "ok"}, {"role": "user", "content": "3"}]
    await run(r, TurnRequest(session_id="s", messages=third, max_tokens=2))
    assert starts[-1] == 0 and registry.recorded[-1].prefix_digest == prefix_digest(registry.histories[-1],
                                                                                    len(registry.histories[-1]) - 1)


# -- a turn continued on D (DECISION_LOCAL) ------------------------------------------------------------------------

async def test_a_turn_continued_on_d_runs_on_d_alone_and_frees_the_claimed_handle():
    history = [ord(c) for c in "<user>hi<assistant>ok"]
    registry = ClaimingRegistry(recorded_session(history, len(history) - 1, text="<user>hi<assistant>ok"))
    scheduler = Scheduler(scheduler_pb2.DECISION_LOCAL)
    p, d = Engine(), Engine(answer="fine", cached=16)
    r = TurnRunner(Tokenizer(), registry, scheduler, max_model_len=1000, first_token_from_prefill=True)
    r._engines = {"p:1": p, "d:1": d}
    turn, events = await run(r, TurnRequest(session_id="s", messages=MORE, max_tokens=4))
    prompt = turn.prompt_ids
    assert "".join(e.text for e in events if isinstance(e, Delta)) == "fine"
    # D got the exact prompt (no first token from P: P prefilled nothing) with params that set no remote flag
    (d_prompt, kw), = d.calls
    assert d_prompt == prompt and kw["kv_transfer_params"] == {"kvshuttle_local": True} and kw["max_tokens"] == 4
    assert not p.prefills
    kv = turn.kv
    assert (kv.decision, kv.reason_code, kv.prefill_worker_id, kv.decode_worker_id) == ("local", "local_always", "",
                                                                                       "d")
    assert kv.pulled_tokens == 0 and kv.computed_tokens == len(prompt) - 16  # D's own count of its cache hit
    assert registry.recorded[-1].decode_worker_id == "d" and kv.record == "recorded"
    # the claimed handle: freed by a one-block read on the plan's P (never claimed again: the plan claimed it)
    await until(lambda: r.released_handles == 1, 5, "the previous handle freed")
    (free_prompt, free_kw), = p.calls
    assert free_kw["kv_transfer_params"]["remote_num_tokens"] == BLOCK and free_prompt == prompt[:BLOCK + 1]
    assert not registry.claims
    await until(lambda: scheduler.outcomes, 5, "the outcome reported")
    (outcome,) = scheduler.outcomes
    assert outcome.decision == scheduler_pb2.DECISION_LOCAL and outcome.decode_worker_id == "d"
    assert outcome.decode_streams == 2 and outcome.computed_tokens == kv.computed_tokens and outcome.prefill_ms > 0
    assert outcome.pulled_tokens == 0 and outcome.prefill_worker_id == "p"


async def test_a_turn_continued_on_a_failing_d_is_recomputed_elsewhere_without_failing():
    scheduler, registry = Scheduler(scheduler_pb2.DECISION_LOCAL, decodes=("d", "d2")), Registry()
    r = TurnRunner(Tokenizer(), registry, scheduler, max_model_len=1000, first_token_from_prefill=False)
    r._engines = {"p:1": Engine(), "d:1": Engine(answer="abc", die_after=0), "d2:1": Engine(answer="abc")}
    turn, events = await run(r, TurnRequest(session_id="s", prompt_text="hello", max_tokens=3))
    assert "".join(e.text for e in events if isinstance(e, Delta)) == "abc"
    kv = turn.kv
    assert (kv.decision, kv.reason_code, kv.prefill_worker_id, kv.decode_worker_id) == ("recompute", "worker_failed",
                                                                                       "p", "d2")
    assert kv.computed_tokens == len("hello") and kv.worker_failures[-1].startswith("decode worker d failed after 0")
    retry = scheduler.requests[-1]
    assert retry.disable_pull and list(retry.exclude_worker_ids) == ["d"]
    assert registry.recorded[-1].decode_worker_id == "d2"
