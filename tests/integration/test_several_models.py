"""Several models behind one gateway (issue #37, docs/models.md): each request runs on its model's workers, each
model's conversations are found and pulled within that model only, and the same history sent to another model is
a new session that pulls nothing. Real registry, scheduler and gateway on loopback (their gRPC and HTTP APIs), fake
engines (vLLM's gRPC API); the tiny model's tokenizer served under three names: two alike (so that the same chat is
the same text, and only the model keeps their sessions apart) and one with a template of its own."""

from __future__ import annotations

import contextlib
import json
import uuid

import grpc
import httpx
import pytest
from kvshuttle.services.common.grpc_server import client_channel
from kvshuttle.services.gateway.edge import auth
from kvshuttle.services.gateway.server import GatewayConfig, GatewayService
from kvshuttle.services.registry.server import RegistryConfig, serve
from kvshuttle.services.scheduler.server import SchedulerConfig, SchedulerService
from kvshuttle.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc, registry_pb2, registry_pb2_grpc

from tests.support.fake_engine import FakeEngineServer
from tests.support.traced_stack import stop_all
from tests.support.waits import until

MODELS = ("tiny", "tiny-b")  # alike: one chat is one text for both
# tiny-t renders chats in its own way (as another model family would): the same messages are another text
TEMPLATE_B = ("{% for m in messages %}[{{ m.role }}] {{ m.content }}<|im_end|>\n{% endfor %}"
              "{% if add_generation_prompt %}[assistant] {% endif %}")


async def _pair(registry_address: str, model: str) -> tuple[FakeEngineServer, FakeEngineServer]:
    p, d = FakeEngineServer(), FakeEngineServer(handle={"remote_engine_id": f"engine-d-{model}",
                                                        "remote_host": "127.0.0.1"})
    for engine in (p, d):
        await engine.start()
    d.engine.handle["remote_port"] = d.port + 1
    async with client_channel(registry_address) as channel:
        stub = registry_pb2_grpc.SessionRegistryStub(channel)
        for role, server, name in ((common_pb2.WORKER_ROLE_PREFILL, p, f"p-{model}"),
                                   (common_pb2.WORKER_ROLE_DECODE, d, f"d-{model}")):
            await stub.RegisterWorker(registry_pb2.RegisterWorkerRequest(worker=common_pb2.Worker(
                worker_id=name, role=role, engine_id=f"engine-{name}", grpc_address=server.address,
                nixl_host="127.0.0.1", nixl_port=server.port + 1, block_size=16, kv_blocks_ttl_s=480, model=model),
                lease_ttl_s=60))
    return p, d


def _pulls(p: FakeEngineServer) -> int:
    """How many of P's prefills were sent a pull (kv_transfer_params naming a decode worker's KV)."""
    return sum(bool(json.loads(r.kv_transfer_params_json).get("remote_block_ids"))
               for r in p.engine.requests if r.HasField("kv_transfer_params_json"))


@contextlib.asynccontextmanager
async def three_models(etcd: str, model_dir, tmp_path, **gateway: str):
    """Registry, scheduler, a fake pair per model and one gateway serving tiny, tiny-b and tiny-t (``gateway``: more
    of its settings): the gateway, the pairs by model, the scheduler."""
    prefix = f"/models-{uuid.uuid4().hex[:6]}/"
    registry = await serve(RegistryConfig(listen="127.0.0.1:0", etcd_endpoints=etcd, key_prefix=prefix))
    scheduler = SchedulerService(SchedulerConfig(listen="127.0.0.1:0", registry=registry.address, key_prefix=prefix,
                                                 load_poll_interval_s=0, policy="threshold"))
    await scheduler.start()
    pairs = {model: await _pair(registry.address, model) for model in (*MODELS, "tiny-t")}
    await until(lambda: len(scheduler.workers.by_role(common_pb2.WORKER_ROLE_DECODE)) == 3,
                what="the scheduler's view of every worker")
    template = tmp_path / "b.jinja"
    template.write_text(TEMPLATE_B)
    service = GatewayService(GatewayConfig(http_listen="127.0.0.1:0", grpc_listen="127.0.0.1:0",
                                           registry=registry.address, scheduler=scheduler.address,
                                           model_dir=str(model_dir), served_model_name="tiny", max_model_len=2048,
                                           models=f"tiny-b={model_dir}?max_model_len=2048,"
                                                  f"tiny-t={model_dir}?chat_template={template}&max_model_len=1024",
                                           **gateway))
    await service.start()
    try:
        yield service, pairs, scheduler
    finally:
        await stop_all(service, scheduler, registry, [e for pair in pairs.values() for e in pair])


