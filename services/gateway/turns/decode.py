"""Stage 4, the decode on D: stream D's tokens as text (P's first token first, when P sampled it); a D that fails
mid-answer is replaced (the prompt and the tokens so far are prefilled on a live P, and the stream goes on).

One text for the stream, the whole answer and the record: the concatenation of the streamed pieces (an incremental
detokenizer holds back unfinished characters).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import AsyncIterator, Sequence
from typing import TYPE_CHECKING, Any

import grpc
from kvshuttle.services.common import metrics
from kvshuttle.services.engine.client import EngineClient, EngineError, Final, TokenLogprob
from kvshuttle.services.gateway.detokenizer import IncrementalText
from kvshuttle.services.gateway.turns import plan as planning
from kvshuttle.services.gateway.turns import prefill as prefilling
from kvshuttle.services.gateway.turns.context import Delta, KvOutcome, TurnContext, TurnError, elapsed_ms
from kvshuttle.services.gateway.turns.request import TurnRequest
from kvshuttle.services.gateway.turns.spans import tracer
from opentelemetry import trace

if TYPE_CHECKING:
    from kvshuttle.services.gateway.turns.runner import TurnRunner

log = logging.getLogger(__name__)


def hidden_token_ids(rt: TurnRunner, req: TurnRequest) -> set[int]:
    """Token ids whose text is left out of the answer, as vLLM leaves out the token that stopped it: stop token
    ids, and EOS unless ignored (none with include_stop_str_in_output). Such a token can only be the answer's
    last (min_tokens keeps them from being sampled earlier), so every one in the output is left out."""
    if req.include_stop_str_in_output:
        return set()
    eos = getattr(rt.tokenizer, "eos_token_ids", None)
    return set(req.stop_token_ids) | (set(eos) if isinstance(eos, list) and not req.ignore_eos else set())


async def run(rt: TurnRunner, ctx: TurnContext) -> AsyncIterator[Delta]:
    """Yields the answer's text deltas; sets ``ctx.output_ids``, ``output_logprobs``, ``text``, ``hidden`` and
    ``final`` (D's final message)."""
    req, timings = ctx.request, ctx.timings
    output, output_lps = ctx.output_ids, ctx.output_logprobs
    pending: list[int] = []  # ids not yet sent in a Delta (held back while they end in a partial character)
    pending_lps: list[TokenLogprob] = []
    detok = IncrementalText(rt.tokenizer, req.skip_special_tokens)
    ctx.hidden = stoppers = hidden_token_ids(rt, req)

    def detokenize(ids: Sequence[int]) -> str:
        return detok.add([i for i in ids if i not in stoppers])

    final: Final | None = None
    t = time.perf_counter()
    d_prompt, d_max_tokens, done_at_first = ctx.prompt_ids, req.max_tokens, ""
    if ctx.first_token is not None:
        # P's token is the answer's first: the client gets it now, D continues after it.
        first = ctx.first_token
        d_prompt, d_max_tokens = [*ctx.prompt_ids, first], max(1, req.max_tokens - 1)
        if ctx.first_finish == "stop" or req.max_tokens == 1:
            done_at_first = "stop" if ctx.first_finish == "stop" else "length"
            d_max_tokens = 1
        output.append(first)
        first_lps = [ctx.first_logprob] if ctx.first_logprob else []
        output_lps.extend(first_lps)
        timings["ttft_ms"] = elapsed_ms(ctx.started)
        piece = detokenize([first])
        if piece:
            yield Delta(piece, [first], first_lps or None)
        else:
            pending.append(first)
            pending_lps.extend(first_lps)
    attempt, before = 0, len(output)
    while True:
        engine = rt.engine(ctx.plan.decode)
        before = len(output)
        span = tracer.start_span("decode", context=trace.set_span_in_context(ctx.span),
                                 attributes={"kvshuttle.worker": ctx.plan.decode.worker_id})
        try:
            # When the answer already ended at P's token, D still runs one step: it reads the prompt's KV
            # (releasing P's blocks) and keeps prompt + first token for the next turn; its token is dropped.
            async for item in stream_tokens(
                    rt, engine, f"{ctx.id}-d{attempt or ''}", d_prompt, span, max_tokens=d_max_tokens,
                    min_tokens=0 if done_at_first else min(max(req.min_tokens - len(output), 0), d_max_tokens),
                    stop=req.stop, kv_transfer_params=ctx.decode_params, **req.engine_sampling(),
                    constraint=(req.constraint.kind, req.constraint.value) if req.constraint else None):
                if isinstance(item, Final):
                    final = item
                    break
                if not item.token_ids or done_at_first:
                    continue
                if not output:
                    timings["ttft_ms"] = elapsed_ms(ctx.started)
                output.extend(item.token_ids)
                pending.extend(item.token_ids)
                output_lps.extend(item.logprobs or ())
                pending_lps.extend(item.logprobs or ())
                piece = detokenize(item.token_ids)
                if not piece:
                    continue
                yield Delta(piece, pending, pending_lps or None)
                pending, pending_lps = [], []
            break
        except EngineError as exc:
            span.record_exception(exc)
            span.set_status(trace.StatusCode.ERROR, str(exc))
            if exc.code == grpc.StatusCode.INVALID_ARGUMENT:
                raise TurnError(400, exc.code, f"the decode worker refused the request: {exc.message}") from None
            attempt += 1
            if not done_at_first and len(output) >= req.max_tokens:  # only D's final message was lost
                log.warning("turn %s: decode worker %s failed after the last token (%s); the answer is complete "
                            "but the session keeps no KV for its next turn", ctx.id, ctx.plan.decode.worker_id, exc)
                ctx.kv.worker_failures.append(f"decode worker {ctx.plan.decode.worker_id} failed after the "
                                              f"last token ({exc})")
                metrics.worker_failed("decode")
                final = Final([], "length", len(d_prompt), 0, 0, None)
                break
            d_prompt = await resume(rt, ctx, exc, attempt)
            d_max_tokens = 1 if done_at_first else req.max_tokens - len(output)
        finally:
            span.set_attribute("kvshuttle.generated_tokens", len(output) - before)
            span.end()
    timings["decode_ms"] = elapsed_ms(t)
    if final is None:
        raise TurnError(503, grpc.StatusCode.UNAVAILABLE, "decode stream ended without a final message")
    late = ""
    if done_at_first:
        final = dataclasses.replace(final, finish_reason=done_at_first)
    elif final.output_ids and len(final.output_ids) > len(output) - before:
        fed = len(output)  # non-streaming engines report everything at the end
        output[:] = [*output[:before], *final.output_ids]
        output_lps[:] = [*output_lps[:before], *(final.logprobs or ())]
        pending, pending_lps = [*pending, *output[fed:]], [*pending_lps, *output_lps[fed:]]
        late = detokenize(output[fed:])
    tail = late + detok.finish()  # what came at the end, and what was held back (e.g. an unfinished character)
    if pending or tail:
        yield Delta(tail, pending, pending_lps or None)
    ctx.text, ctx.final = detok.text, final
    timings.setdefault("ttft_ms", elapsed_ms(ctx.started))


async def stream_tokens(rt: TurnRunner, engine: EngineClient, request_id: str, prompt: list[int], span,
                        **kwargs: Any) -> AsyncIterator[Any]:
    """D's stream, each item awaited at most ``decode_stall_timeout_s`` (a hung worker fails like a dead one).
    The call is made with ``span`` current (its client span is a child), which is never current across a yield."""
    stream = engine.generate(request_id, prompt, stream=True, **kwargs).__aiter__()
    try:
        while True:
            try:
                with trace.use_span(span, end_on_exit=False, record_exception=False, set_status_on_exception=False):
                    item = await asyncio.wait_for(anext(stream), rt.decode_stall_timeout_s)
            except StopAsyncIteration:
                return
            except TimeoutError:
                raise EngineError(grpc.StatusCode.DEADLINE_EXCEEDED,
                                  f"no token for {rt.decode_stall_timeout_s:g} s") from None
            yield item
    finally:
        await stream.aclose()


async def resume(rt: TurnRunner, ctx: TurnContext, error: EngineError, attempt: int) -> list[int]:
    """D failed mid-answer: prefill the prompt plus the tokens already generated on a live P (a recompute), point
    the turn at a new D, and return D's new prompt. The client's stream goes on where it stopped (with greedy
    sampling, exactly as if nothing happened). TurnError (503) when no retry or no worker is left."""
    output = ctx.output_ids
    failed = ctx.plan.decode.worker_id
    ctx.excluded.append(failed)
    metrics.worker_failed("decode")
    failure = f"decode worker {failed} failed after {len(output)} tokens ({error})"
    log.warning("turn %s: %s", ctx.id, failure)
    ctx.span.add_event("worker_failed", {"kvshuttle.worker": failed, "error": str(error),
                                         "kvshuttle.generated_tokens": len(output)})
    if attempt > rt.worker_retries or (ctx.request.constraint is not None and output):
        # A constrained answer cannot go on elsewhere: a new D would start the grammar afresh mid-answer.
        why_not = "no retries left" if attempt > rt.worker_retries else "a constrained answer cannot resume"
        ctx.kv.worker_failures.append(failure)
        raise TurnError(503, grpc.StatusCode.UNAVAILABLE, f"{failure}; {why_not}", retry_after_s=1)
    resume_ids = [*ctx.prompt_ids, *output]
    scratch = KvOutcome("recompute", "resume after a decode worker failed")
    with trace.use_span(ctx.span, end_on_exit=False):
        try:
            plan = await planning.ask(rt, ctx.request, resume_ids, {}, exclude=ctx.excluded)
            plan, p_final = await prefilling.on_live_worker(rt, f"{ctx.id}-resume{attempt}", plan, resume_ids,
                                                            scratch, ctx.request, ctx.excluded)
        except TurnError as exc:
            ctx.kv.worker_failures.extend([*scratch.worker_failures, failure])
            raise TurnError(exc.http_status, exc.code, f"{failure}; {exc.message}", exc.retry_after_s) from None
    ctx.kv.worker_failures.extend(scratch.worker_failures)
    ctx.kv.worker_failures.append(f"{failure}; resumed on {plan.decode.worker_id} (prefilled "
                                  f"{len(resume_ids)} tokens on {plan.prefill.worker_id})")
    ctx.kv.decode_worker_id = plan.decode.worker_id
    ctx.plan, ctx.decode_params = plan, p_final.kv_transfer_params
    return resume_ids
