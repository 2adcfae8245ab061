"""Stored Responses API conversations as chains (issue #27) through a real registry, etcd and history store: each
response keeps only its turn's items (in the history store) and a small etcd index entry linked to the previous
response; a conversation is read back along the links, bounded; it expires as a whole after its last response; a
deleted response breaks it by name; no tenant reads another's. And the numbers: etcd bytes per stored response at
turns 1, 100 and 1,000 of one conversation (flat), and the time to continue from turn 1,000 through the gateway."""

from __future__ import annotations

import asyncio
import json
import sqlite3
import statistics
import time
from collections.abc import AsyncIterator

import grpc
import httpx
import pytest
from kvshuttle.services.common.grpc_server import client_channel
from kvshuttle.services.gateway.apis.http_app import create_app
from kvshuttle.services.gateway.apis.responses.routes import add_responses_routes
from kvshuttle.services.registry.server import RegistryConfig, serve
from kvshuttle.services.store.etcd_store import EtcdStore
from kvshuttle.v1 import registry_pb2, registry_pb2_grpc

from tests.support.auth import open_guard
from tests.support.registry import TENANT, uid
from tests.support.turn_fakes import AnsweringRunner

pytestmark = pytest.mark.timeout(300)
CHAIN = dict(max_responses=10_000, max_bytes=3 << 20)
OPEN_TENANT = "default"  # an open gateway's (tests.support.auth.open_guard)


def rid(kind: str = "r") -> str:
    return "resp_" + uid(kind).replace("-", "").replace("_", "")[:60]


def body(response_id: str, previous: str, n: int) -> bytes:
    """A body as the gateway writes it: the response object and the turn's items (a tool result in, a call out)."""
    output = [{"type": "function_call", "id": f"fc_{n}", "call_id": f"call_{n}", "name": "read_file",
               "arguments": json.dumps({"path": f"src/module_{n}.py"}), "status": "completed"}]
    response = {"id": response_id, "object": "response", "created_at": 1764800000 + n, "status": "completed",
                "model": "agent", "output": output, "previous_response_id": previous or None, "instructions": None,
                "tools": [], "tool_choice": "auto", "parallel_tool_calls": True, "temperature": 1.0, "top_p": 1.0,
                "max_output_tokens": None, "store": True, "text": {"format": {"type": "text"}},
                "usage": {"input_tokens": 40 * n, "output_tokens": 20, "total_tokens": 40 * n + 20}}
    given = ({"type": "function_call_output", "call_id": f"call_{n - 1}", "output": "x = 1\n" * 40} if n > 1
             else {"type": "message", "role": "user", "content": "Fix the failing test in src/."})
    items = [given,
             {"type": "function_call", "call_id": f"call_{n}", "name": "read_file",
              "arguments": json.dumps({"path": f"src/module_{n}.py"})}]
    return json.dumps({"response": response, "items": items}).encode()


async def put(stub, response_id: str, previous: str = "", n: int = 1, tenant: str = TENANT,
              ttl_s: int = 600) -> registry_pb2.StoredResponse:
    return (await stub.PutResponse(registry_pb2.PutResponseRequest(response=registry_pb2.StoredResponse(
        response_id=response_id, tenant=tenant, session_id="s-1", previous_response_id=previous,
        body_json=body(response_id, previous, n)), ttl_s=ttl_s))).response


async def chain(stub, response_id: str, tenant: str = TENANT, **bounds) -> list[registry_pb2.StoredResponse]:
    return list((await stub.GetResponseChain(registry_pb2.GetResponseChainRequest(
        response_id=response_id, tenant=tenant, **{**CHAIN, **bounds}), timeout=30)).responses)


async def expect(call, code: grpc.StatusCode, *words: str) -> str:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await call
    assert err.value.code() == code, err.value.details()
    assert all(w in err.value.details() for w in words), err.value.details()
    return err.value.details()


