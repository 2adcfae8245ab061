"""The gateway's metrics move as its turns go: answered turns by decision and reason code, tokens, TTFT, failures by
kind, failed workers, degraded turns. TurnRunner with the stand-ins of test_turns; values read from the registry the
gateway's /metrics endpoint serves."""

from __future__ import annotations

import grpc
import pytest
from kvshuttle.control_plane import reasons
from kvshuttle.services.common import metrics
from kvshuttle.services.gateway.turns import TurnError, TurnRequest, TurnRunner
from kvshuttle.v1 import scheduler_pb2
from prometheus_client import generate_latest

from tests.support.metrics import delta, parse
from tests.support.turn_fakes import (
    DownRegistry,
    Engine,
    RefusingRegistry,
    Registry,
    Scheduler,
    Tokenizer,
    resume_runner,
    run,
    runner,
)

GATEWAY = metrics.registry_for("gateway")


def scrape():
    return parse(generate_latest(GATEWAY).decode())


class CodedScheduler(Scheduler):
    """The test scheduler, answering with reason codes as the real one does."""

    async def PlanTurn(self, request, timeout=None):
        plan = await super().PlanTurn(request, timeout)
        if request.disable_pull:
            plan.reason_code = reasons.PULL_DISABLED
        else:
            plan.reason_code = reasons.PULL_PREFIX if plan.decision == scheduler_pb2.DECISION_PULL else reasons.NO_RECORD
        plan.figures.policy = "cost"
        return plan


class PullingEngine(Engine):
    """A prefill worker that reports the pulled tokens as cached, as vLLM does."""

    async def prefill(self, request_id, prompt_ids, *, kv_transfer_params, **sampling):
        final = await super().prefill(request_id, prompt_ids, kv_transfer_params=kv_transfer_params, **sampling)
        final.cached_tokens = kv_transfer_params.get("remote_num_tokens") or 0
        return final


def coded_runner(decision, prefill: Engine, **kw) -> TurnRunner:
    r, _, registry = runner(decision, prefill, **kw)
    r.scheduler = CodedScheduler(decision)
    return r


async def test_an_answered_pull_turn_moves_turns_tokens_and_ttft():
    r = coded_runner(scheduler_pb2.DECISION_PULL, PullingEngine())
    r.kv_bytes_per_token = 1000
    before = scrape()
    turn, events = await run(r, TurnRequest(session_id="s", prompt_text="hello", max_tokens=4, model="m-metrics"))
    after = scrape()
    kv = turn.kv
    assert kv.decision == "pull" and kv.reason_code == reasons.PULL_PREFIX and kv.pulled_tokens == 3
    assert kv.computed_tokens == 2
    assert delta(before, after, "kvshuttle_turns_total", decision="pull", reason="pull_prefix") == 1
    assert delta(before, after, "kvshuttle_turns_total", model="m-metrics") == 1  # by the model it asked for
    assert delta(before, after, "kvshuttle_ttft_seconds_count", model="m-metrics") == 1
    assert delta(before, after, "kvshuttle_turns_total") == 1
    assert delta(before, after, "kvshuttle_turn_tokens_total", kind="prompt") == 5
    assert delta(before, after, "kvshuttle_turn_tokens_total", kind="pulled") == 3
    assert delta(before, after, "kvshuttle_turn_tokens_total", kind="computed") == 2
    assert delta(before, after, "kvshuttle_turn_tokens_total", kind="cached") == 0
    assert delta(before, after, "kvshuttle_turn_tokens_total", kind="generated") == len(events[-1].output_ids) == 2
    assert delta(before, after, "kvshuttle_kv_pulled_bytes_total") == 3000
    assert delta(before, after, "kvshuttle_ttft_seconds_count", decision="pull", policy="cost") == 1
    ttft = events[-1].timings["ttft_ms"] / 1000
    assert delta(before, after, "kvshuttle_ttft_seconds_sum", decision="pull") == pytest.approx(ttft)
    assert delta(before, after, "kvshuttle_turn_duration_seconds_count", decision="pull") == 1
    assert delta(before, after, "kvshuttle_turn_failures_total") == 0


async def test_a_failed_pull_counts_as_a_recompute_because_the_pull_failed():
    r = coded_runner(scheduler_pb2.DECISION_PULL, Engine(fail_prefills=1))
    before = scrape()
    await run(r, TurnRequest(session_id="s", prompt_text="hello", max_tokens=2))
    after = scrape()
    assert delta(before, after, "kvshuttle_turns_total", decision="recompute", reason="pull_failed") == 1
    assert delta(before, after, "kvshuttle_turns_total", decision="pull") == 0
    assert delta(before, after, "kvshuttle_turn_tokens_total", kind="pulled") == 0


async def test_a_failed_prefill_worker_is_counted_and_so_is_the_turn_it_leaves_without_one():
    before = scrape()
    r = coded_runner(scheduler_pb2.DECISION_RECOMPUTE, Engine(fail_prefills=1))
    with pytest.raises(TurnError):
        await r.prepare(TurnRequest(session_id="s", prompt_text="hello", max_tokens=2))
    after = scrape()
    assert delta(before, after, "kvshuttle_worker_failures_total", role="prefill") == 1
    assert delta(before, after, "kvshuttle_turn_failures_total", kind="unavailable") == 1
    assert delta(before, after, "kvshuttle_turns_total") == 0

    p1, p2 = Engine(fail_prefills=1, fail_code=grpc.StatusCode.UNAVAILABLE), Engine()
    r = TurnRunner(Tokenizer(), Registry(), CodedScheduler(scheduler_pb2.DECISION_RECOMPUTE, prefills=("p", "p2")),
                   max_model_len=1000, first_token_from_prefill=False)
    r._engines = {"p:1": p1, "p2:1": p2, "d:1": Engine()}
    before = scrape()
    await run(r, TurnRequest(session_id="s", prompt_text="hello", max_tokens=2))
    after = scrape()
    assert delta(before, after, "kvshuttle_worker_failures_total", role="prefill") == 1
    assert delta(before, after, "kvshuttle_turns_total", decision="recompute", reason="worker_failed") == 1