async def test_two_models_behind_one_gateway_keep_their_sessions_and_kv_apart(etcd, model_dir, tmp_path):
    async with three_models(etcd, model_dir, tmp_path) as (gateway, pairs, scheduler):
        async with httpx.AsyncClient(base_url=f"http://{gateway.http_address}", timeout=30) as client:
            listed = (await client.get("/v1/models")).json()["data"]
            assert [(m["id"], m["max_model_len"], m["parent"]) for m in listed] == [
                ("tiny", 2048, None), ("tiny-b", 2048, None), ("tiny-t", 1024, None)]

            async def turn(model: str, messages: list[dict]) -> httpx.Response:
                resp = await client.post("/v1/chat/completions", json={
                    "model": model, "messages": messages, "max_tokens": 4})
                assert resp.status_code == 200, resp.text
                assert resp.json()["model"] == model
                return resp

            messages = [{"role": "user", "content": "Tell me about the weather in Paris today, please."}]
            sessions = {}
            for model in MODELS:
                # no session id: each model's second turn is found in its own session and pulled on its own workers;
                # the two models' chats are the same text, so without the model tiny-b's would find tiny's session
                p, d = pairs[model]
                first = await turn(model, messages)
                assert first.headers["x-session-source"] == "new" and first.headers["x-kv-decision"] == "recompute"
                pulls = _pulls(p)
                answer = first.json()["choices"][0]["message"]["content"]
                history = [*messages, {"role": "assistant", "content": answer}, {"role": "user", "content": "More?"}]
                second = await turn(model, history)
                assert second.headers["x-session-source"] == "found", second.headers
                assert second.headers["x-session-id"] == first.headers["x-session-id"]
                assert second.headers["x-kv-decision"] == "pull", second.headers["x-kv-reason"]
                assert _pulls(p) == pulls + 1
                sessions[model] = (first.headers["x-session-id"], history)
            assert sessions["tiny"][1] == sessions["tiny-b"][1] and sessions["tiny"][0] != sessions["tiny-b"][0]
            # tiny's session id sent to tiny-b: none of its ids are continued, none of its KV reused (nor read by
            # tiny-b's P to free it, as a recompute frees the unused KV of its own model's sessions)
            session, history = sessions["tiny"]
            p_b = pairs["tiny-b"][0]
            pulls = _pulls(p_b)
            named = await client.post("/v1/chat/completions", headers={"X-Session-ID": session},
                                      json={"model": "tiny-b", "messages": history, "max_tokens": 4})
            assert named.status_code == 200 and named.headers["x-kv-decision"] == "recompute"
            assert named.headers["x-kv-reason-code"] == "other_model" and _pulls(p_b) == pulls
            # the same history sent to a model that has not seen it: a new session that pulls nothing
            p_t = pairs["tiny-t"][0]
            crossed = await turn("tiny-t", history)
            assert crossed.headers["x-session-source"] == "new" and _pulls(p_t) == 0
            # tiny-t renders with its own template: the same messages are another prompt
            usage = [(await turn(m, messages)).json()["usage"]["prompt_tokens"] for m in ("tiny", "tiny-t")]
            assert usage[0] != usage[1], usage

            unknown = await client.post("/v1/chat/completions", json={"model": "tiny-c", "messages": messages})
            assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "model_not_found"
            assert "'tiny', 'tiny-b', 'tiny-t'" in unknown.json()["error"]["message"]

        async with client_channel(gateway.grpc_address) as channel:  # the gRPC API routes by model too
            stub = gateway_pb2_grpc.GatewayStub(channel)
            asked = len(p_b.engine.requests)
            got = await stub.ChatComplete(gateway_pb2.ChatCompleteRequest(
                model="tiny-b", messages=[gateway_pb2.ChatMessage(role="user", content="hi")],
                sampling=gateway_pb2.SamplingOptions(max_tokens=2)))
            assert got.model == "tiny-b" and len(p_b.engine.requests) == asked + 1
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.ChatComplete(gateway_pb2.ChatCompleteRequest(
                    model="tiny-c", messages=[gateway_pb2.ChatMessage(role="user", content="hi")]))
            assert err.value.code() == grpc.StatusCode.NOT_FOUND