async def test_each_response_keeps_its_own_items_linked_and_the_chain_comes_back_in_order(stub):
    ids = [rid() for _ in range(4)]
    entries = [await put(stub, ids[0])]
    for n in range(1, 4):
        entries.append(await put(stub, ids[n], ids[n - 1], n + 1))
    assert [(e.chain_id, e.chain_length) for e in entries] == [(ids[0], n + 1) for n in range(4)]
    assert all(e.body_in_history_store and not e.body_json for e in entries)
    assert entries[3].chain_bytes == sum(e.body_bytes for e in entries)
    got = await chain(stub, ids[3])
    assert [e.response_id for e in got] == ids
    assert [json.loads(e.body_json)["items"][1]["call_id"] for e in got] == ["call_1", "call_2", "call_3", "call_4"]
    one = (await stub.GetResponse(registry_pb2.GetResponseRequest(response_id=ids[2], tenant=TENANT))).response
    assert json.loads(one.body_json)["response"]["id"] == ids[2] and one.previous_response_id == ids[1]
    # A branch: another response continuing the second joins the conversation beside the third.
    branch = await put(stub, rid("b"), ids[1], 3)
    assert (branch.chain_id, branch.chain_length) == (ids[0], 3)
    assert [e.response_id for e in await chain(stub, branch.response_id)] == [*ids[:2], branch.response_id]
    assert [e.response_id for e in await chain(stub, ids[3])] == ids


async def test_bounds_are_checked_before_reading_and_bad_ones_refused(stub):
    first = rid()
    await put(stub, first)
    second = (await put(stub, rid(), first, 2)).response_id
    await expect(chain(stub, second, max_responses=1), grpc.StatusCode.OUT_OF_RANGE, "2 stored responses",
                 "at most 1")
    await expect(chain(stub, second, max_bytes=600), grpc.StatusCode.OUT_OF_RANGE, "at most 600")
    await expect(chain(stub, second, max_responses=0), grpc.StatusCode.INVALID_ARGUMENT, "max_responses")
    await expect(chain(stub, second, max_bytes=0), grpc.StatusCode.INVALID_ARGUMENT, "max_bytes")
    # More than one answer of the registry carries (4 MiB less 64 KiB by default) counts as that: still read.
    assert len(await chain(stub, second, max_bytes=1 << 40)) == 2
    await expect(chain(stub, rid("unknown")), grpc.StatusCode.NOT_FOUND, "no stored response")
    await expect(put(stub, rid(), rid("unknown")), grpc.StatusCode.NOT_FOUND, "previous response")
    me = rid()
    await expect(put(stub, me, me), grpc.StatusCode.INVALID_ARGUMENT, "continue itself")


async def test_a_deleted_response_breaks_its_conversation_by_name(stub):
    ids = [rid() for _ in range(3)]
    await put(stub, ids[0])
    await put(stub, ids[1], ids[0], 2)
    await put(stub, ids[2], ids[1], 3)
    assert (await stub.DeleteResponse(registry_pb2.DeleteResponseRequest(response_id=ids[1], tenant=TENANT))).deleted
    await expect(chain(stub, ids[2]), grpc.StatusCode.FAILED_PRECONDITION, ids[1], "gone")
    await expect(put(stub, rid(), ids[1], 3), grpc.StatusCode.NOT_FOUND, ids[1])
    # The others are still there, each on its own, and the first's conversation still reads back.
    assert (await stub.GetResponse(registry_pb2.GetResponseRequest(response_id=ids[2], tenant=TENANT))).response
    assert [e.response_id for e in await chain(stub, ids[0])] == ids[:1]
    # The first one deleted: its conversation cannot be read back either, by its name.
    assert (await stub.DeleteResponse(registry_pb2.DeleteResponseRequest(response_id=ids[0], tenant=TENANT))).deleted
    await expect(chain(stub, ids[2]), grpc.StatusCode.FAILED_PRECONDITION, ids[1])
    later = [rid() for _ in range(3)]
    await put(stub, later[0])
    await put(stub, later[1], later[0], 2)
    await put(stub, later[2], later[1], 3)
    await stub.DeleteResponse(registry_pb2.DeleteResponseRequest(response_id=later[0], tenant=TENANT))
    await expect(chain(stub, later[2]), grpc.StatusCode.FAILED_PRECONDITION, later[0], "gone")


