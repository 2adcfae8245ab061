"""One trace per turn across every process of the real stack, exported over OTLP to the in-test receiver: the
gateway's spans, the scheduler's and the registry's (trace context over gRPC), and vLLM's own ``llm_request`` spans
on P and D (the workers run vLLM with --otlp-traces-endpoint; the gateway's calls carry ``traceparent``)."""

from __future__ import annotations

import grpc
import httpx
import pytest
from kvshuttle.services.commands.trace_view import render_tree
from kvshuttle.v1 import gateway_pb2, gateway_pb2_grpc

from tests.support.e2e import new_session, user_turn
from tests.support.traces import child, children, in_trace, one, rpc_hop

pytestmark = pytest.mark.e2e
SYSTEM = {"role": "system", "content": "You are terse."}
ENGINE = "vllm.grpc.engine.VllmEngine"
CLIENT_TRACE, CLIENT_SPAN = "5bf92f3577b34da6a3ce929d0e0e4737", "10f067aa0ba902b8"


def complete(spans: list[dict], response_id: str) -> bool:
    """The turn's trace has arrived from every process: the gateway, scheduler, registry, and vLLM on P and D."""
    turns = [s for s in spans if s["name"] == "kvshuttle.turn" and s["attributes"].get("gen_ai.response.id")
             == response_id]
    if not turns:
        return False
    names = {(s["service"], s["name"]) for s in in_trace(spans, turns[0]["trace_id"])}
    return {("kvshuttle-scheduler", "scheduler.plan_turn"), ("kvshuttle-registry", "registry.record_turn"),
            ("vllm-prefill", "llm_request"), ("vllm-decode", "llm_request")} <= names


def check_engine_span(spans: list[dict], turn: dict, hop: str, request_id: str, address: str) -> dict:
    """P's or D's call: the gateway's client span, and vLLM's own span for the request under it."""
    call = child(spans, child(spans, turn, hop), f"/{ENGINE}/Generate")
    assert call["kind"] == "client" and call["attributes"]["rpc.method"] == "Generate", call
    assert f"{call['attributes']['server.address']}:{call['attributes']['server.port']}" == address
    engine = child(spans, call, "llm_request")
    assert engine["service"] == f"vllm-{hop}" and engine["kind"] == "server"
    assert engine["attributes"]["gen_ai.request.id"] == request_id, engine["attributes"]
    return engine


async def test_each_turn_is_one_trace_through_every_process(stack, otlp):
    session = new_session("traced")
    messages, answers = [SYSTEM, user_turn(5)], []
    async with httpx.AsyncClient(base_url=stack.base_url, timeout=300) as client:
        for n in range(3):
            headers = {"X-Session-ID": session}
            if n == 0:
                headers["traceparent"] = f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"
            resp = await client.post("/v1/chat/completions", headers=headers,
                                     json={"messages": messages, "max_tokens": 8, "temperature": 0})
            assert resp.status_code == 200, resp.text
            answers.append(resp.json())
            messages += [{"role": "assistant", "content": resp.json()["choices"][0]["message"]["content"]},
                         user_turn(6 + n)]
    spans = await otlp.wait_for(lambda spans: all(complete(spans, a["id"]) for a in answers), timeout_s=60)
    p, d = (next(w.grpc_address for w in stack.workers if w.worker_id == plan) for plan in
            (answers[0]["kvshuttle"]["prefill_worker"], answers[0]["kvshuttle"]["decode_worker"]))

    traces = set()
    for n, answer in enumerate(answers):
        turn = one(spans, "kvshuttle.turn", **{"gen_ai.response.id": answer["id"]})
        trace = in_trace(spans, turn["trace_id"])
        print(render_tree(trace))
        traces.add(turn["trace_id"])
        kv, attrs = answer["kvshuttle"], turn["attributes"]
        assert attrs["kvshuttle.turn_index"] == n + 1 and attrs["kvshuttle.decision"] == kv["decision"]
        assert attrs["kvshuttle.pulled_tokens"] == kv["pulled_tokens"] and attrs["kvshuttle.pulled_kv_bytes"] == (
            kv["pulled_tokens"] * 4096)
        assert attrs["gen_ai.usage.input_tokens"] == answer["usage"]["prompt_tokens"]
        assert attrs["gen_ai.usage.output_tokens"] == answer["usage"]["completion_tokens"] == 8
        http = next(s for s in trace if s["span_id"] == turn["parent_id"])
        assert http["name"] == "POST /v1/chat/completions" and http["service"] == "kvshuttle-gateway"
        if n == 0:  # the client's traceparent is continued
            assert turn["trace_id"] == CLIENT_TRACE and http["parent_id"] == CLIENT_SPAN
        planned = rpc_hop(trace, child(trace, turn, "plan"), "kvshuttle.v1.TransferScheduler", "PlanTurn",
                          stack.scheduler_address)
        assert planned["service"] == "kvshuttle-scheduler"
        assert child(trace, planned, "scheduler.plan_turn")["attributes"]["kvshuttle.decision"] == kv["decision"]
        recorded = rpc_hop(trace, child(trace, turn, "record"), "kvshuttle.v1.SessionRegistry", "RecordTurn",
                           stack.registry_address)
        assert recorded["service"] == "kvshuttle-registry" and child(trace, recorded, "registry.record_turn")
        prefill = check_engine_span(trace, turn, "prefill", f"{answer['id']}-p", p)
        assert prefill["attributes"]["gen_ai.usage.prompt_tokens"] == answer["usage"]["prompt_tokens"]
        check_engine_span(trace, turn, "decode", f"{answer['id']}-d", d)
    assert len(traces) == 3
    assert [a["kvshuttle"]["decision"] for a in answers] == ["recompute", "pull", "pull"]


async def test_a_grpc_callers_trace_context_is_continued(stack, otlp):
    trace_id, parent = "6bf92f3577b34da6a3ce929d0e0e4738", "20f067aa0ba902b9"
    request = gateway_pb2.ChatCompleteRequest(session_id=new_session("traced-grpc"),
                                              messages=[gateway_pb2.ChatMessage(**SYSTEM),
                                                        gateway_pb2.ChatMessage(**user_turn(2))],
                                              sampling=gateway_pb2.SamplingOptions(max_tokens=4))
    async with grpc.aio.insecure_channel(stack.gateway_grpc) as channel:
        reply = await gateway_pb2_grpc.GatewayStub(channel).ChatComplete(
            request, metadata=(("traceparent", f"00-{trace_id}-{parent}-01"),), timeout=300)
    spans = await otlp.wait_for(lambda spans: complete(spans, reply.id), timeout_s=60)
    turn = one(spans, "kvshuttle.turn", **{"gen_ai.response.id": reply.id})
    server = next(s for s in spans if s["span_id"] == turn["parent_id"])
    assert turn["trace_id"] == trace_id and server["parent_id"] == parent
    assert server["name"] == "/kvshuttle.v1.Gateway/ChatComplete" and server["kind"] == "server"
    assert {s["name"] for s in children(spans, turn)} >= {"plan", "prefill", "decode", "record"}
