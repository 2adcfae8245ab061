"""An in-process stand-in for vLLM's gRPC server (VllmEngine + grpc.health) for client and agent tests."""

from __future__ import annotations

import asyncio
import json

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from kvshuttle.control_plane import cache_salt
from kvshuttle.control_plane.models import ADAPTER_APPLIED_KEY, ADAPTER_METADATA_KEY
from smg_grpc_proto import vllm_engine_pb2, vllm_engine_pb2_grpc
from smg_grpc_proto.generated import common_pb2

SERVICE = "vllm.grpc.engine.VllmEngine"


class FakeEngine(vllm_engine_pb2_grpc.VllmEngineServicer):
    """Answers token i of a request with ``prompt[-1] + i + 1``; mimics the streamed-complete quirk (its
    output_ids and completion_tokens cover only the last chunk, as vLLM 0.32's servicer does). Request ids starting with ``fail`` are refused, ``slow`` ones stream
    one token per 50 ms. A request with a cache salt (call metadata) is answered with the confirmation kvshuttle's
    vLLM plugin sends (workers/vllm_call_options.py), and so is one naming an adapter; ``metadata`` keeps them. ``handle``: fields (remote_engine_id, remote_host, remote_port) that make the final message's
    kv_transfer_params a decode worker's handle (with block ids for ``block_size``-token blocks) that the registry
    records."""

    def __init__(self, handle: dict | None = None, block_size: int = 16):
        self.requests: list[vllm_engine_pb2.GenerateRequest] = []
        self.cancelled: list[str] = []
        self.flushes = 0
        self.metadata: dict[str, dict[str, str]] = {}  # each request's gRPC metadata (trace context), by request id
        self.handle, self.block_size = handle, block_size
        self.confirms_salts = True  # False: a vLLM without kvshuttle's plugin
        self.used_tokens = self.capacity_tokens = 0  # the KV cache GetLoads reports (0: unknown)
        self.token_delay_s = 0.0  # a pause before each streamed token of every request (as ``slow`` ones have)

    async def Generate(self, request, context):
        self.requests.append(request)
        rid = request.request_id
        self.metadata[rid] = {k: v for k, v in context.invocation_metadata() or () if isinstance(v, str)}
        applied = ()
        if cache_salt.METADATA_KEY in self.metadata[rid] and self.confirms_salts:
            applied += ((cache_salt.APPLIED_KEY, "1"),)
        if ADAPTER_METADATA_KEY in self.metadata[rid] and self.confirms_salts:
            applied += ((ADAPTER_APPLIED_KEY, "1"),)
        if applied:
            await context.send_initial_metadata(applied)
        if rid.startswith("fail"):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "refused by fake")
        prompt = list(request.tokenized.input_ids)
        n = request.sampling_params.max_tokens
        out = [prompt[-1] + i + 1 for i in range(n)]
        params = json.loads(request.kv_transfer_params_json) if request.HasField("kv_transfer_params_json") else None
        reply = {"do_remote_decode": True, "remote_num_tokens": len(prompt) + n - 1, "got": params}
        if self.handle is not None:
            reply.update(self.handle, remote_block_ids=[list(range(-(-reply["remote_num_tokens"] // self.block_size)))])
        try:
            if request.stream:
                for i, tok in enumerate(out):
                    if rid.startswith("slow") or self.token_delay_s:
                        await asyncio.sleep(self.token_delay_s or 0.05)
                    yield vllm_engine_pb2.GenerateResponse(chunk=vllm_engine_pb2.GenerateStreamChunk(
                        token_ids=[tok], prompt_tokens=len(prompt), completion_tokens=i + 1, cached_tokens=3))
                last = out[-1:]
            else:
                last = out
            yield vllm_engine_pb2.GenerateResponse(complete=vllm_engine_pb2.GenerateComplete(
                output_ids=last, finish_reason="length", prompt_tokens=len(prompt), completion_tokens=len(last),
                cached_tokens=3, kv_transfer_params_json=json.dumps(reply)))
        except (asyncio.CancelledError, GeneratorExit):  # cancelled while awaiting, or closed at a yield
            self.cancelled.append(rid)
            raise

    async def GetServerInfo(self, request, context):
        return vllm_engine_pb2.GetServerInfoResponse(kv_engine_id="fake-engine", block_size=16,
                                                     kv_connector="NixlConnector", kv_role="kv_both",
                                                     model_dtype="torch.float32", max_num_seqs=8)

    async def FlushCache(self, request, context):
        self.flushes += 1
        return common_pb2.FlushCacheResponse(success=True, message="ok")

    async def GetLoads(self, request, context):
        return vllm_engine_pb2.GetLoadsResponse(version="fake", dp_rank_count=1,
                                                loads=[vllm_engine_pb2.SchedulerLoad(
                                                    num_running_reqs=2, num_used_tokens=self.used_tokens,
                                                    max_total_num_tokens=self.capacity_tokens)])


class FakeEngineServer:
    def __init__(self, handle: dict | None = None):
        self.engine = FakeEngine(handle)
        self.health = health.aio.HealthServicer()
        self.server = grpc.aio.server()
        vllm_engine_pb2_grpc.add_VllmEngineServicer_to_server(self.engine, self.server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        self.address = f"127.0.0.1:{self.port}"

    async def start(self, serving: bool = True) -> None:
        await self.server.start()
        await self.set_serving(serving)

    async def set_serving(self, serving: bool) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        await self.health.set(SERVICE, status)

    async def stop(self) -> None:
        await self.server.stop(0)
