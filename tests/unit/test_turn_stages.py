"""Each stage of a turn (services/gateway/turns/) run alone, on a TurnContext built by hand, against the stand-ins
of tests/support/turn_fakes.py: what it reads from the context and what it adds."""

from __future__ import annotations

import gc
import json

import grpc
import pytest
from kvshuttle.control_plane import kv_params
from kvshuttle.control_plane.answer import Piece
from kvshuttle.control_plane.constraints import json_answer
from kvshuttle.control_plane.continuation import text_key
from kvshuttle.control_plane.reasoning import CONTENT, REASONING, REASONING_PARSERS
from kvshuttle.services.engine.client import EngineError
from kvshuttle.services.gateway.turns import AnswerParsing, TurnContext, TurnRequest, TurnRunner
from kvshuttle.services.gateway.turns import decode as decode_stage
from kvshuttle.services.gateway.turns import plan as plan_stage
from kvshuttle.services.gateway.turns import prefill as prefill_stage
from kvshuttle.services.gateway.turns import prompt as prompt_stage
from kvshuttle.services.gateway.turns import record as record_stage
from kvshuttle.services.gateway.turns.context import KnownSession, KvOutcome
from kvshuttle.services.gateway.turns.errors import DecodeFailed, SnapshotStale, TurnError, WorkerDown
from kvshuttle.services.gateway.turns.parsers import AnswerEvents
from kvshuttle.services.gateway.turns.spans import tracer
from kvshuttle.v1 import common_pb2, registry_pb2, scheduler_pb2

from tests.support.turn_fakes import BLOCK, PULL_PARAMS, Engine, Registry, Scheduler, Tokenizer, _rpc_error, recorded


def runner(decision=scheduler_pb2.DECISION_RECOMPUTE, registry=None, prefill=None, decode=None,
           first_token=False) -> tuple[TurnRunner, Scheduler, Registry]:
    scheduler, registry = Scheduler(decision), registry or Registry()
    r = TurnRunner(Tokenizer(), registry, scheduler, max_model_len=1000, first_token_from_prefill=first_token)
    r._engines = {"p:1": prefill or Engine(), "d:1": decode or Engine()}
    return r, scheduler, registry


def context(req: TurnRequest, **fields) -> TurnContext:
    """A turn for one stage; a request that sets no limit gets 64 tokens, as the runner's length check gives it
    before any stage that generates runs."""
    if req.max_tokens is None:
        req.max_tokens, req.max_tokens_source = 64, "context"
    return TurnContext("t1", req, 0.0, span=tracer.start_span("test"), **fields)


def ids(text: str) -> list[int]:
    return [ord(c) for c in text]


async def test_the_prompt_stage_continues_the_recorded_ids_and_tokenizes_only_the_new_text():
    # the record holds ids that differ from what the text would tokenize to: they must be kept, not re-tokenized
    r, _, registry = runner(registry=Registry(recorded("<user>hi<assistant>ok", [7] * 21, revision=3)))
    ctx = context(TurnRequest(session_id="s", messages=[{"role": "user", "content": "hi"},
                                                        {"role": "assistant", "content": "ok"},
                                                        {"role": "user", "content": "more"}]))
    await prompt_stage.build(r, ctx)
    assert ctx.prompt_text == "<user>hi<assistant>ok<user>more<assistant>"
    assert ctx.prompt_ids == [7] * 21 + ids("<user>more<assistant>") and ctx.continued
    assert ctx.known_session.snapshot.session.revision == 3
    assert not ctx.known_session.snapshot.session.token_ids  # the scheduler gets no history
    assert ctx.history_base.revision == 3 and ctx.history_base.history_tokens == 21  # the record stage appends to it
    assert ctx.request.session_source == "client" and registry.reads == 1 and "session_ms" in ctx.timings


