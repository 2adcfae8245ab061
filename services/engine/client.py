"""Async client for a vLLM worker in gRPC server mode (`vllm.grpc.engine.VllmEngine`, smg-grpc-proto).

Requests are token ids in and token ids out. The NIXL ``kv_transfer_params`` travel as JSON
(``kv_transfer_params_json``) both ways and come back parsed on :class:`Final`.

A streaming ``Generate`` yields one :class:`Chunk` per engine step and then one :class:`Final`. In a streamed call the
servicer's ``GenerateComplete.output_ids`` (and its ``completion_tokens``) cover only the last chunk, so
``Final.output_ids`` is built from the chunks; in a non-streamed call it is the complete's list. ``finish_reason == "error"`` (e.g. a failed KV load
on a prefill worker) arrives as a normal Final, not as an exception: the caller decides whether to retry.

``cache_salt`` (kvshuttle.control_plane.cache_salt) and ``adapter`` (a LoRA adapter's name,
kvshuttle.control_plane.models) travel as call metadata; a worker that does not confirm them (no kvshuttle vLLM
plugin) fails the call with FAILED_PRECONDITION at its first response, before anything is yielded.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import grpc
from google.protobuf import json_format
from grpc_health.v1 import health_pb2, health_pb2_grpc
from kvshuttle.control_plane import cache_salt as salts
from kvshuttle.control_plane.kv_index.events import EventBatch
from kvshuttle.control_plane.kv_params import prefill_request_params
from kvshuttle.control_plane.models import ADAPTER_APPLIED_KEY, ADAPTER_METADATA_KEY
from kvshuttle.services.common.telemetry import QuietTracer, client_interceptors, server_attributes, tracing_enabled
from kvshuttle.services.common.tls import ClientTls
from kvshuttle.services.engine import h2_streams
from kvshuttle.services.engine.chunk_wire import plain_chunk
from kvshuttle.services.engine.kv_events import relay_events
from opentelemetry import propagate, trace
from smg_grpc_proto import vllm_engine_pb2, vllm_engine_pb2_grpc
from smg_grpc_proto.generated import common_pb2

SERVICE_NAME = "vllm.grpc.engine.VllmEngine"
_tracer = QuietTracer("kvshuttle.engine")
# gRPC's reconnect backoff grows to 120 s while a server is down: a worker that is starting (or restarting) would be
# seen up to minutes late. Cap it at 2 s.
# gRPC core also takes min_reconnect_backoff_ms as the deadline of each connection attempt: at 250 ms a busy
# worker's server that answered a fresh connection a little late counted as unreachable (and the gateway moved the
# turn away from a live worker). Attempts get 2 s; retries still start 250 ms apart.
FAST_RECONNECT_OPTIONS = [
    ("grpc.initial_reconnect_backoff_ms", 250),
    ("grpc.min_reconnect_backoff_ms", 2000),
    ("grpc.max_reconnect_backoff_ms", 2000),
]


def fast_reconnect_channel(address: str, tls: ClientTls | None = None) -> grpc.aio.Channel:
    """Like ``kvshuttle.services.common.grpc_server.client_channel`` (trace context propagates when this process traces: each call is
    a CLIENT span naming the worker's address), with a capped reconnect backoff.

    ``tls`` is for kvshuttle's own servers (the registry); vLLM's gRPC server speaks plaintext only.
    """
    interceptors = client_interceptors(address)
    if tls is None:
        return grpc.aio.insecure_channel(address, options=FAST_RECONNECT_OPTIONS, interceptors=interceptors)
    return grpc.aio.secure_channel(address, tls.credentials(), options=[*FAST_RECONNECT_OPTIONS, *tls.options()],
                                   interceptors=interceptors)


@dataclass
class ServerInfo:
    engine_id: str
    block_size: int
    kv_connector: str
    kv_role: str
    model_dtype: str
    max_num_seqs: int = 0


@dataclass
class Chunk:
    token_ids: list[int]
    prompt_tokens: int
    cached_tokens: int
    logprobs: list[TokenLogprob] | None = None


@dataclass(frozen=True)
class TokenLogprob:
    """A sampled token's log-probability, and the most likely tokens at its position (``top``: (id, logprob), most
    likely first; as many as asked for)."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


