"""EngineClient against an in-process fake of vLLM's gRPC server, its streamed calls on both transports (the lean
HTTP/2 client, h2_streams, and grpc.aio)."""

from __future__ import annotations

import asyncio
import contextlib

import grpc
import pytest
from kvshuttle.control_plane import cache_salt
from kvshuttle.services.engine.client import Chunk, EngineClient, EngineError, Final

from tests.support.fake_engine import FakeEngineServer
from tests.support.waits import until


@pytest.fixture
async def server():
    s = FakeEngineServer()
    await s.start()
    yield s
    await s.stop()


@pytest.fixture(params=[True, False], ids=["h2", "grpcio"])
def lean(request) -> bool:
    return request.param


@pytest.fixture
async def client(server, lean):
    c = EngineClient(server.address, timeout_s=5, lean_streams=lean)
    yield c
    await c.close()


async def test_stream_joins_chunks_and_parses_params(client, server):
    items = [item async for item in client.generate("r1", [5, 6, 7], max_tokens=4,
                                                       kv_transfer_params={"do_remote_prefill": True})]
    chunks, final = items[:-1], items[-1]
    assert all(isinstance(c, Chunk) for c in chunks) and [c.token_ids for c in chunks] == [[8], [9], [10], [11]]
    assert isinstance(final, Final)
    # The servicer's streamed complete only repeats the last chunk; Final must hold all ids.
    assert final.output_ids == [8, 9, 10, 11]
    assert (final.finish_reason, final.prompt_tokens, final.completion_tokens, final.cached_tokens) == (
        "length", 3, 4, 3)
    assert final.kv_transfer_params["got"] == {"do_remote_prefill": True}
    req = server.engine.requests[-1]
    assert list(req.tokenized.input_ids) == [5, 6, 7] and req.stream
    assert req.sampling_params.temperature == 0.0 and req.sampling_params.max_tokens == 4
    assert not req.sampling_params.HasField("seed")


async def test_prefill_is_one_token_non_streaming(client, server):
    final = await client.prefill("p1", [1, 2], kv_transfer_params=None)
    assert final.output_ids == [3] and final.kv_transfer_params["remote_num_tokens"] == 2
    req = server.engine.requests[-1]
    assert not req.stream and req.sampling_params.max_tokens == 1
    # No handle: the plain "compute and keep for the decode worker" params.
    assert final.kv_transfer_params["got"]["do_remote_decode"] is True
    assert final.kv_transfer_params["got"]["remote_engine_id"] is None


async def test_errors_become_engine_error(client):
    with pytest.raises(EngineError) as err:
        async for _ in client.generate("fail-1", [1], max_tokens=2):
            pass
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT and "refused" in err.value.message


async def test_timeout(server, lean):
    c = EngineClient(server.address, timeout_s=0.1, lean_streams=lean)
    with pytest.raises(EngineError) as err:
        async for _ in c.generate("slow-t", [1], max_tokens=50):
            pass
    assert err.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
    await c.close()


async def test_cancelling_the_iterator_cancels_the_rpc(client, server):
    async def consume():
        async for _ in client.generate("slow-c", [1], max_tokens=100):
            pass

    task = asyncio.create_task(consume())
    await until(lambda: any(r.request_id == "slow-c" for r in server.engine.requests), what="the request under way")
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    await until(lambda: "slow-c" in server.engine.cancelled, 10.0, "the server to see the RPC cancelled")


async def test_closing_the_iterator_cancels_the_rpc(client, server):
    gen = client.generate("slow-b", [1], max_tokens=100)
    first = await anext(gen)
    assert first.token_ids == [2]
    await gen.aclose()
    await until(lambda: "slow-b" in server.engine.cancelled, 1.0, "the server to see the RPC cancelled")


async def test_management_calls(client, server):
    info = await client.server_info()
    assert (info.engine_id, info.block_size, info.kv_connector, info.kv_role, info.model_dtype) == (
        "fake-engine", 16, "NixlConnector", "kv_both", "torch.float32")
    assert await client.flush_cache() and server.engine.flushes == 1
    loads = await client.get_loads()
    assert loads["loads"][0]["num_running_reqs"] == 2 and loads["loads"][0]["num_waiting_reqs"] == 0
    assert await client.is_serving()
    await server.set_serving(False)
    assert not await client.is_serving()


async def test_unreachable_worker(lean):
    c = EngineClient("127.0.0.1:1", timeout_s=1, lean_streams=lean)
    assert not await c.is_serving(timeout_s=0.5)
    with pytest.raises(EngineError) as err:
        await c.server_info()
    assert err.value.code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
    with pytest.raises(EngineError) as err:
        [item async for item in c.generate("u1", [1], max_tokens=2)]
    assert err.value.code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
    await c.close()


@pytest.mark.parametrize("stream", [True, False])
async def test_a_salt_goes_as_metadata_and_a_worker_that_does_not_confirm_it_is_refused(client, server, stream):
    salt = cache_salt.for_tenant("acme")
    items = [i async for i in client.generate("s1", [5, 6], max_tokens=2, stream=stream, cache_salt=salt)]
    assert isinstance(items[-1], Final) and server.engine.metadata["s1"][cache_salt.METADATA_KEY] == salt
    final = await client.prefill("s2", [5, 6], kv_transfer_params=None, cache_salt=salt)
    assert final.output_ids and server.engine.metadata["s2"][cache_salt.METADATA_KEY] == salt
    [i async for i in client.generate("s3", [5, 6], max_tokens=2, stream=stream)]  # unsalted: no confirmation asked
    assert cache_salt.METADATA_KEY not in server.engine.metadata["s3"]

    server.engine.confirms_salts = False  # a vLLM without kvshuttle's plugin would serve the request unsalted
    seen = []
    with pytest.raises(EngineError) as err:
        async for item in client.generate("s4", [5, 6], max_tokens=2, stream=stream, cache_salt=salt):
            seen.append(item)
    assert err.value.code == grpc.StatusCode.FAILED_PRECONDITION and "cache salts" in err.value.message
    assert seen == []  # nothing it answered reached the caller