async def test_a_session_is_continued_only_for_its_own_model():
    """Issue #37: a client's session id sent to another model continues none of the record's ids (another model's
    tokens), though the scheduler still gets the snapshot (and refuses its KV: other_model); the record stage then
    sends the whole history under the turn's model. A chat without an id finds only its own model's sessions."""
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok"},
                {"role": "user", "content": "more"}]
    for model, continued in (("tiny", True), ("other", False)):
        r, _, registry = runner(registry=Registry(recorded("<user>hi<assistant>ok", [7] * 21, model="tiny")))
        ctx = context(TurnRequest(session_id="s", messages=messages, model=model))
        await prompt_stage.build(r, ctx)
        assert ctx.continued is continued and (ctx.history_base is not None) is continued
        assert ctx.prompt_ids[:21] == ([7] * 21 if continued else ids("<user>hi<assistant>ok"))
        assert ctx.known_session.snapshot.session.model == "tiny"  # the scheduler still sees whose KV it is

    r, _, registry = runner(registry=Registry(recorded("<user>hi<assistant>ok", [7] * 21, model="tiny")))
    r.find_sessions = True
    r.tokenizer.end_markers = ["<user>"]  # type: ignore[attr-defined]  # the recorded text ends before one
    for model, source in (("other", "new"), ("tiny", "found")):
        ctx = context(TurnRequest(messages=messages, model=model))
        await prompt_stage.build(r, ctx)
        assert ctx.request.session_source == source and ctx.continued is (source == "found")


def test_a_prompt_cache_key_names_a_session_per_model():
    a, b = TurnRequest(cache_key="k", model="a"), TurnRequest(cache_key="k", model="b")
    assert a.cache_key_session != b.cache_key_session and a.cache_key_session.startswith("pck-")
    assert TurnRequest(cache_key="k", model="a").cache_key_session == a.cache_key_session


async def test_the_prompt_stage_starts_a_new_session_for_a_chat_without_an_id_when_none_is_found():
    r, _, _ = runner()
    r.find_sessions = True
    r.tokenizer.end_markers = ["<end>"]  # type: ignore[attr-defined]
    asked = []

    async def find_session(request, timeout=None):
        asked.append(request)
        raise _rpc_error(grpc.StatusCode.NOT_FOUND)

    r.registry.FindSession = find_session  # type: ignore[attr-defined]
    ctx = context(TurnRequest(messages=[{"role": "user", "content": "hi<end>"}, {"role": "assistant", "content": "a"},
                                        {"role": "user", "content": "again"}]))
    await prompt_stage.build(r, ctx)
    assert ctx.request.session_id.startswith("auto-") and ctx.request.session_source == "new"
    assert ctx.known_session == KnownSession(not_found=True) and not ctx.continued and "find_ms" in ctx.timings
    assert len(asked) == 1


async def test_the_plan_stage_says_when_its_snapshot_is_stale_and_the_runner_plans_again_on_a_fresh_read():
    record = recorded("<user>a", ids("<user>a"), revision=1)
    r, scheduler, registry = runner(registry=Registry(record))
    r.keep_record("default", "s", record)
    scheduler.stale = 1
    ctx = context(TurnRequest(session_id="s", prompt_text="<user>a<user>b"))
    await prompt_stage.build(r, ctx)
    assert registry.reads == 0  # this gateway's own copy
    with pytest.raises(SnapshotStale):  # the stage alone: it neither reads the record nor plans again itself
        await plan_stage.run(r, ctx)
    assert registry.reads == 0 and len(scheduler.requests) == 1
    scheduler.stale = 1
    await r._plan(ctx)  # the runner's loop, on the same hand-built context: stale once more, then read afresh
    assert registry.reads == 1 and len(scheduler.requests) == 3
    assert ctx.plan.prefill.worker_id == "p" and ctx.kv.decision == "recompute" and ctx.kv.session_id == "s"
    assert r.own_record("default", "s") is None and "plan_ms" in ctx.timings


async def test_the_plan_stage_places_a_constraint_after_the_reasoning_the_prompt_leaves_open():
    r, _, _ = runner()
    constraint = json_answer({"type": "object"})
    ctx = context(TurnRequest(prompt_text="<user>a<assistant><think>\n", constraint=constraint,
                              reasoning_tags=("<think>", "</think>")), prompt_text="<user>a<assistant><think>\n",
                  prompt_ids=ids("<user>a<assistant><think>\n"))
    await plan_stage.run(r, ctx)
    placed = json.loads(ctx.request.constraint.value)["format"]  # the model finishes its reasoning, then the JSON
    assert ctx.request.constraint.kind == "structural_tag" and placed["elements"][0]["end"] == "</think>"
    assert placed["elements"][-1]["json_schema"] == {"type": "object"} and constraint.kind == "json_schema"
    assert ctx.request.reasoning_tags is None  # placed once


