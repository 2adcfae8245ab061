"""Stage 4, the decode on D: stream D's tokens as text (P's first token first, when P sampled it). A D that fails
mid-answer is DecodeFailed; the runner replaces it (the prompt and the tokens so far are prefilled on a live P) and
the stream goes on.

One text for the stream, the whole answer and the record: the concatenation of the streamed pieces (an incremental
detokenizer holds back unfinished characters).

A chunk takes one of two ways, through the same step (``Decoding._take``): yielded up the turn's iterators, or, while
they wait for D's next message and the front end opened the turn's express lane (context.ExpressLane), handed to
``Decoding.take`` from the connection's read, which delivers its delta to the runner's parse and the API's spelling
and writes it out there.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import AsyncIterator, Callable, Sequence
from typing import TYPE_CHECKING, Any

import grpc
from kvshuttle.services.common import metrics
from kvshuttle.services.engine.client import Chunk, ChunkSink, EngineClient, EngineError, Final, TokenLogprob
from kvshuttle.services.gateway.tokens.detokenizer import IncrementalText
from kvshuttle.services.gateway.turns.context import Delta, TurnContext, elapsed_ms
from kvshuttle.services.gateway.turns.errors import DecodeFailed, TurnError
from kvshuttle.services.gateway.turns.request import TurnRequest
from kvshuttle.services.gateway.turns.spans import tracer
from opentelemetry import context as otel_context
from opentelemetry import trace

if TYPE_CHECKING:
    from kvshuttle.services.gateway.turns.services import TurnServices

log = logging.getLogger(__name__)


def hidden_token_ids(rt: TurnServices, req: TurnRequest) -> set[int]:
    """Token ids whose text is left out of the answer, as vLLM leaves out the token that stopped it: stop token
    ids, and EOS unless ignored (none with include_stop_str_in_output). Such a token can only be the answer's
    last (min_tokens keeps them from being sampled earlier), so every one in the output is left out."""
    if req.include_stop_str_in_output:
        return set()
    eos = getattr(rt.tokenizer, "eos_token_ids", None)
    return set(req.stop_token_ids) | (set(eos) if isinstance(eos, list) and not req.ignore_eos else set())


class Decoding:
    """D's side of one turn. Its state (what was streamed, what is held back) outlives a failed D: ``stream`` raises
    DecodeFailed, the runner points the turn at a new D (``resumed``), and ``stream`` goes on where it stopped.

    ``first`` yields P's first token (when P sampled it), ``stream`` D's tokens, ``finish`` what came at the end;
    they set ``ctx.output_ids``, ``output_logprobs``, ``text``, ``hidden`` and ``final`` (D's final message)."""

    def __init__(self, rt: TurnServices, ctx: TurnContext):
        self.rt, self.ctx = rt, ctx
        self.pending: list[int] = []  # ids not yet sent in a Delta (held back while they end in a partial character)
        self.pending_lps: list[TokenLogprob] = []
        self.detok = IncrementalText(rt.tokenizer, ctx.request.skip_special_tokens)
        ctx.hidden = hidden_token_ids(rt, ctx.request)
        self.final: Final | None = None
        self.started = time.perf_counter()
        self.d_prompt, self.d_max_tokens, self.done_at_first = ctx.prompt_ids, ctx.request.max_tokens, ""
        self.attempt = 0  # how many decode workers failed in this turn
        self.before = 0  # len(output) when the current D started
        self.stream_started = 0.0
        # The express lane (context.ExpressLane), when the runner opens it: whether its way out takes a write now,
        # and where a chunk's delta goes from the connection's read.
        self._ready: Callable[[], bool] | None = None
        self._deliver: Callable[[Delta], None] | None = None

    def open_express(self, ready: Callable[[], bool], deliver: Callable[[Delta], None]) -> None:
        """D's plain chunks may skip the iterator: ``deliver`` gets their deltas while ``ready()`` (ChunkSink)."""
        self._ready, self._deliver = ready, deliver

    def ready(self) -> bool:
        return self._ready is not None and self._ready()

    @property
    def lane_ready(self) -> Callable[[], bool] | None:
        """The way out's own ``ready`` once the lane is open (what ``ready`` asks)."""
        return self._ready

    def take(self, chunk: Chunk) -> None:
        delta = self._take(chunk)
        if delta is not None and self._deliver is not None:
            self._deliver(delta)

    def _detokenize(self, ids: Sequence[int]) -> str:
        hidden = self.ctx.hidden
        if len(ids) == 1:  # the usual chunk: one token
            return "" if ids[0] in hidden else self.detok.add(ids)
        return self.detok.add([i for i in ids if i not in hidden])

    async def first(self) -> AsyncIterator[Delta]:
        """P's token as the answer's first: the client gets it now, D continues after it."""
        ctx, req = self.ctx, self.ctx.request
        if ctx.first_token is None:
            return
        first = ctx.first_token
        self.d_prompt, self.d_max_tokens = [*ctx.prompt_ids, first], max(1, req.max_tokens - 1)
        if ctx.first_finish == "stop" or req.max_tokens == 1:
            self.done_at_first = "stop" if ctx.first_finish == "stop" else "length"
            self.d_max_tokens = 1
        ctx.output_ids.append(first)
        first_lps = [ctx.first_logprob] if ctx.first_logprob else []
        ctx.output_logprobs.extend(first_lps)
        ctx.timings["ttft_ms"] = elapsed_ms(ctx.started)
        piece = self._detokenize([first])
        if piece:
            yield Delta(piece, [first], first_lps or None)
        else:
            self.pending.append(first)
            self.pending_lps.extend(first_lps)

    async def stream(self) -> AsyncIterator[Delta]:
        """D's tokens as text deltas, from the D the turn's plan names. DecodeFailed when D fails mid-answer."""
        rt, ctx, req = self.rt, self.ctx, self.ctx.request
        output = ctx.output_ids
        engine = rt.engine(ctx.plan.decode)
        self.before = before = len(output)
        done_at_first = self.done_at_first
        span = tracer.start_span("decode", context=trace.set_span_in_context(ctx.span),
                                 attributes={"kvshuttle.worker": ctx.plan.decode.worker_id})
        self.stream_started = time.perf_counter()
        try:
            # When the answer already ended at P's token, D still runs one step: it reads the prompt's KV
            # (releasing P's blocks) and keeps prompt + first token for the next turn; its token is dropped.
            async for item in stream_tokens(
                    rt, engine, f"{ctx.id}-d{self.attempt or ''}", self.d_prompt, span, max_tokens=self.d_max_tokens,
                    min_tokens=0 if done_at_first else min(max(req.min_tokens - len(output), 0), self.d_max_tokens),
                    stop=req.stop, kv_transfer_params=ctx.decode_params, cache_salt=rt.cache_salt(req.tenant),
                    **req.engine_sampling(),
                    constraint=(req.constraint.kind, req.constraint.value) if req.constraint else None,
                    express=self if self._deliver is not None and not done_at_first else None):
                if isinstance(item, Final):
                    self.final = item
                    break
                delta = self._take(item)
                if delta is not None:
                    yield delta
        except EngineError as exc:
            span.record_exception(exc)
            span.set_status(trace.StatusCode.ERROR, str(exc))
            if exc.code == grpc.StatusCode.INVALID_ARGUMENT:
                raise TurnError(400, exc.code, f"the decode worker refused the request: {exc.message}") from None
            if not done_at_first and len(output) >= req.max_tokens:  # only D's final message was lost
                log.warning("turn %s: decode worker %s failed after the last token (%s); the answer is complete "
                            "but the session keeps no KV for its next turn", ctx.id, ctx.plan.decode.worker_id, exc)
                ctx.kv.worker_failures.append(f"decode worker {ctx.plan.decode.worker_id} failed after the "
                                              f"last token ({exc})")
                metrics.worker_failed("decode")
                self.final = Final([], "length", len(self.d_prompt), 0, 0, None)
            else:
                self.attempt += 1
                raise DecodeFailed(ctx.plan.decode.worker_id, exc) from None
        finally:
            span.set_attribute("kvshuttle.generated_tokens", len(output) - before)
            span.end()

    def _take(self, item: Chunk) -> Delta | None:
        """One of D's chunks into the answer: its delta, or None while it adds no text (held back, hidden)."""
        if not item.token_ids or self.done_at_first:
            return None
        ctx = self.ctx
        output = ctx.output_ids
        if not output:
            ctx.timings["ttft_ms"] = elapsed_ms(ctx.started)
            if ctx.kv.decision == "local":  # D's prefill: what the scheduler's cost model learns
                ctx.timings["prefill_ms"] = elapsed_ms(self.stream_started)
        ids, lps = item.token_ids, item.logprobs
        output.extend(ids)
        self.pending.extend(ids)
        if lps:
            ctx.output_logprobs.extend(lps)
            self.pending_lps.extend(lps)
        piece = (("" if ids[0] in ctx.hidden else self.detok.add(ids)) if len(ids) == 1 else
                 self._detokenize(ids))
        if not piece:
            return None
        delta = Delta(piece, self.pending, self.pending_lps or None)
        self.pending, self.pending_lps = [], []
        return delta

    def resumed(self, d_prompt: list[int]) -> None:
        """The runner moved the turn to a new D (``ctx.plan``, ``ctx.decode_params``) whose prompt is ``d_prompt``
        (the prompt and the tokens already generated): the next ``stream`` goes on there."""
        self.d_prompt = d_prompt
        self.d_max_tokens = 1 if self.done_at_first else self.ctx.request.max_tokens - len(self.ctx.output_ids)

    async def finish(self) -> AsyncIterator[Delta]:
        """What came with D's final message, and what the detokenizer held back."""
        ctx = self.ctx
        output, output_lps = ctx.output_ids, ctx.output_logprobs
        ctx.timings["decode_ms"] = elapsed_ms(self.started)
        final = self.final
        if final is None:
            raise TurnError(503, grpc.StatusCode.UNAVAILABLE, "decode stream ended without a final message")
        late = ""
        if self.done_at_first:
            final = dataclasses.replace(final, finish_reason=self.done_at_first)
        elif final.output_ids and len(final.output_ids) > len(output) - self.before:
            fed = len(output)  # non-streaming engines report everything at the end
            output[:] = [*output[:self.before], *final.output_ids]
            output_lps[:] = [*output_lps[:self.before], *(final.logprobs or ())]
            self.pending = [*self.pending, *output[fed:]]
            self.pending_lps = [*self.pending_lps, *output_lps[fed:]]
            late = self._detokenize(output[fed:])
        tail = late + self.detok.finish()  # what came at the end, and what was held back (e.g. a partial character)
        if self.pending or tail:
            yield Delta(tail, self.pending, self.pending_lps or None)
        ctx.text, ctx.final = self.detok.text, final
        ctx.timings.setdefault("ttft_ms", elapsed_ms(ctx.started))


async def run(rt: TurnServices, ctx: TurnContext) -> AsyncIterator[Delta]:
    """The stage alone, on one D (no resume: DecodeFailed when D fails); the runner drives Decoding itself."""
    decoding = Decoding(rt, ctx)
    async for delta in decoding.first():
        yield delta
    async for delta in decoding.stream():
        yield delta
    async for delta in decoding.finish():
        yield delta


class StallWatchdog:
    """Bounds each wait for a stream's next item to ``timeout_s``, as ``asyncio.wait_for`` around each wait would,
    for one timer per stream instead of a task, a future and a timer per item: ``waiting`` and ``done`` mark a
    wait (a clock read), and the timer, when it fires, re-arms itself at the current wait's deadline, or cancels
    the waiting task once a wait has lasted ``timeout_s``. After a CancelledError out of the wait, ``stalled`` says
    whether it was the watchdog's (then the task's cancellation is undone, as ``asyncio.timeout`` does)."""

    __slots__ = ("timeout_s", "_loop", "_task", "_since", "_handle", "_cancelling", "_fired")

    def __init__(self, timeout_s: float):
        self.timeout_s = timeout_s
        self._loop = asyncio.get_running_loop()
        self._task: asyncio.Task | None = None
        self._since: float | None = None  # when the current wait began (loop time); None between waits
        self._handle: asyncio.TimerHandle | None = None
        self._cancelling = 0
        self._fired = False

    def waiting(self) -> None:
        """The current task starts waiting for the next item (call right before the await)."""
        self._since = now = self._loop.time()
        self._task = asyncio.current_task(self._loop)  # the loop given: no get_running_loop (a getpid on 3.11)
        if self._handle is None:
            self._handle = self._loop.call_at(now + self.timeout_s, self._check)

    def done(self) -> None:
        """The wait is over (an item, the end, an error)."""
        self._since = None

    def progress(self) -> None:
        """An item came while the task waits (taken elsewhere: the express lane): the wait starts again."""
        if self._since is not None:
            self._since = self._loop.time()

    def _check(self) -> None:
        self._handle = None
        since = self._since
        if since is None or self._task is None:
            return  # between waits: the next wait arms the timer again
        due = since + self.timeout_s
        if due - self._loop.time() > 0.001:
            self._handle = self._loop.call_at(due, self._check)
            return
        self._fired = True
        self._cancelling = self._task.cancelling()
        self._task.cancel()

    def stalled(self) -> bool:
        """Whether the CancelledError the wait raised was the watchdog's (a cancellation from elsewhere stays)."""
        if not self._fired or self._task is None:
            return False
        self._fired = False
        return self._task.uncancel() <= self._cancelling

    def close(self) -> None:
        self._since = None
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None


async def stream_tokens(rt: TurnServices, engine: EngineClient, request_id: str, prompt: list[int], span,
                        express: ChunkSink | None = None, **kwargs: Any) -> AsyncIterator[Any]:
    """D's stream, each item awaited at most ``decode_stall_timeout_s`` (a hung worker fails like a dead one; a
    chunk taken by ``express`` counts as an item). The call is made with ``span`` current (its client span is a
    child), which is never current across a yield."""
    watchdog = StallWatchdog(rt.decode_stall_timeout_s)
    if express is not None:
        express = _Watched(express, watchdog)
    stream = engine.generate(request_id, prompt, stream=True, express=express, **kwargs).__aiter__()
    # The call starts in the first read: only that one needs ``span`` current (trace.use_span without its context
    # manager's cost); the later reads are the same call's.
    token = otel_context.attach(trace.set_span_in_context(span))
    try:
        while True:
            watchdog.waiting()
            try:
                item = await anext(stream)
            except StopAsyncIteration:
                return
            except asyncio.CancelledError:
                if watchdog.stalled():
                    raise EngineError(grpc.StatusCode.DEADLINE_EXCEEDED,
                                      f"no token for {rt.decode_stall_timeout_s:g} s") from None
                raise
            finally:
                watchdog.done()
                if token is not None:
                    otel_context.detach(token)
                    token = None
            yield item
    finally:
        watchdog.close()
        await stream.aclose()


class _Watched:
    """A ChunkSink whose every chunk also tells the stall watchdog that D is alive."""

    __slots__ = ("ready", "_take", "_progress")

    def __init__(self, sink: ChunkSink, watchdog: StallWatchdog):
        # A Decoding's own way out's ``ready`` when it has one (one call less per chunk than its method).
        self.ready = getattr(sink, "lane_ready", None) or sink.ready
        self._take, self._progress = sink.take, watchdog.progress

    def take(self, chunk: Chunk) -> None:
        self._progress()
        self._take(chunk)