def _logprobs(out: Any, ids: Sequence[int]) -> list[TokenLogprob]:
    """The engine's OutputLogProbs as one TokenLogprob per id."""
    tops = list(out.top_logprobs)
    return [TokenLogprob(i, lp, tuple(zip(tops[k].token_ids, tops[k].values, strict=False)) if k < len(tops) else ())
            for k, (i, lp) in enumerate(zip(ids, out.token_logprobs, strict=False))]


@dataclass
class Final:
    output_ids: list[int]
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    kv_transfer_params: dict | None
    logprobs: list[TokenLogprob] | None = field(default=None, repr=False)


class ChunkSink(Protocol):
    """Where a streamed call's plain chunks may go straight from the connection's read (``generate``'s
    ``express``): ``ready()`` says whether it takes one now (asked before the message is read), ``take`` gets it."""

    def ready(self) -> bool: ...

    def take(self, chunk: Chunk) -> None: ...


class EngineError(Exception):
    """A failed or timed-out call to a worker. ``code`` is the gRPC status (None: a protocol problem)."""

    def __init__(self, code: grpc.StatusCode | None, message: str):
        super().__init__(f"{code.name if code else 'ERROR'}: {message}")
        self.code = code
        self.message = message


def _error(exc: grpc.aio.AioRpcError) -> EngineError:
    return EngineError(exc.code(), exc.details() or "")


class _LeanCall:
    """A streamed Generate on h2_streams, read like grpc.aio's call (``read``, ``initial_metadata``, ``done``,
    ``cancel``); its CLIENT span (when this process traces) ends with the call."""

    __slots__ = ("stream", "_span", "parse")

    def __init__(self, stream: h2_streams.Stream, span: trace.Span | None):
        self.stream, self._span = stream, span
        self.parse = vllm_engine_pb2.GenerateResponse.FromString

    async def read(self) -> Any:
        message = await self.stream.read()
        if message is None:
            self.end_span(grpc.StatusCode.OK)
            return grpc.aio.EOF
        return self.parse(message)

    async def initial_metadata(self) -> tuple[tuple[str, str], ...]:
        return tuple((self.stream.initial_metadata or {}).items())

    def done(self) -> bool:
        return self.stream.done

    def cancel(self) -> None:
        self.stream.cancel()

    def end_span(self, code: grpc.StatusCode) -> None:
        if self._span is not None:
            _end_span(self._span, code)
            self._span = None


def _end_span(span: trace.Span, code: grpc.StatusCode) -> None:
    """A call's CLIENT span ended with its status, as grpc.aio's interceptor ends it."""
    span.set_attribute("rpc.grpc.status_code", code.value[0])
    if code != grpc.StatusCode.OK:
        span.set_status(trace.StatusCode.ERROR, code.name)
    span.end()


_GENERATE = f"/{SERVICE_NAME}/Generate"


