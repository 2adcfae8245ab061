"""Metrics on the real stack: a pull turn moves the gateway's turn, token and TTFT metrics by exactly what the
response reports, the scheduler's plans and the registry's calls with it, and the prefill worker's endpoint serves
vLLM's own counters (the tokens it pulled over NIXL match)."""

from __future__ import annotations

import httpx
import pytest

from tests.support.e2e import chat, flush_prefill, new_session, user_turn
from tests.support.metrics import delta, scrape

pytestmark = pytest.mark.e2e


CONTROL_PLANE = ("gateway", "registry", "scheduler")


async def scrape_workers(stack) -> dict:
    """The endpoints of the workers still running (other e2e tests start and stop extra workers on the shared stack;
    their endpoints stay listed in ``stack.metrics``)."""
    out = {}
    for name, url in stack.metrics.items():
        if name not in CONTROL_PLANE:
            try:
                out[name] = await scrape(url)
            except httpx.TransportError:
                pass
    return out


async def scrape_all(stack) -> dict:
    return {**{name: await scrape(stack.metrics[name]) for name in CONTROL_PLANE}, **await scrape_workers(stack)}


async def test_a_pull_turn_moves_the_metrics_by_what_the_turn_reports(stack):
    session = new_session("metrics")
    messages = [{"role": "system", "content": "You are a careful coding agent."}, user_turn(0)]
    async with httpx.AsyncClient(base_url=stack.base_url, timeout=300) as client:
        before = await scrape_all(stack)
        first = (await chat(client, session, messages)).json()
        middle = await scrape_all(stack)
        messages += [first["choices"][0]["message"], user_turn(1)]
        await flush_prefill(stack)  # P holds no history of its own: what it does not compute comes over NIXL
        middle.update(await scrape_workers(stack))
        resp = await chat(client, session, messages)
        after = await scrape_all(stack)
    prefill = resp.json()["kvshuttle"]["prefill_worker"]  # the stack names each worker's endpoint by its id

    kv = first["kvshuttle"]
    assert (kv["decision"], kv["reason_code"]) == ("recompute", "no_record")
    gw0, gw1, gw2 = before["gateway"], middle["gateway"], after["gateway"]
    assert delta(gw0, gw1, "kvshuttle_turns_total", decision="recompute", reason="no_record") == 1
    assert delta(gw0, gw1, "kvshuttle_ttft_seconds_count", decision="recompute") == 1

    body = resp.json()
    kv, usage = body["kvshuttle"], body["usage"]
    assert kv["decision"] == "pull" and kv["pulled_tokens"] > 128, kv["reason"]
    assert resp.headers["X-KV-Reason-Code"] == kv["reason_code"] == "pull_all"
    assert delta(gw1, gw2, "kvshuttle_turns_total", decision="pull") == 1
    assert delta(gw1, gw2, "kvshuttle_turns_total", decision="pull", reason="pull_all") == 1
    assert delta(gw1, gw2, "kvshuttle_turns_total") == 1
    tokens = "kvshuttle_turn_tokens_total"
    assert delta(gw1, gw2, tokens, kind="pulled") == kv["pulled_tokens"]
    assert delta(gw1, gw2, tokens, kind="computed") == kv["computed_tokens"]
    assert delta(gw1, gw2, tokens, kind="prompt") == usage["prompt_tokens"]
    assert delta(gw1, gw2, tokens, kind="generated") == usage["completion_tokens"]
    assert delta(gw1, gw2, "kvshuttle_ttft_seconds_count", decision="pull") == 1
    assert delta(gw1, gw2, "kvshuttle_ttft_seconds_count") == 1
    assert delta(gw1, gw2, "kvshuttle_ttft_seconds_sum", decision="pull") == pytest.approx(
        kv["timings_ms"]["ttft_ms"] / 1000, abs=1e-6)
    assert delta(gw1, gw2, "kvshuttle_turn_failures_total") == 0
    assert delta(gw1, gw2, "kvshuttle_kv_pulled_bytes_total") > 0  # estimated from the model's config

    sched = "scheduler"
    assert delta(middle[sched], after[sched], "kvshuttle_plans_total", decision="pull", reason="pull_all") == 1
    assert delta(middle[sched], after[sched], "kvshuttle_plan_seconds_count", decision="pull") == 1
    assert delta(middle[sched], after[sched], "kvshuttle_etcd_request_seconds_count", op="claim_session") == 1
    assert delta(middle["registry"], after["registry"], "kvshuttle_grpc_server_handled_total", method="RecordTurn",
                 code="OK") == 1
    # The prefill worker's endpoint serves vLLM's own counters: the tokens it pulled over NIXL are the turn's.
    assert delta(middle[prefill], after[prefill], "vllm:prompt_tokens_by_source_total",
                 source="external_kv_transfer") == kv["pulled_tokens"]
    assert delta(middle[prefill], after[prefill], "kvshuttle_worker_registered") == 0
    assert after[prefill][("kvshuttle_worker_registered", frozenset())] == 1