async def test_a_key_uses_only_the_models_the_keys_file_gives_it(etcd, model_dir, tmp_path):
    """The keys file's ``models`` (issue #37): a key limited to tiny-b sees only tiny-b in /v1/models, gets it when it
    names no model, and gets 404 model_not_found for the others, as if they were not served (the message names only
    its own); a key without the field uses every model. Over HTTP and gRPC."""
    keys = tmp_path / "keys.json"
    keys.write_text(json.dumps({"keys": [auth.entry("kvs-b-only-1", "acme", models=["tiny-b"]),
                                         auth.entry("kvs-every-1", "globex")]}))
    async with three_models(etcd, model_dir, tmp_path, api_keys_file=str(keys)) as (gateway, pairs, scheduler):
        only_b, every = ({"Authorization": f"Bearer {k}"} for k in ("kvs-b-only-1", "kvs-every-1"))
        async with httpx.AsyncClient(base_url=f"http://{gateway.http_address}", timeout=30) as client:
            listed = {name: [m["id"] for m in (await client.get("/v1/models", headers=h)).json()["data"]]
                      for name, h in (("only_b", only_b), ("every", every))}
            assert listed == {"only_b": ["tiny-b"], "every": ["tiny", "tiny-b", "tiny-t"]}
            hi = [{"role": "user", "content": "hi"}]
            for model in ("tiny", "tiny-t", "tiny-c"):
                refused = await client.post("/v1/chat/completions", headers=only_b,
                                            json={"model": model, "messages": hi, "max_tokens": 2})
                assert refused.status_code == 404 and refused.json()["error"]["code"] == "model_not_found"
                message = refused.json()["error"]["message"]
                assert "serves 'tiny-b'" in message and "'tiny'," not in message and "tiny-t" not in message.replace(
                    f"'{model}' does not exist", "")
            default = await client.post("/v1/chat/completions", headers=only_b, json={"messages": hi, "max_tokens": 2})
            assert default.status_code == 200 and default.json()["model"] == "tiny-b"
            anthropic = await client.post("/v1/messages", headers=only_b, json={
                "model": "tiny", "messages": hi, "max_tokens": 2})
            assert anthropic.status_code == 404 and anthropic.json()["error"]["type"] == "not_found_error"
            for model in ("tiny", "tiny-t"):
                allowed = await client.post("/v1/chat/completions", headers=every,
                                            json={"model": model, "messages": hi, "max_tokens": 2})
                assert allowed.status_code == 200, allowed.text
        async with client_channel(gateway.grpc_address) as channel:
            stub = gateway_pb2_grpc.GatewayStub(channel)
            request = gateway_pb2.ChatCompleteRequest(model="tiny", messages=[gateway_pb2.ChatMessage(
                role="user", content="hi")], sampling=gateway_pb2.SamplingOptions(max_tokens=2))
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.ChatComplete(request, metadata=(("authorization", "Bearer kvs-b-only-1"),))
            assert err.value.code() == grpc.StatusCode.NOT_FOUND
            got = await stub.ChatComplete(request, metadata=(("authorization", "Bearer kvs-every-1"),))
            assert got.model == "tiny"


async def _register_adapters(registry_address: str, model: str, pair, *names: str) -> None:
    """``model``'s pair registers again, now serving the adapters ``names`` (as an agent does when its
    --lora-modules-file changes)."""
    async with client_channel(registry_address) as channel:
        stub = registry_pb2_grpc.SessionRegistryStub(channel)
        for role, server, name in ((common_pb2.WORKER_ROLE_PREFILL, pair[0], f"p-{model}"),
                                   (common_pb2.WORKER_ROLE_DECODE, pair[1], f"d-{model}")):
            await stub.RegisterWorker(registry_pb2.RegisterWorkerRequest(worker=common_pb2.Worker(
                worker_id=name, role=role, engine_id=f"engine-{name}", grpc_address=server.address,
                nixl_host="127.0.0.1", nixl_port=server.port + 1, block_size=16, kv_blocks_ttl_s=480, model=model,
                adapters=[common_pb2.LoraAdapter(name=n, id=i + 1, path=f"/adapters/{n}")
                          for i, n in enumerate(names)]), lease_ttl_s=60))