async def test_the_prefill_stage_retries_a_failed_pull_as_a_recompute_and_keeps_p_s_first_token():
    p = Engine(fail_prefills=1, answer="xy")
    r, scheduler, _ = runner(scheduler_pb2.DECISION_PULL, prefill=p, first_token=True)
    prompt = ids("<user>hello")
    ctx = context(TurnRequest(session_id="s", prompt_ids=prompt), prompt_ids=prompt)
    await plan_stage.run(r, ctx)
    assert ctx.kv.decision == "pull"
    await prefill_stage.run(r, ctx)
    assert ctx.kv.decision == "recompute" and ctx.kv.retried_as_recompute and ctx.kv.reason_code == "pull_failed"
    assert p.prefills == [PULL_PARAMS, kv_params.prefill_request_params()]
    assert ctx.decode_params["remote_block_ids"] == [[0, 1, 2]] and ctx.first_token == ord("x")
    assert ctx.kv.computed_tokens == len(prompt) and "prefill_ms" in ctx.timings


async def test_the_decode_stage_streams_the_text_and_leaves_the_stop_token_out():
    d = Engine(answer="hi!")
    r, _, _ = runner(decode=d)
    r.tokenizer.eos_token_ids = [ord("!")]  # type: ignore[attr-defined]
    plan = scheduler_pb2.PlanTurnResponse(decode=common_pb2.Worker(worker_id="d", grpc_address="d:1"))
    ctx = context(TurnRequest(prompt_ids=[1, 2]), prompt_ids=[1, 2], plan=plan, decode_params={"h": 1})
    deltas = [delta async for delta in decode_stage.run(r, ctx)]
    assert "".join(x.text for x in deltas) == ctx.text == "hi"
    assert [i for x in deltas for i in x.token_ids] == ctx.output_ids == ids("hi!")
    assert ctx.hidden == {ord("!")} and ctx.final.kv_transfer_params == {"do_remote_decode": True, "handle": 1}
    assert d.calls[0][1]["kv_transfer_params"] == {"h": 1}


async def test_the_record_stage_records_what_the_client_received_plus_the_end_marker():
    r, _, registry = runner()
    r.tokenizer.eos_token_ids = [ord("!")]  # type: ignore[attr-defined]
    d = Engine(answer="hi!")
    plan = scheduler_pb2.PlanTurnResponse(decode=common_pb2.Worker(worker_id="d", grpc_address="d:1"))
    ctx = context(TurnRequest(session_id="s", prompt_text="<user>a"), prompt_ids=ids("<user>a"),
                  prompt_text="<user>a", plan=plan)
    r._engines["d:1"] = d
    async for _ in decode_stage.run(r, ctx):
        pass
    await record_stage.run(r, ctx)
    (recorded,) = registry.recorded
    assert (recorded.text_chars, recorded.text_key) == (len("<user>ahi!"), text_key("<user>ahi!"))
    assert list(recorded.token_ids) == ids("<user>ahi!") and recorded.base_tokens == 0
    assert recorded.decode_worker_id == "d" and not recorded.text  # the registry keeps only the length and key
    assert r.own_record("default", "s").revision == 11 and "record_ms" in ctx.timings


async def test_the_parse_stage_puts_the_answer_s_meaning_on_each_delta_and_the_whole_on_the_summary():
    d = Engine(answer="<think>hm</think>hi there")
    r, _, _ = runner(decode=d)
    req = TurnRequest(prompt_ids=[1, 2], parsing=AnswerParsing(reasoning=REASONING_PARSERS["qwen3"]))
    plan = scheduler_pb2.PlanTurnResponse(decode=common_pb2.Worker(worker_id="d", grpc_address="d:1"))
    ctx = context(req, prompt_ids=[1, 2], plan=plan, decode_params={"h": 1})
    events = [e async for e in r.decode(ctx)]
    *deltas, finished = events
    streamed = [piece for delta in deltas for piece in delta.events] + finished.events
    assert streamed == finished.answer_events
    assert [(p.kind, p.text) for p in streamed if p.text] and "".join(
        p.text for p in streamed if p.kind == REASONING) == "hm"
    assert "".join(p.text for p in streamed if p.kind == CONTENT) == "hi there"
    # without parsing, the text is the content
    plain = AnswerEvents(None, "")
    assert plain.feed("a<think>") == [Piece(CONTENT, "a<think>")] and plain.finish() == [] and plain.events