async def test_an_entry_written_before_chains_still_reads_and_continues(stub, etcd):
    """An entry of the old layout (its whole conversation in its etcd body, a lease of its own) reads back as a
    chain of one, and a response continuing it starts a chain after it."""
    old = rid("old")
    items = [{"type": "message", "role": "user", "content": "hi"}, {"type": "message", "role": "assistant",
                                                                     "content": "hello"}]
    legacy = registry_pb2.StoredResponse(response_id=old, tenant=TENANT, session_id="s-1", body_json=json.dumps(
        {"response": {"id": old, "output": [{"id": "msg_1"}]}, "items": items}).encode())
    async with EtcdStore(etcd, "/kvshuttle/") as store:
        lease, ttl = await store.leases.grant(60)
        await store.responses.put(legacy, lease, ttl)
    got = await chain(stub, old)
    assert [e.response_id for e in got] == [old] and json.loads(got[0].body_json)["items"] == items
    new = await put(stub, rid(), old, 2)
    assert (new.chain_id, new.chain_length) == (old, 2)
    got = await chain(stub, new.response_id)
    assert [e.response_id for e in got] == [old, new.response_id] and got[0].body_json == legacy.body_json


async def test_no_tenant_reads_or_joins_another_tenants_conversation(stub):
    first = rid()
    await put(stub, first, tenant="tenant-a")
    second = (await put(stub, rid(), first, 2, tenant="tenant-a")).response_id
    for call in (chain(stub, second, tenant="tenant-b"),
                 stub.GetResponse(registry_pb2.GetResponseRequest(response_id=first, tenant="tenant-b")),
                 put(stub, rid(), second, 3, tenant="tenant-b")):
        await expect(call, grpc.StatusCode.NOT_FOUND)
    # The same response id in another tenant is another response, in another conversation.
    other = await put(stub, second, tenant="tenant-b")
    assert (other.chain_id, other.chain_length) == (second, 1)
    assert [e.response_id for e in await chain(stub, second, tenant="tenant-a")] == [first, second]
    assert json.loads((await chain(stub, second, tenant="tenant-b"))[0].body_json)["response"]["previous_response_id"] \
        is None


async def test_a_conversation_expires_as_a_whole_after_its_last_response(stub):
    """The rule: one lease per conversation, refreshed by each response stored in it. The first response outlives
    its own TTL while the conversation goes on; once nothing is stored for the TTL, all of it is gone."""
    first = rid()
    ttl = (await put(stub, first, ttl_s=3)).expires_at.seconds - int(time.time())
    await asyncio.sleep(ttl - 1)
    second = (await put(stub, rid(), first, 2, ttl_s=3)).response_id
    await asyncio.sleep(2)  # past the first response's own TTL: kept by the second
    assert [e.response_id for e in await chain(stub, second)] == [first, second]
    await asyncio.sleep(ttl + 2)
    for response_id in (first, second):
        await expect(stub.GetResponse(registry_pb2.GetResponseRequest(response_id=response_id, tenant=TENANT)),
                     grpc.StatusCode.NOT_FOUND)
    await expect(put(stub, rid(), second, 3), grpc.StatusCode.NOT_FOUND, second)


async def etcd_bytes(etcd: str, tenant: str, response_id: str) -> int:
    """What etcd holds for the response: its key and value."""
    async with EtcdStore(etcd, "/kvshuttle/") as store:
        key = store.keys.response(tenant, response_id)
        resp = await store.kv.get(key)
        return len(key.encode()) + len(resp.kvs[0].value)


@pytest.fixture(params=["sqlite", "redis"])
async def any_history(request, etcd, stub) -> AsyncIterator[tuple[str, registry_pb2_grpc.SessionRegistryStub]]:
    """A registry stub over the session's registry (SQLite history in memory), or over one of its own on Redis (the
    chart's history store)."""
    if request.param == "sqlite":
        yield "sqlite", stub
        return
    cfg = RegistryConfig(listen="127.0.0.1:0", etcd_endpoints=etcd, history_store=request.getfixturevalue("redis_url"))
    cfg.validate()
    service = await serve(cfg)
    channel = client_channel(service.address)
    try:
        yield "redis", registry_pb2_grpc.SessionRegistryStub(channel)
    finally:
        await channel.close()
        await service.stop(grace=0.5)