class EngineClient:
    """One worker's vLLM gRPC server. ``timeout_s`` bounds every call (a whole streamed generation included).

    Generations, streamed or not (P's prefill), go over ``h2_streams`` (a lean HTTP/2 client: grpc.aio costs more
    CPU per streamed token than the rest of the gateway's path, and a prefill's call several hundred µs more,
    docs/performance.md) unless ``lean_streams`` is off or the address is not ``host:port``; everything else over
    grpc.aio."""

    def __init__(self, address: str, *, timeout_s: float = 120.0, lean_streams: bool = True):
        self.address = address
        self.timeout_s = timeout_s
        self._lean = h2_streams.Channel(address) if lean_streams and h2_streams.plain_target(address) else None
        self._channel: grpc.aio.Channel | None = None
        self._stub: vllm_engine_pb2_grpc.VllmEngineStub | None = None
        self._health: health_pb2_grpc.HealthStub | None = None

    def _engine(self) -> vllm_engine_pb2_grpc.VllmEngineStub:
        # The channel is created lazily so that it binds to the event loop that uses it.
        if self._stub is None:
            self._channel = fast_reconnect_channel(self.address)
            self._stub = vllm_engine_pb2_grpc.VllmEngineStub(self._channel)
            self._health = health_pb2_grpc.HealthStub(self._channel)
        return self._stub

    async def generate(self, request_id: str, prompt_ids: Sequence[int], *, max_tokens: int,
                       temperature: float = 0.0, top_p: float = 1.0, seed: int | None = None,
                       ignore_eos: bool = False, stop: Sequence[str] = (), stop_token_ids: Sequence[int] = (),
                       kv_transfer_params: dict | None = None, stream: bool = True, logprobs: int | None = None,
                       timeout_s: float | None = None, top_k: int = 0, min_p: float = 0.0,
                       presence_penalty: float = 0.0, frequency_penalty: float = 0.0,
                       repetition_penalty: float = 1.0, min_tokens: int = 0,
                       logit_bias: Mapping[int, float] | None = None, skip_special_tokens: bool = True,
                       spaces_between_special_tokens: bool = True,
                       constraint: tuple[str, Any] | None = None,
                       cache_salt: str | None = None, adapter: str | None = None,
                       express: ChunkSink | None = None) -> AsyncIterator[Chunk | Final]:
        """Yield a Chunk per streamed piece (none when ``stream`` is false) and exactly one Final last.

        The sampling keywords are vLLM's (``top_k`` 0: off). ``logprobs``: None, or how many of the most likely
        tokens to report with each sampled token's log-probability (0: the sampled token's only). ``constraint``: guided decoding, as (SamplingParams'
        constraint field, value): ("json_schema" | "regex" | "grammar" | "structural_tag", str), ("json_object", True)
        or ("choice", [str, ...]). The worker detokenizes only to match ``stop`` strings
        (then with ``skip_special_tokens``/``spaces_between_special_tokens``); the caller detokenizes the answer.
        ``cache_salt``: the prefix-cache salt of the request's tenant (None: unsalted, for direct tools).
        ``adapter``: the LoRA adapter to run under, by the name the worker registered it (None: the base model).
        ``express``: while this iterator waits for its next item (on the lean client, once the worker confirmed the
        call's options), the chunks that arrive go to ``express.take`` from the connection's read instead, when
        ``express.ready()``; they are not yielded then (the Final still counts their ids).

        Raises EngineError on gRPC errors and timeouts. Closing or cancelling the iterator cancels the RPC (the
        server then aborts the request).
        """
        sampling = vllm_engine_pb2.SamplingParams(
            temperature=temperature, top_p=top_p, max_tokens=max_tokens, ignore_eos=ignore_eos, stop=list(stop),
            stop_token_ids=list(stop_token_ids), n=1, top_k=top_k, min_p=min_p, presence_penalty=presence_penalty,
            frequency_penalty=frequency_penalty, repetition_penalty=repetition_penalty, min_tokens=min_tokens,
            skip_special_tokens=skip_special_tokens, spaces_between_special_tokens=spaces_between_special_tokens)
        if logit_bias:
            sampling.logit_bias.update(logit_bias)
        if constraint is not None:
            kind, value = constraint
            if kind == "choice":
                sampling.choice.choices.extend(value)
            else:
                setattr(sampling, kind, value)
        if seed is not None:
            sampling.seed = seed
        if logprobs is not None:
            sampling.logprobs = logprobs  # 0: the chosen token's only; N: also the N most likely
        request = vllm_engine_pb2.GenerateRequest(
            request_id=request_id, tokenized=vllm_engine_pb2.TokenizedInput(input_ids=list(prompt_ids)),
            sampling_params=sampling, stream=stream)
        if kv_transfer_params is not None:
            request.kv_transfer_params_json = json.dumps(kv_transfer_params)
        metadata: tuple[tuple[str, str], ...] = ()
        if cache_salt is not None:
            metadata += ((salts.METADATA_KEY, cache_salt),)
        if adapter is not None:
            metadata += ((ADAPTER_METADATA_KEY, adapter),)
        timeout = timeout_s or self.timeout_s
        if self._lean is not None:
            call: Any = await self._lean_call(request, metadata, timeout)
        else:
            call = self._engine().Generate(request, timeout=timeout, metadata=metadata or None)
        streamed: list[int] = []
        streamed_logprobs: list[TokenLogprob] = []
        want = logprobs is not None
        final: Final | None = None

        def chunk_of(c: Any) -> Chunk:
            ids = list(c.token_ids)
            streamed.extend(ids)
            if not want:
                return Chunk(ids, c.prompt_tokens, c.cached_tokens)
            lps = _logprobs(c.output_logprobs, ids)
            streamed_logprobs.extend(lps)
            return Chunk(ids, c.prompt_tokens, c.cached_tokens, lps)

        lane = call.stream if express is not None and isinstance(call, _LeanCall) else None
        if lane is not None:
            parse, ready, take = call.parse, express.ready, express.take

            def expressed(message: bytes) -> bool:
                if not ready():
                    return False
                if not want:
                    plain = plain_chunk(message)  # the usual token: its ids straight from the wire
                    if plain is not None:
                        ids, prompt_tokens, cached_tokens = plain
                        streamed.extend(ids)
                        take(Chunk(ids, prompt_tokens, cached_tokens))
                        return True
                response = parse(message)
                if response.WhichOneof("response") != "chunk":
                    return False  # read (and parsed) again in the iterator, in order
                take(chunk_of(response.chunk))
                return True

        try:
            confirmed = not metadata
            read, eof = call.read, grpc.aio.EOF
            while True:
                if lane is not None and confirmed:
                    lane.express = expressed  # only while waiting here: what was yielded is written first
                    try:
                        response = await read()
                    finally:
                        lane.express = None
                else:
                    response = await read()  # read() direct: no generator of grpc's per message
                if response is eof:
                    break
                if not confirmed:  # the worker's initial metadata came with its first response at the latest
                    self._check_applied(dict(await call.initial_metadata() or ()), cache_salt, adapter)
                    confirmed = True
                kind = response.WhichOneof("response")
                if kind == "chunk":
                    yield chunk_of(response.chunk)
                elif kind == "complete":
                    c = response.complete
                    params = None
                    if c.HasField("kv_transfer_params_json") and c.kv_transfer_params_json:
                        params = json.loads(c.kv_transfer_params_json)
                    if stream:
                        ids, lps = streamed, (streamed_logprobs if logprobs else None)
                    else:
                        ids = list(c.output_ids)
                        lps = _logprobs(c.output_logprobs, ids) if want else None
                    # A streamed complete's completion_tokens counts its own (last) ids only, like output_ids.
                    final = Final(ids, c.finish_reason, c.prompt_tokens, len(ids) if stream else c.completion_tokens,
                                  c.cached_tokens, params, lps)
            # The Final is yielded once the stream has ended: cancelling a call whose request has just finished
            # must never race with the engine's bookkeeping of the blocks it keeps for the next turn.
            if final is None:
                raise EngineError(None, f"request {request_id}: stream ended without a GenerateComplete")
        except grpc.aio.AioRpcError as exc:
            raise _error(exc) from None
        except h2_streams.StreamError as exc:
            if isinstance(call, _LeanCall):
                call.end_span(exc.code)
            raise EngineError(exc.code, exc.message) from None
        finally:
            if not call.done():
                call.cancel()
            if isinstance(call, _LeanCall):
                call.end_span(grpc.StatusCode.CANCELLED)  # a no-op once ended
        yield final

    def _check_applied(self, answer: Mapping[str, str], cache_salt: str | None, adapter: str | None) -> None:
        """Refuse a worker that did not confirm the call options it was sent (no kvshuttle vLLM plugin)."""
        if cache_salt is not None and answer.get(salts.APPLIED_KEY) != "1":
            raise EngineError(grpc.StatusCode.FAILED_PRECONDITION,
                              f"the worker at {self.address} does not apply per-tenant cache salts (its vLLM lacks "
                              "kvshuttle's plugin, kvshuttle.workers.vllm_plugin)")
        if adapter is not None and answer.get(ADAPTER_APPLIED_KEY) != "1":
            raise EngineError(grpc.StatusCode.FAILED_PRECONDITION,
                              f"the worker at {self.address} did not run the request under adapter {adapter!r} (its "
                              "vLLM lacks kvshuttle's plugin, kvshuttle.workers.vllm_plugin)")

    async def _lean_call(self, request: Any, metadata: Sequence[tuple[str, str]], timeout_s: float) -> _LeanCall:
        """Start a streamed Generate on the lean channel, as a CLIENT span like grpc.aio's interceptor makes."""
        assert self._lean is not None
        span = None
        if tracing_enabled():
            span = _tracer.start_span(_GENERATE, kind=trace.SpanKind.CLIENT, attributes={
                "rpc.system": "grpc", "rpc.service": SERVICE_NAME, "rpc.method": "Generate",
                **server_attributes(self.address)})
            carrier: dict[str, str] = {}
            propagate.inject(carrier, context=trace.set_span_in_context(span))
            metadata = (*metadata, *carrier.items())
        try:
            return _LeanCall(await self._lean.call(_GENERATE, request.SerializeToString(), metadata, timeout_s), span)
        except h2_streams.StreamError as exc:
            if span is not None:
                _end_span(span, exc.code)
            raise EngineError(exc.code, exc.message) from None

    async def read_to_free(self, request_id: str, first_block: Sequence[int], kv_transfer_params: dict, *,
                           timeout_s: float | None = None, cache_salt: str | None = None,
                           adapter: str | None = None) -> bool:
        """Free a decode worker's held KV handle: this (prefill) worker reads the handle's first block, whose tokens
        ``first_block`` repeats (plus one token to compute), and the decode worker frees all of the handle's blocks
        after any read. ``kv_transfer_params``: the handle cut to that block (kvshuttle.control_plane.kv_params.pull_params).
        ``cache_salt``: the handle's tenant's (P may hold the block already) or ``cache_salt.FREE_READ``.
        ``adapter``: the LoRA adapter the handle's KV was computed under, with the tenant's salt (P caches the
        block it reads under the request's hash: under the base model's, a base-model turn could hit an adapter's KV).

        A streamed request cancelled at its first token: by then the read is done (and D told), and a cancelled
        request's blocks are freed at once here (one that finished would keep them for its KV lease, waiting for a
        decode worker that never comes). False when the read failed. Raises EngineError like ``generate``."""
        stream = self.generate(request_id, first_block, max_tokens=16, ignore_eos=True,
                               kv_transfer_params=kv_transfer_params, stream=True, timeout_s=timeout_s,
                               cache_salt=cache_salt, adapter=adapter)
        async with contextlib.aclosing(stream):
            async for item in stream:
                return not (isinstance(item, Final) and item.finish_reason == "error")
        return False

    async def prefill(self, request_id: str, prompt_ids: Sequence[int], *, kv_transfer_params: dict | None,
                      timeout_s: float | None = None, cache_salt: str | None = None, adapter: str | None = None,
                      **sampling: Any) -> Final:
        """Compute (or pull) the prompt's KV on a prefill worker: ``max_tokens=1``, not streamed.

        ``kv_transfer_params`` is a decode worker's (trimmed) handle to pull from, or None for a plain prefill
        (then the standard "keep the blocks for a decode worker" params are sent). The returned Final's
        ``kv_transfer_params`` are the ones for the decode worker; its one output id is sampled with the given
        parameters (``sampling``: generate's sampling keywords; the answer's first token).
        """
        params = prefill_request_params() if kv_transfer_params is None else kv_transfer_params
        final: Final | None = None
        async for item in self.generate(request_id, prompt_ids, max_tokens=1, kv_transfer_params=params,
                                        stream=False, timeout_s=timeout_s, cache_salt=cache_salt, adapter=adapter,
                                        **sampling):
            if isinstance(item, Final):
                final = item
        assert final is not None  # generate always ends with a Final or raises
        return final

    async def _unary(self, method: str, request: Any, timeout_s: float | None = None) -> Any:
        try:
            return await getattr(self._engine(), method)(request, timeout=timeout_s or self.timeout_s)
        except grpc.aio.AioRpcError as exc:
            raise _error(exc) from None

    async def server_info(self) -> ServerInfo:
        r = await self._unary("GetServerInfo", vllm_engine_pb2.GetServerInfoRequest())
        return ServerInfo(engine_id=r.kv_engine_id, block_size=r.block_size, kv_connector=r.kv_connector,
                          kv_role=r.kv_role, model_dtype=r.model_dtype, max_num_seqs=r.max_num_seqs)

    async def model_info(self) -> dict:
        r = await self._unary("GetModelInfo", vllm_engine_pb2.GetModelInfoRequest())
        return json_format.MessageToDict(r, preserving_proto_field_name=True,
                                         always_print_fields_with_no_presence=True)

    async def flush_cache(self, wait_s: float = 0.0) -> bool:
        """Drop the worker's local prefix cache. False when refused (requests or held blocks in flight)."""
        r = await self._unary("FlushCache", common_pb2.FlushCacheRequest(timeout_s=wait_s))
        return r.success

    async def abort(self, request_ids: Sequence[str]) -> None:
        await self._unary("Abort", vllm_engine_pb2.AbortRequest(request_ids=list(request_ids)))

    async def is_serving(self, timeout_s: float = 5.0) -> bool:
        """grpc.health.v1 status of the engine service (NOT_SERVING during warm-up and after an engine death)."""
        self._engine()
        try:
            r = await self._health.Check(health_pb2.HealthCheckRequest(service=SERVICE_NAME), timeout=timeout_s)
        except grpc.aio.AioRpcError:
            return False
        return r.status == health_pb2.HealthCheckResponse.SERVING

    async def get_loads(self) -> dict:
        """GetLoads as a dict with snake_case keys: ``{"timestamp", "version", "dp_rank_count", "loads": [...]}``."""
        r = await self._unary("GetLoads", vllm_engine_pb2.GetLoadsRequest())
        return json_format.MessageToDict(r, preserving_proto_field_name=True,
                                         always_print_fields_with_no_presence=True)

    async def kv_events(self) -> AsyncIterator[EventBatch]:
        """The engine's KV-cache events as the servicer relays them (``SubscribeKvEvents``): first the engine's
        whole cache (the relay's snapshot, starting with a clear), then each change; batches carrying only a load
        record are skipped. Never ends by itself; an EngineError when the stream breaks (the caller resubscribes:
        the relay's snapshot then starts again from a clear)."""
        stream = self._engine().SubscribeKvEvents(common_pb2.SubscribeKvEventsRequest())
        try:
            async for batch in stream:
                events = relay_events(batch)
                if events.events:
                    yield events
        except grpc.aio.AioRpcError as exc:
            raise _error(exc) from None
        finally:
            stream.cancel()
        raise EngineError(grpc.StatusCode.UNAVAILABLE, "the KV event stream ended")

    async def close(self) -> None:
        if self._lean is not None:
            self._lean.close()
        if self._channel is not None:
            await self._channel.close()
        self._channel = self._stub = self._health = None