async def test_an_adapter_a_worker_registers_is_served_and_keeps_its_sessions_apart(etcd, model_dir, tmp_path):
    """Issue #37: tiny-b's workers register the adapter ``sql-lora`` while the gateway runs: it is listed with its
    parent and served on tiny-b's workers; both of a turn's engine calls name it (the plugin's call metadata), a
    base-model turn names none; its second turn is found in its own session and pulled; the same history sent to the
    base model is a new session; its outcomes teach the cost model about the base model's workers. Once no worker
    registers it, it is unknown again."""
    async with three_models(etcd, model_dir, tmp_path) as (gateway, pairs, scheduler):
        registry = gateway.cfg.registry
        p, d = pairs["tiny-b"]
        await _register_adapters(registry, "tiny-b", pairs["tiny-b"], "sql-lora")
        async with httpx.AsyncClient(base_url=f"http://{gateway.http_address}", timeout=30) as client:
            async def listed() -> list:
                return [(m["id"], m["parent"]) for m in (await client.get("/v1/models")).json()["data"]]

            await until(lambda: _has(listed, ("sql-lora", "tiny-b")), what="the adapter listed")
            assert (await listed())[-1] == ("sql-lora", "tiny-b")

            def adapters_sent(server: FakeEngineServer, since: int) -> list[str | None]:
                return [server.engine.metadata[r.request_id].get("kvshuttle-lora")
                        for r in server.engine.requests[since:]]

            messages = [{"role": "user", "content": "Write the query for last week's orders."}]
            asked_p, asked_d = len(p.engine.requests), len(d.engine.requests)
            first = await client.post("/v1/chat/completions", json={
                "model": "sql-lora", "messages": messages, "max_tokens": 4})
            assert first.status_code == 200 and first.json()["model"] == "sql-lora", first.text
            assert adapters_sent(p, asked_p) == ["sql-lora"] and adapters_sent(d, asked_d) == ["sql-lora"]
            history = [*messages, {"role": "assistant", "content": first.json()["choices"][0]["message"]["content"]},
                       {"role": "user", "content": "And by region?"}]
            pulls = _pulls(p)
            second = await client.post("/v1/chat/completions", json={
                "model": "sql-lora", "messages": history, "max_tokens": 4})
            assert (second.headers["x-session-source"], second.headers["x-session-id"], second.headers[
                "x-kv-decision"]) == ("found", first.headers["x-session-id"], "pull"), second.headers
            assert _pulls(p) == pulls + 1
            asked_p = len(p.engine.requests)
            base = await client.post("/v1/chat/completions", json={
                "model": "tiny-b", "messages": history, "max_tokens": 4})
            assert base.headers["x-session-source"] == "new" and base.headers["x-kv-decision"] == "recompute"
            assert adapters_sent(p, asked_p) == [None] and _pulls(p) == pulls + 1
            # the adapter's turns were learned as tiny-b's (its base model's): no cost-model group of its own
            cost = scheduler.planner.model
            await until(lambda: cost.reference_worker_of("tiny-b") == "p-tiny-b", what="tiny-b's outcomes learned")
            assert cost.reference_worker_of("sql-lora") is None
            asked_p = len(p.engine.requests)
            async with client_channel(gateway.grpc_address) as channel:  # the gRPC API serves the adapter too
                got = await gateway_pb2_grpc.GatewayStub(channel).ChatComplete(gateway_pb2.ChatCompleteRequest(
                    model="sql-lora", messages=[gateway_pb2.ChatMessage(role="user", content="hi")],
                    sampling=gateway_pb2.SamplingOptions(max_tokens=2)), timeout=10)
            assert got.model == "sql-lora" and adapters_sent(p, asked_p) == ["sql-lora"]
            # ending the adapter's session frees its KV with a one-block read on tiny-b's P under the adapter (P
            # caches the block it reads: under the base model, a base-model turn could hit the adapter's KV)
            asked_p = len(p.engine.requests)
            async with client_channel(gateway.grpc_address) as channel:
                ended = await gateway_pb2_grpc.GatewayStub(channel).EndSession(
                    gateway_pb2.EndSessionRequest(session_id=first.headers["x-session-id"]), timeout=10)
            assert ended.kv_released, ended
            assert adapters_sent(p, asked_p) == ["sql-lora"]
            await _register_adapters(registry, "tiny-b", pairs["tiny-b"])  # unloaded everywhere
            await until(lambda: _lacks(listed, ("sql-lora", "tiny-b")), what="the adapter gone")
            gone = await client.post("/v1/chat/completions", json={
                "model": "sql-lora", "messages": messages, "max_tokens": 4})
            assert gone.status_code == 404 and gone.json()["error"]["code"] == "model_not_found"


async def _has(listed, entry) -> bool:
    return entry in await listed()


async def _lacks(listed, entry) -> bool:
    return entry not in await listed()