async def test_a_thousand_turn_conversation_stores_flat_entries_and_continues(any_history, etcd, capsys):
    """The measurement in docs/agents.md: etcd bytes per stored response at turns 1, 100 and 1,000 (flat), against
    the whole-conversation body the old store kept; and the time to continue from turn 1,000 through the gateway."""
    backend, stub = any_history
    ids = [rid("long") for _ in range(1000)]
    sizes, items_bytes = {}, 0
    started = time.perf_counter()
    for n, response_id in enumerate(ids, start=1):
        entry = await put(stub, response_id, ids[n - 2] if n > 1 else "", n, tenant=OPEN_TENANT)
        items_bytes += len(json.dumps(json.loads(body(response_id, "", n))["items"]))
        if n in (1, 100, 1000):
            sizes[n] = (await etcd_bytes(etcd, OPEN_TENANT, response_id), entry.body_bytes, items_bytes)
    put_s = time.perf_counter() - started
    reads = []
    for _ in range(5):
        registry_started = time.perf_counter()
        got = await chain(stub, ids[-1], tenant=OPEN_TENANT)
        reads.append(time.perf_counter() - registry_started)
        assert [e.response_id for e in got] == ids
    registry_s = statistics.median(reads)

    runner = AnsweringRunner("Done.", registry=stub)
    app = create_app(runner, "agent", 16)
    add_responses_routes(app)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=open_guard(app)), base_url="http://gw") as http:
        continues = []
        for k in range(3):  # three branches from turn 1,000
            continued = time.perf_counter()
            answer = await http.post("/v1/responses", json={"input": [{
                "type": "function_call_output", "call_id": "call_1000", "output": "ok"}],
                "previous_response_id": ids[-1]})
            continues.append(time.perf_counter() - continued)
            assert answer.status_code == 200, answer.text
            assert len(runner.requests[k].messages) == 2000 + 1  # every turn's call and result, then the new result
            assert answer.json()["store"] is True
        continue_s = statistics.median(continues)
    with capsys.disabled():
        print(f"\nstored responses, one conversation, {backend} history store (etcd bytes = key + index entry; "
              "the body is in the history store):")
        for n, (etcd_b, body_b, all_items) in sizes.items():
            print(f"  turn {n:>5}: etcd {etcd_b} B, body {body_b} B (history store); the old whole-conversation "
                  f"body would hold {all_items} B of items")
        print(f"  1000 PutResponse: {put_s:.2f} s ({put_s:.2f} ms each); GetResponseChain at turn 1000: "
              f"{registry_s * 1000:.0f} ms (median of 5); continue from turn 1000 through the gateway (POST "
              f"/v1/responses with previous_response_id, stand-in model): {continue_s * 1000:.0f} ms (median of 3)")
    assert sizes[1000][0] - sizes[100][0] <= 8  # flat: only the counters' varints grow (turn 1 has no link)
    assert sizes[1000][0] <= 400
    assert continue_s < 30


async def test_items_lost_from_the_history_store_are_named_not_a_5xx(etcd, tmp_path):
    """The history store losing a response's items while its etcd entry lives (a Redis eviction, a lost SQLite file):
    its conversation is refused by the missing response's id, and the response itself is not found."""
    cfg = RegistryConfig(listen="127.0.0.1:0", etcd_endpoints=etcd, history_store=f"sqlite:{tmp_path}/h.db")
    cfg.validate()
    service = await serve(cfg)
    channel = client_channel(service.address)
    try:
        stub = registry_pb2_grpc.SessionRegistryStub(channel)
        ids = [rid() for _ in range(3)]
        await put(stub, ids[0])
        await put(stub, ids[1], ids[0], 2)
        await put(stub, ids[2], ids[1], 3)
        with sqlite3.connect(tmp_path / "h.db") as db:  # another process's view of the file (WAL)
            assert db.execute("DELETE FROM response_bodies WHERE id=?", (ids[1],)).rowcount == 1
        await expect(chain(stub, ids[2]), grpc.StatusCode.FAILED_PRECONDITION, ids[1])
        await expect(stub.GetResponse(registry_pb2.GetResponseRequest(response_id=ids[1], tenant=TENANT)),
                     grpc.StatusCode.NOT_FOUND, "gone from the history store")
        assert [e.response_id for e in await chain(stub, ids[0])] == ids[:1]
    finally:
        await channel.close()
        await service.stop(grace=0.5)
