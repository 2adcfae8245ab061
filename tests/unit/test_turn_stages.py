"""Each stage of a turn (services/gateway/turns/) run alone, on a TurnContext built by hand, against the stand-ins
of tests/support/turn_fakes.py: what it reads from the context and what it adds."""

from __future__ import annotations

import json

import grpc
from kvshuttle.control_plane import kv_params
from kvshuttle.control_plane.answer import Piece
from kvshuttle.control_plane.constraints import json_answer
from kvshuttle.control_plane.continuation import text_key
from kvshuttle.control_plane.reasoning import CONTENT, REASONING, REASONING_PARSERS
from kvshuttle.services.gateway.turns import AnswerParsing, TurnContext, TurnRequest, TurnRunner
from kvshuttle.services.gateway.turns import decode as decode_stage
from kvshuttle.services.gateway.turns import plan as plan_stage
from kvshuttle.services.gateway.turns import prefill as prefill_stage
from kvshuttle.services.gateway.turns import prompt as prompt_stage
from kvshuttle.services.gateway.turns import record as record_stage
from kvshuttle.services.gateway.turns.parse import AnswerEvents
from kvshuttle.services.gateway.turns.spans import tracer
from kvshuttle.v1 import common_pb2, scheduler_pb2

from tests.support.turn_fakes import PULL_PARAMS, Engine, Registry, Scheduler, Tokenizer, _rpc_error, recorded


def runner(decision=scheduler_pb2.DECISION_RECOMPUTE, registry=None, prefill=None, decode=None,
           first_token=False) -> tuple[TurnRunner, Scheduler, Registry]:
    scheduler, registry = Scheduler(decision), registry or Registry()
    r = TurnRunner(Tokenizer(), registry, scheduler, max_model_len=1000, first_token_from_prefill=first_token)
    r._engines = {"p:1": prefill or Engine(), "d:1": decode or Engine()}
    return r, scheduler, registry


def context(req: TurnRequest, **fields) -> TurnContext:
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
    assert ctx.known_session["session_snapshot"].session.revision == 3
    assert not ctx.known_session["session_snapshot"].session.token_ids  # the scheduler gets no history
    assert ctx.history_base.revision == 3 and ctx.history_base.history_tokens == 21  # the record stage appends to it
    assert ctx.request.session_source == "client" and registry.reads == 1 and "session_ms" in ctx.timings


async def test_the_prompt_stage_starts_a_new_session_for_a_chat_without_an_id_when_none_is_found():
    r, _, _ = runner()
    r.find_sessions = True
    r.tokenizer.end_markers = ["<end>"]  # type: ignore[attr-defined]

    async def find_session(request, timeout=None):
        raise _rpc_error(grpc.StatusCode.NOT_FOUND)

    r.registry.FindSession = find_session  # type: ignore[attr-defined]
    ctx = context(TurnRequest(messages=[{"role": "user", "content": "hi<end>again"}]))
    await prompt_stage.build(r, ctx)
    assert ctx.request.session_id.startswith("auto-") and ctx.request.session_source == "new"
    assert ctx.known_session == {"session_not_found": True} and not ctx.continued and "find_ms" in ctx.timings


async def test_the_plan_stage_rebuilds_the_prompt_once_when_its_snapshot_is_stale():
    record = recorded("<user>a", ids("<user>a"), revision=1)
    r, scheduler, registry = runner(registry=Registry(record))
    r.keep_record("default", "s", record)
    scheduler.stale = 1
    ctx = context(TurnRequest(session_id="s", prompt_text="<user>a<user>b"))
    await prompt_stage.build(r, ctx)
    assert registry.reads == 0  # this gateway's own copy
    await plan_stage.run(r, ctx)
    assert registry.reads == 1 and len(scheduler.requests) == 2  # read afresh, planned again
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
