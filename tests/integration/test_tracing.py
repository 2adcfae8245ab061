"""One trace per turn, on real services in one traced process (gateway, scheduler, registry on real etcd; two fake
vLLM engines): the span tree every turn makes, its attributes, the caller's trace context continued (HTTP header and
gRPC metadata) and passed on to the engines, and failures recorded with their status.

The turns run in a subprocess (tests/support/traced_stack.py: the tracer provider is process-wide); their spans
come back as JSON. Across real processes and vLLM: tests/e2e/test_tracing.py.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest
from kvshuttle.services.commands.trace_view import render_tree

from tests.support.traces import child, children, in_trace, one, rpc_hop

ROOT = Path(__file__).resolve().parents[2]
ENGINE = "vllm.grpc.engine.VllmEngine"
pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def traced(etcd, model_dir) -> dict:
    done = subprocess.run([sys.executable, "-m", "tests.support.traced_stack", etcd, str(model_dir)], cwd=ROOT,
                          capture_output=True, text=True, timeout=150)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def turn_span(traced: dict, response_id: str) -> tuple[dict, list[dict]]:
    """The kvshuttle.turn span of the turn that answered ``response_id``, and every span of its trace."""
    turn = one(traced["spans"], "kvshuttle.turn", **{"gen_ai.response.id": response_id})
    return turn, in_trace(traced["spans"], turn["trace_id"])


def test_a_three_turn_conversation_is_three_traces_with_the_whole_tree(traced):
    turns = [turn_span(traced, t["id"]) for t in traced["http"]]
    assert len({turn["trace_id"] for turn, _ in turns}) == 3  # one trace per turn
    assert [t["decision"] for t in traced["http"]] == ["recompute", "pull", "pull"]
    for (turn, spans), answer in zip(turns, traced["http"], strict=True):
        print(render_tree(spans))
        http = next(s for s in spans if s["span_id"] == turn["parent_id"])
        assert http["name"] == "POST /v1/chat/completions" and http["kind"] == "server"
        assert http["attributes"]["http.response.status_code"] == 200
        assert {s["name"] for s in children(spans, turn)} >= {"plan", "prefill", "decode", "record"}
        planned = rpc_hop(spans, child(spans, turn, "plan"), "kvshuttle.v1.TransferScheduler", "PlanTurn")
        plan = child(spans, planned, "scheduler.plan_turn")
        assert plan["attributes"]["kvshuttle.decision"] == answer["decision"]
        if answer["decision"] == "pull":  # the claim: scheduler -> registry, in the same trace
            rpc_hop(spans, plan, "kvshuttle.v1.SessionRegistry", "ClaimSession")
        recorded = rpc_hop(spans, child(spans, turn, "record"), "kvshuttle.v1.SessionRegistry", "RecordTurn")
        child(spans, recorded, "registry.record_turn")
        for hop, address, suffix in (("prefill", traced["prefill_address"], "p"),
                                     ("decode", traced["decode_address"], "d")):
            call = rpc_hop(spans, child(spans, turn, hop), ENGINE, "Generate", address)
            # the engine got this client span's context in its metadata: vLLM's own span would be its child
            sent = traced["engine_metadata"][f"{answer['id']}-{suffix}"]["traceparent"]
            assert sent.split("-")[1:3] == [turn["trace_id"], call["span_id"]], (hop, sent)
        assert all(s["status_code"] != "error" for s in spans if s["name"] != "/kvshuttle.v1.SessionRegistry/GetSession")


def test_the_turn_span_says_what_happened(traced):
    for n, answer in enumerate(traced["http"]):
        attrs = turn_span(traced, answer["id"])[0]["attributes"]
        kv = answer["kvshuttle"]
        assert attrs["kvshuttle.turn_index"] == n + 1 and attrs["kvshuttle.tenant"] == "default"
        assert attrs["kvshuttle.session"] == hashlib.sha256(traced["session"].encode()).hexdigest()[:16]
        assert attrs["kvshuttle.decision"] == kv["decision"] and attrs["kvshuttle.reason"] == kv["reason"]
        assert attrs["kvshuttle.reason_code"] == kv["reason_code"]
        assert attrs["kvshuttle.pulled_tokens"] == kv["pulled_tokens"]
        assert attrs["kvshuttle.computed_tokens"] == kv["computed_tokens"]
        assert attrs["kvshuttle.pulled_kv_bytes"] == kv["pulled_tokens"] * 4096  # the tiny model: 4 KiB a token
        assert attrs["kvshuttle.reusable_tokens"] == kv["pulled_tokens"]  # the threshold policy pulls all it can
        assert attrs["kvshuttle.prefill_worker"] == kv["prefill_worker"] == "p-traced"
        assert attrs["kvshuttle.decode_worker"] == kv["decode_worker"] == "d-traced"
        assert attrs["kvshuttle.predicted_ttft_ms"] > 0 and attrs["kvshuttle.policy"] == "threshold"
        assert attrs["kvshuttle.ttft_ms"] == kv["timings_ms"]["ttft_ms"] > 0
        assert attrs["kvshuttle.prefill_ms"] == kv["timings_ms"]["prefill_ms"]
        # the gateway's time from the request's arrival to the turn's start (body, input check, key, limits)
        assert 0 < kv["timings_ms"]["request_ms"] < 5000
        assert attrs["gen_ai.operation.name"] == "chat" and attrs["gen_ai.request.model"] == "tiny"
        assert attrs["gen_ai.request.max_tokens"] == 6 and attrs["gen_ai.usage.output_tokens"] == 6
        assert attrs["gen_ai.response.finish_reasons"] == ["length"]
        assert attrs["gen_ai.usage.input_tokens"] == attrs["kvshuttle.prompt_tokens"]
        if answer["usage"]:
            assert attrs["gen_ai.usage.input_tokens"] == answer["usage"]["prompt_tokens"]
    assert traced["http"][1]["kvshuttle"]["pulled_tokens"] > 0


def test_session_ids_stay_out_of_every_span(traced):
    assert traced["session"] not in json.dumps(traced["spans"])


def test_the_http_callers_traceparent_is_continued(traced):
    turn, spans = turn_span(traced, traced["http"][0]["id"])
    trace_id, parent = traced["http_parent"]
    http = next(s for s in spans if s["span_id"] == turn["parent_id"])
    assert turn["trace_id"] == trace_id and http["parent_id"] == parent
    attrs = http["attributes"]
    assert attrs["http.request.method"] == "POST" and attrs["http.route"] == attrs["url.path"] == "/v1/chat/completions"
    assert attrs["url.scheme"] == "http" and attrs["server.port"] > 0


def test_the_grpc_callers_metadata_is_continued(traced):
    turn, spans = turn_span(traced, traced["grpc"]["id"])
    trace_id, parent = traced["grpc_parent"]
    server = next(s for s in spans if s["span_id"] == turn["parent_id"])
    assert turn["trace_id"] == trace_id and server["parent_id"] == parent
    assert server["name"] == "/kvshuttle.v1.Gateway/ChatComplete" and server["kind"] == "server"
    assert turn["attributes"]["kvshuttle.prompt_tokens"] == traced["grpc"]["prompt_tokens"]
    assert {s["name"] for s in children(spans, turn)} >= {"plan", "prefill", "decode", "record"}


def test_failures_are_recorded_with_their_status(traced):
    assert traced["errors"] == {"refused": 400, "failed": 503}
    spans = traced["spans"]
    refused = one(spans, "kvshuttle.turn", **{"gen_ai.request.max_tokens": 100000})
    http = next(s for s in spans if s["span_id"] == refused["parent_id"])
    # the caller's mistake: recorded, but not an error of the service
    assert refused["status_code"] == "unset" and refused["attributes"]["error.type"] == "INVALID_ARGUMENT"
    assert [e["name"] for e in refused["events"]] == ["exception"]
    assert http["attributes"]["http.response.status_code"] == 400 and http["status_code"] == "unset"

    failed = one(spans, "kvshuttle.turn", **{"gen_ai.request.max_tokens": 2, "kvshuttle.prompt_tokens": 11})
    trace = in_trace(spans, failed["trace_id"])
    http = next(s for s in trace if s["span_id"] == failed["parent_id"])
    assert failed["status_code"] == "error" and "no live prefill worker" in failed["status"]
    assert failed["attributes"]["error.type"] == "UNAVAILABLE"
    assert {e["name"] for e in failed["events"]} == {"worker_failed", "exception"}
    assert http["status_code"] == "error" and http["attributes"]["http.response.status_code"] == 503
    prefill = child(trace, failed, "prefill")
    call = child(trace, prefill, f"/{ENGINE}/Generate")
    assert prefill["status_code"] == call["status_code"] == "error"
    assert call["attributes"]["rpc.grpc.status_code"] == 14  # UNAVAILABLE