@pytest.mark.parametrize("parsing", [None, AnswerParsing(reasoning=REASONING_PARSERS["qwen3"])])
def test_an_answer_s_kept_pieces_leave_the_collector_s_generations(parsing):
    """What the parse stage keeps of a long answer (every piece, for the whole answer's events) is untracked by the
    collector after its first pass: thousands of tokens add nothing to the old generation's full collections."""
    answer = AnswerEvents(parsing, "")
    fed = [e for i in range(2000) for e in answer.feed("<think>" if i == 0 else "</think>" if i == 5 else f" w{i}")]
    fed += answer.finish()
    gc.collect()
    assert answer.events == fed  # the same events, in order
    assert not any(gc.is_tracked(kept) for kept in answer._kept)


class MarkedTokenizer(Tokenizer):
    """The character tokenizer, with a chat template that ends every message with ``<end>`` (its end marker) and
    renders an assistant message's reasoning only when it is echoed."""

    end_markers = ["<end>"]

    def render_chat(self, messages, add_generation_prompt=True):
        def one(m):
            think = f"<think>{m['reasoning_content']}</think>" if m.get("reasoning_content") else ""
            return f"<{m['role']}>{think}{m['content']}<end>"
        return "".join(one(m) for m in messages) + ("<assistant>" if add_generation_prompt else "")


ASKED = "<user>hi<end><assistant>"  # the first turn's prompt; its last message ends after "<user>hi<end>"
ANSWERED = ASKED + "<think>r</think>ok<end>"  # ... and the answer as generated


def marked_runner(record: common_pb2.Session | None = None):
    r, scheduler, registry = runner(registry=Registry(record) if record is not None else None)
    r.tokenizer = MarkedTokenizer()
    return r, scheduler, registry


def first_record(ids_: list[int]) -> common_pb2.Session:
    """Turn 1 as recorded: its text ANSWERED, with the boundary where the prompt's last message (the user's) ended."""
    head = "<user>hi<end>"
    return recorded(ANSWERED, ids_, revision=3, text_boundaries=[
        common_pb2.TextBoundary(key=text_key(head), chars=len(head), tokens=len(head), loop_start=True)])