async def test_a_decode_worker_failure_is_counted_whether_the_answer_resumes_or_not():
    r, _, _ = resume_runner(Engine(answer="abcdef", die_after=2), Engine(answer="cdef"))
    before = scrape()
    await run(r, TurnRequest(session_id="s", prompt_text="hello", max_tokens=6))
    after = scrape()
    assert delta(before, after, "kvshuttle_worker_failures_total", role="decode") == 1
    assert delta(before, after, "kvshuttle_turns_total") == 1
    assert delta(before, after, "kvshuttle_turns_total", reason="unknown") == 1  # the stand-in sends no code

    r, _, _ = resume_runner(Engine(answer="abcdef", die_after=2), None)
    turn = await r.prepare(TurnRequest(session_id="s", prompt_text="hello", max_tokens=6))
    before = scrape()
    with pytest.raises(TurnError):
        async for _ in r.decode(turn):
            pass
    after = scrape()
    assert delta(before, after, "kvshuttle_worker_failures_total", role="decode") == 1
    assert delta(before, after, "kvshuttle_turn_failures_total", kind="unavailable") == 1
    assert delta(before, after, "kvshuttle_turns_total") == 0


@pytest.mark.parametrize("req,kind", [
    (TurnRequest(prompt_text="hi", max_tokens=0), "bad_request"),
    (TurnRequest(prompt_ids=[1, -1], max_tokens=2), "bad_request"),
])
async def test_refused_requests_count_as_failures_by_kind(req, kind):
    r = coded_runner(scheduler_pb2.DECISION_RECOMPUTE, Engine())
    before = scrape()
    with pytest.raises(TurnError):
        await r.prepare(req)
    after = scrape()
    assert delta(before, after, "kvshuttle_turn_failures_total", kind=kind) == 1
    assert delta(before, after, "kvshuttle_turn_failures_total") == 1


async def test_a_stream_the_client_leaves_counts_as_cancelled_but_a_finished_one_never_fails():
    r = coded_runner(scheduler_pb2.DECISION_RECOMPUTE, Engine(answer="abcdef"))
    turn = await r.prepare(TurnRequest(session_id="s", prompt_text="hello", max_tokens=6))
    before = scrape()
    stream = r.decode(turn)
    await anext(stream)
    await stream.aclose()  # the client went away after the first token
    after = scrape()
    assert delta(before, after, "kvshuttle_turn_failures_total", kind="cancelled") == 1
    assert delta(before, after, "kvshuttle_turns_total") == 0

    turn = await r.prepare(TurnRequest(session_id="s2", prompt_text="hello", max_tokens=2))
    stream = r.decode(turn)
    before = scrape()
    async for event in stream:
        if type(event).__name__ == "Finished":
            break  # closes the generator right after its last event
    await stream.aclose()
    after = scrape()
    assert delta(before, after, "kvshuttle_turns_total") == 1
    assert delta(before, after, "kvshuttle_turn_failures_total") == 0


async def test_degraded_turns_and_released_handles_are_read_from_the_runner():
    r, _, _ = runner(scheduler_pb2.DECISION_RECOMPUTE, Engine(), registry=DownRegistry())
    metrics.GATEWAY_STATE.register(r.metrics_state)
    before = scrape()
    await run(r, TurnRequest(session_id="s", prompt_text="hello", max_tokens=2))
    r.released_handles += 2
    after = scrape()
    assert delta(before, after, "kvshuttle_degraded_turns_total", kind="session_read_failed") == 1
    assert delta(before, after, "kvshuttle_degraded_turns_total", kind="record_failed") == 1
    assert delta(before, after, "kvshuttle_kv_handles_released_total") == 2


async def test_a_record_the_registry_refuses_shows_on_the_turn_and_in_its_metric():
    r, _, _ = runner(scheduler_pb2.DECISION_RECOMPUTE, Engine(), registry=RefusingRegistry())
    before = scrape()
    _, events = await run(r, TurnRequest(session_id="s", prompt_text="hello", max_tokens=2))
    recorded, _ = await run(r, TurnRequest(prompt_text="hello", max_tokens=2))  # no session: nothing to record
    after = scrape()
    assert events[-1].kv.record == "record_refused" and "at most" in events[-1].kv.record_error
    assert recorded.kv.record == "unrecorded" and not recorded.kv.record_error
    assert delta(before, after, "kvshuttle_turn_records_total", outcome="record_refused") == 1
    assert delta(before, after, "kvshuttle_turn_records_total", outcome="unrecorded") == 1


def test_the_gateway_endpoint_serves_only_the_gateway_s_metrics():
    exposed = {name for name, _ in scrape()}
    assert any(n.startswith("kvshuttle_turns") for n in exposed)
    assert not any(n.startswith(("kvshuttle_plans", "kvshuttle_etcd", "kvshuttle_live")) for n in exposed)
    assert "process_resident_memory_bytes" in exposed
    assert not any(n.endswith("_created") for n in exposed)
