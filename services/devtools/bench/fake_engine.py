"""A model-less stand-in for vLLM's gRPC server (VllmEngine + grpc.health) for `kvshuttle bench-gateway`: streams
tokens at a set rate per stream, so the gateway's own per-token cost is what is measured.

Run as its own process (so that the engines' cost never lands on the gateway's or the clients' cores):

    python -m kvshuttle.services.devtools.bench.fake_engine --port P --interval-ms 20 --tokens 1,2,3
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from kvshuttle.control_plane import cache_salt
from smg_grpc_proto import vllm_engine_pb2, vllm_engine_pb2_grpc
from smg_grpc_proto.generated import common_pb2

SERVICE = "vllm.grpc.engine.VllmEngine"


def model_facts(model_path: str) -> tuple[int, list[int]]:
    """The vocabulary size and EOS ids in ``model_path``'s config.json (0 and [] without one)."""
    try:
        config = json.loads((Path(model_path) / "config.json").read_text()) if model_path else {}
    except (OSError, ValueError):
        config = {}
    eos = config.get("eos_token_id")
    eos_ids = [e for e in (eos if isinstance(eos, list) else [eos]) if isinstance(e, int)]
    return int(config.get("vocab_size") or 0), eos_ids


class RateEngine(vllm_engine_pb2_grpc.VllmEngineServicer):
    """Answers every request with ``tokens`` (cycled to max_tokens), one token per chunk every ``interval_s`` per
    stream (0: as fast as the stream is read). A non-streamed or max_tokens=1 request (the prefill) answers at once
    with a P-side kv_transfer_params; the decode stream's final message carries a decode worker's handle.
    ``offset``: where in ``tokens`` the answers start (1 on the decode engine: it continues after the prefill
    engine's first token, so that a turn's answer is ``tokens`` cycled; 0 on SMG's decode engine, whose answer is D's
    alone). It also answers what SMG asks a worker (GetModelInfo, HealthCheck, Abort); SubscribeKvEvents stays
    unimplemented (SMG then goes without KV events, as with kvshuttle's workers)."""

    def __init__(self, tokens: list[int], interval_s: float, engine_id: str, port: int, block_size: int = 16,
                 offset: int = 0, model_path: str = ""):
        self.tokens, self.interval_s = tokens[offset:] + tokens[:offset], interval_s
        self.engine_id, self.port, self.block_size = engine_id, port, block_size
        self.model_path = model_path
        self.vocab_size, self.eos_token_ids = model_facts(model_path)

    def _params(self, prompt_len: int, n: int) -> str:
        covered = prompt_len + n - 1
        return json.dumps({"do_remote_decode": True, "remote_num_tokens": covered, "remote_engine_id": self.engine_id,
                           "remote_host": "127.0.0.1", "remote_port": self.port + 1,
                           "remote_block_ids": [list(range(-(-covered // self.block_size)))]})

    async def Generate(self, request, context):
        if any(k == cache_salt.METADATA_KEY for k, _ in context.invocation_metadata() or ()):
            await context.send_initial_metadata(((cache_salt.APPLIED_KEY, "1"),))  # as kvshuttle's vLLM plugin
        prompt_len = len(request.tokenized.input_ids)
        n = max(1, request.sampling_params.max_tokens)
        out = list(itertools.islice(itertools.cycle(self.tokens), n))
        if request.stream:
            loop = asyncio.get_running_loop()
            start = loop.time()
            for i, tok in enumerate(out):
                if self.interval_s > 0:  # paced against the stream's start: no drift from late wake-ups
                    delay = start + (i + 1) * self.interval_s - loop.time()
                    if delay > 0:
                        await asyncio.sleep(delay)
                yield vllm_engine_pb2.GenerateResponse(chunk=vllm_engine_pb2.GenerateStreamChunk(
                    token_ids=[tok], prompt_tokens=prompt_len, completion_tokens=i + 1, cached_tokens=0))
            last = out[-1:]
        else:
            last = out
        yield vllm_engine_pb2.GenerateResponse(complete=vllm_engine_pb2.GenerateComplete(
            output_ids=last, finish_reason="length", prompt_tokens=prompt_len, completion_tokens=len(last),
            cached_tokens=0, kv_transfer_params_json=self._params(prompt_len, n)))

    async def GetServerInfo(self, request, context):
        return vllm_engine_pb2.GetServerInfoResponse(kv_engine_id=self.engine_id, block_size=self.block_size,
                                                     kv_connector="NixlConnector", kv_role="kv_both",
                                                     model_dtype="torch.float32", max_num_seqs=4096,
                                                     server_type="vllm-grpc", data_parallel_size=1)

    async def GetModelInfo(self, request, context):
        """What SMG asks a worker when it registers it (the kvshuttle gateway reads its own --model-dir)."""
        return vllm_engine_pb2.GetModelInfoResponse(
            model_path=self.model_path, served_model_name=self.model_path, tokenizer_path=self.model_path,
            is_generation=True, max_context_length=4096, max_req_input_len=4096, vocab_size=self.vocab_size,
            eos_token_ids=self.eos_token_ids)

    async def HealthCheck(self, request, context):
        return vllm_engine_pb2.HealthCheckResponse(healthy=True, message="fake engine")

    async def Abort(self, request, context):
        return vllm_engine_pb2.AbortResponse()

    async def FlushCache(self, request, context):
        return common_pb2.FlushCacheResponse(success=True, message="ok")

    async def GetLoads(self, request, context):
        return vllm_engine_pb2.GetLoadsResponse(version="fake", dp_rank_count=1,
                                                loads=[vllm_engine_pb2.SchedulerLoad(num_running_reqs=0)])


async def serve(port: int, tokens: list[int], interval_s: float, engine_id: str, offset: int = 0,
                model_path: str = "") -> None:
    server = grpc.aio.server(options=[("grpc.max_concurrent_streams", 100000)])
    engine = RateEngine(tokens, interval_s, engine_id, port, offset=offset, model_path=model_path)
    vllm_engine_pb2_grpc.add_VllmEngineServicer_to_server(engine, server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    await health_servicer.set(SERVICE, health_pb2.HealthCheckResponse.SERVING)
    await health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    print("ready", flush=True)
    await server.wait_for_termination()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="fake_engine")
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--interval-ms", type=float, default=20.0)
    ap.add_argument("--tokens", required=True, help="comma-separated token ids, cycled")
    ap.add_argument("--engine-id", default="fake-engine")
    ap.add_argument("--offset", type=int, default=0, help="where in --tokens answers start (decode: 1)")
    ap.add_argument("--model-path", default="", help="the model directory GetModelInfo names (SMG asks for it)")
    args = ap.parse_args(argv)
    try:
        import uvloop
        uvloop.install()
    except ImportError:
        pass
    asyncio.run(serve(args.port, [int(t) for t in args.tokens.split(",")], args.interval_ms / 1000, args.engine_id,
                      args.offset, args.model_path))


if __name__ == "__main__":
    main()