async def test_a_history_echoed_without_the_reasoning_continues_the_recorded_ids_up_to_the_boundary():
    history = [7] * len(ANSWERED)  # ids the text would not tokenize to: the splice must keep them
    r, scheduler, registry = marked_runner(first_record(history))
    ctx = context(TurnRequest(session_id="s", messages=[
        {"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok"},  # no reasoning_content
        {"role": "user", "content": "more"}]))
    await prompt_stage.build(r, ctx)
    head = len("<user>hi<end>")
    assert ctx.prompt_text == "<user>hi<end><assistant>ok<end><user>more<end><assistant>"
    assert ctx.prompt_ids == [7] * head + ids("<assistant>ok<end><user>more<end><assistant>") and ctx.continued
    assert ctx.history_kept == head and ctx.history_base.revision == 3
    # the scheduler learns how many ids repeat the record's (here exactly the spliced ones)
    assert ctx.known_session.history_match_tokens == head
    # the record keeps the cut where this prompt's last message (a user query: a new loop) ends
    end = len("<user>hi<end><assistant>ok<end><user>more<end>")
    assert ctx.text_cuts == [(end, end - len("<user>hi<end>") + head, True)]
    await plan_stage.run(r, ctx)
    assert scheduler.requests[0].history_match_tokens == head
    ctx.plan = scheduler_pb2.PlanTurnResponse(decode=common_pb2.Worker(worker_id="d", grpc_address="d:1"))
    async for _ in decode_stage.run(r, ctx):
        pass
    n = len(ctx.prompt_ids) + len(ctx.output_ids) - 1  # D's handle covers all but the last token
    ctx.final.kv_transfer_params = {"do_remote_decode": True, "remote_block_ids": [list(range(n // BLOCK + 1))],
                                    "remote_engine_id": "e", "remote_host": "h", "remote_port": 1,
                                    "remote_num_tokens": n}
    await record_stage.run(r, ctx)
    sent = registry.recorded[-1]
    # the history changed past the boundary: only the ids after the kept ones go to the registry (whose history
    # store copies the kept ones into a new lineage), with the new boundary
    assert (sent.base_tokens, sent.base_turn) == (head, 1)
    assert list(sent.token_ids) == (ctx.prompt_ids + ctx.output_ids)[head:]
    assert registry.histories[-1] == ctx.prompt_ids + ctx.output_ids
    (boundary,) = sent.text_boundaries
    assert (boundary.chars, boundary.tokens, boundary.loop_start) == (end, end, True)
    assert boundary.key == text_key(ctx.prompt_text[:end])
    assert {head, end} <= {cp.tokens for cp in sent.checkpoints}  # digests at both: the scheduler can prove them


async def test_a_tool_loop_step_keeps_the_loop_s_start_from_the_record_it_continues():
    history = ids(ANSWERED)
    r, _, _ = marked_runner(first_record(history))
    echoed = {"role": "assistant", "content": "ok", "reasoning_content": "r"}  # whole: the text extends the record
    ctx = context(TurnRequest(session_id="s", messages=[
        {"role": "user", "content": "hi"}, echoed, {"role": "tool", "content": "21C"}]))
    await prompt_stage.build(r, ctx)
    assert ctx.continued and ctx.history_kept == len(history) and ctx.prompt_ids[:len(history)] == history
    assert ctx.known_session.history_match_tokens == len(history)  # all of it: a pull of every covered token
    end = len(ANSWERED + "<tool>21C<end>")
    head = len("<user>hi<end>")
    # a tool result is no new query: the loop still starts where the record's did
    assert ctx.text_cuts == [(head, head, True), (end, end, False)]


async def test_a_first_turn_never_continues_a_session_at_a_boundary():
    """A new chat that merely starts as another did (same first message) does not take over that session; a later
    turn whose history diverges only in the last answer does."""
    r, _, registry = marked_runner(first_record(ids(ANSWERED)))
    r.find_sessions = True
    keys_asked = []

    async def find_session(request, timeout=None):
        keys_asked.append(list(request.text_keys))
        key = text_key("<user>hi<end>")
        if key not in request.text_keys:
            raise _rpc_error(grpc.StatusCode.NOT_FOUND)
        out = registry_pb2.FindSessionResponse(session=registry.session, expires_in_s=100,
                                               matched_key=list(request.text_keys).index(key))
        out.session.token_ids.extend(registry.history)
        return out

    r.registry.FindSession = find_session  # type: ignore[attr-defined]
    same_start = context(TurnRequest(messages=[{"role": "user", "content": "hi"}]))
    await prompt_stage.build(r, same_start)
    assert same_start.request.session_source == "new" and not same_start.continued
    assert keys_asked == []  # no answer in its prompt: no record's text it could continue, nothing to ask
    dropped = context(TurnRequest(messages=[{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok"},
                                            {"role": "user", "content": "more"}]))
    await prompt_stage.build(r, dropped)
    assert dropped.request.session_source == "found" and dropped.request.session_id == "s"
    assert dropped.continued and dropped.history_kept == len("<user>hi<end>") and len(keys_asked) == 1


async def test_a_prompt_cache_key_names_the_session_its_prompt_continues_and_else_a_new_one():
    r, _, registry = marked_runner()
    r.find_sessions = True

    async def find_session(request, timeout=None):
        raise _rpc_error(grpc.StatusCode.NOT_FOUND)

    r.registry.FindSession = find_session  # type: ignore[attr-defined]
    ask = [{"role": "user", "content": "hi"}]
    first = context(TurnRequest(messages=ask, cache_key="conversation 7"))
    await prompt_stage.build(r, first)
    keyed = first.request.session_id
    assert keyed == TurnRequest(cache_key="conversation 7").cache_key_session and keyed.startswith("pck-")
    assert first.request.session_source == "new"  # the key names no session yet: it starts one under its id
    # that session recorded, the key's next turn continues it
    registry.session, registry.history = first_record([]), ids(ANSWERED)  # the record, its ids aside
    registry.session.session_id = keyed
    later = context(TurnRequest(messages=[*ask, {"role": "assistant", "content": "ok"},
                                          {"role": "user", "content": "more"}], cache_key="conversation 7"))
    await prompt_stage.build(r, later)
    assert (later.request.session_id, later.request.session_source) == (keyed, "prompt_cache_key")
    assert later.continued and later.history_kept == len("<user>hi<end>")
    # another conversation sent with the same key does not take the key's session over
    other = context(TurnRequest(messages=[{"role": "user", "content": "bye"}, {"role": "assistant", "content": "x"},
                                          {"role": "user", "content": "more"}], cache_key="conversation 7"))
    await prompt_stage.build(r, other)
    assert other.request.session_source == "new" and other.request.session_id.startswith("auto-")


async def test_the_decode_stage_alone_says_when_d_fails_and_the_runner_resumes_it_on_another():
    # stage alone: D dies after 2 tokens, the stage raises DecodeFailed with what was streamed kept in the context
    scheduler = Scheduler(scheduler_pb2.DECISION_RECOMPUTE, decodes=("d", "d2"))
    r = TurnRunner(Tokenizer(), Registry(), scheduler, max_model_len=1000, first_token_from_prefill=False)
    r._engines = {"p:1": Engine(answer="a"), "d:1": Engine(answer="abcdef", die_after=2), "d2:1": Engine(answer="cdef")}
    plan = scheduler_pb2.PlanTurnResponse(decode=common_pb2.Worker(worker_id="d", grpc_address="d:1"))
    ctx = context(TurnRequest(prompt_ids=[1, 2], max_tokens=6), prompt_ids=[1, 2], plan=plan, decode_params={})
    with pytest.raises(DecodeFailed) as failed:
        async for _ in decode_stage.run(r, ctx):
            pass
    assert failed.value.worker_id == "d" and ctx.output_ids == ids("ab")
    # the runner's resume, on the same hand-built context: P prefills the prompt plus "ab", the turn moves to d2
    d_prompt = await r._resume(ctx, failed.value, 1)
    assert d_prompt == [1, 2, *ids("ab")] and ctx.plan.decode.worker_id == "d2" and ctx.excluded == ["d"]
    assert list(scheduler.requests[-1].exclude_worker_ids) == ["d"] and ctx.kv.decode_worker_id == "d2"
    assert ctx.kv.worker_failures[-1].startswith("decode worker d failed after 2 tokens")
    with pytest.raises(TurnError) as err:  # no retries left
        await r._resume(ctx, failed.value, r.worker_retries + 1)
    assert err.value.http_status == 503 and "no retries left" in err.value.message


async def test_the_runner_moves_a_turn_whose_p_fails_to_another_p():
    scheduler = Scheduler(scheduler_pb2.DECISION_RECOMPUTE)
    r = TurnRunner(Tokenizer(), Registry(), scheduler, max_model_len=1000, first_token_from_prefill=False)
    r._engines = {"p:1": Engine(), "d:1": Engine()}
    ctx = context(TurnRequest(prompt_ids=[1, 2]), prompt_ids=[1, 2], kv=KvOutcome("recompute", "new session"))
    tried = []

    async def attempt(plan, n):  # fails on its first P, as prefill_stage.run does when P is down
        tried.append((plan.prefill.worker_id, n))
        if n == 0:
            raise WorkerDown("p0", EngineError(grpc.StatusCode.UNAVAILABLE, "gone"))

    first = scheduler_pb2.PlanTurnResponse(prefill=common_pb2.Worker(worker_id="p0", grpc_address="p0:1"))
    plan = await r._prefill(ctx.id, first, ctx.prompt_ids, ctx.kv, ctx.request, ctx.excluded, attempt)
    assert tried == [("p0", 0), ("p", 1)] and plan.prefill.worker_id == "p" and ctx.excluded == ["p0"]
    assert ctx.kv.reason_code == "worker_failed" and ctx.kv.worker_failures == [
        "prefill worker p0 failed (UNAVAILABLE: gone); recomputed on p"]
    r.worker_retries = 0
    with pytest.raises(TurnError) as err:
        await r._prefill(ctx.id, first, ctx.prompt_ids, ctx.kv, ctx.request, [], attempt)
    assert err.value.http_status == 503 and "no retries left" in err.value.message
