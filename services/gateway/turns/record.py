"""Stage 5, the record: the registry keeps D's handle and the exact ids (with the text they stand for) for the next
turn. And the KV nothing will read is freed on its decode worker: a session's previous handle when this turn
recomputed, and the handle of a turn nothing records."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

import grpc
from kvshuttle.control_plane import kv_params
from kvshuttle.control_plane import reasons as why
from kvshuttle.control_plane import session as session_rules
from kvshuttle.control_plane.continuation import text_key
from kvshuttle.control_plane.prefix import PrefixHasher, checkpoint_lengths
from kvshuttle.services.engine.client import EngineError, Final
from kvshuttle.services.gateway.turns.context import TurnContext
from kvshuttle.services.gateway.turns.spans import release_span, tracer
from kvshuttle.v1 import common_pb2, registry_pb2, scheduler_pb2
from opentelemetry import trace

if TYPE_CHECKING:
    from kvshuttle.services.gateway.turns.services import TurnServices

log = logging.getLogger(__name__)
_DIGEST_INLINE_IDS = 1 << 16  # digests of longer histories are computed in a thread


async def run(rt: TurnServices, ctx: TurnContext) -> None:
    """Record the turn's handle and exact ids, with the text they stand for *as the client received it*: the
    prompt's text, the answer's text (special tokens skipped if the request skipped them, hidden stop tokens left
    out), and the end-of-turn marker's text when the answer ended with one (the chat template writes it after the
    echoed answer). A client that echoes the answer back then renders a prompt that starts with this text, and the
    next turn continues the exact ids (special tokens included). Timing: ``record_ms``."""
    t = time.perf_counter()
    try:
        await _record(rt, ctx)
    finally:
        ctx.timings["record_ms"] = round((time.perf_counter() - t) * 1000, 3)


async def _record(rt: TurnServices, ctx: TurnContext) -> None:
    req, final, output = ctx.request, ctx.final, ctx.output_ids
    assert final is not None, "the decode stage ends with D's final message"
    if not req.session_id:
        ctx.kv.record = why.UNRECORDED
        free_unrecorded(rt, ctx)
        return
    if not final.kv_transfer_params:
        log.warning("decode worker returned no KV handle for turn %s: nothing to record", ctx.id)
        ctx.kv.record, ctx.kv.record_error = why.NO_HANDLE, "the decode worker returned no KV handle"
        return
    if ctx.release is not None:  # it claims the old record: before this turn replaces it
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.shield(ctx.release), rt.control_timeout_s)
    with trace.use_span(ctx.span, end_on_exit=False), tracer.start_as_current_span("record") as span:
        recorded_text = (ctx.prompt_text + ctx.text + end_marker(rt, output, ctx.hidden)) if ctx.prompt_text else ""
        rt.forget_record(req.tenant, req.session_id)
        ids = [*ctx.prompt_ids, *output]
        try:
            handle_json = json.dumps(final.kv_transfer_params)
            resp = await _record_turn(rt, ctx, ids, recorded_text, handle_json)
            own = common_pb2.Session()
            own.CopyFrom(resp.session)
            own.token_ids.extend(ids)  # this gateway's copy keeps the ids and the handle: its next turn reads nothing
            own.kv_transfer_params_json = own.kv_transfer_params_json or handle_json
            rt.keep_record(req.tenant, req.session_id, own)
            ctx.span.set_attribute("kvshuttle.turn_index", resp.session.turn)
            ctx.kv.record = why.RECORDED
        except grpc.aio.AioRpcError as exc:
            # The answer is fine; only the next turn loses its pull: the turn says so (body, header, KvReport,
            # metric), not only this log.
            ctx.kv.record = why.record_outcome(exc.code().name)
            ctx.kv.record_error = f"{exc.code().name}: {exc.details()}"
            span.set_attribute("error.type", exc.code().name)
            span.set_status(trace.StatusCode.ERROR, f"RecordTurn failed: {exc.code().name}")
            rt.degraded["record_failed"] += 1
            log.warning("could not record turn %s (%s: %s): the next turn cannot pull it (%d unrecorded turns)",
                        ctx.id, exc.code().name, exc.details(), rt.degraded["record_failed"])
            free_unrecorded(rt, ctx)


async def _record_turn(rt: TurnServices, ctx: TurnContext, ids: list[int], text: str,
                       handle_json: str) -> registry_pb2.RecordTurnResponse:
    """RecordTurn with only the ids after those the prompt kept of the recorded history when it continued it (all
    of them, or those up to a text boundary: the history store keeps them), and the prefix digests computed here
    over all ``ids``; once more with the whole history if the record changed meanwhile."""
    req, base = ctx.request, ctx.history_base
    try:
        covered = kv_params.parse_handle(handle_json).num_tokens
    except kv_params.HandleError:
        covered = 0  # the registry refuses the handle, and says why
    if not 0 < covered <= len(ids):
        covered, base = 0, None  # nothing to digest here: the registry checks the whole history
    kept = ctx.history_kept if base is not None else 0
    previous = [n for n in (*(cp.tokens for cp in base.checkpoints), base.covered_tokens, base.history_tokens)
                if n <= kept] if base is not None else []
    cuts = ctx.text_cuts if text else []
    lengths = checkpoint_lengths(previous, len(ctx.prompt_ids), covered,
                                 extra=[kept, *(tokens for _, tokens, _ in cuts)])
    wanted = [*lengths, covered] if covered else []
    whole = base is not None and kept == base.history_tokens  # the prompt continued all of base's ids
    hasher, digests = _resume(rt, req, base if whole else None, wanted)
    # one pass over the ids not hashed yet (all of them without a kept state: ~25 ms at 1M tokens), off the event
    # loop when long
    new = [n for n in wanted if n > hasher.length]
    if len(ids) - hasher.length > _DIGEST_INLINE_IDS:
        digests.update(await asyncio.to_thread(hasher.digests_along, ids, new))
    else:
        digests.update(hasher.digests_along(ids, new))
    request = registry_pb2.RecordTurnRequest(
        session_id=req.session_id, tenant=req.tenant, decode_worker_id=ctx.plan.decode.worker_id,
        kv_transfer_params_json=handle_json, text_chars=len(text), text_key=text_key(text) if text else b"",
        prefix_digest=digests.get(covered, b""),
        checkpoints=[common_pb2.PrefixCheckpoint(tokens=n, digest=digests[n]) for n in lengths],
        text_boundaries=text_boundaries(text, cuts), model=req.model)
    if base is not None and 0 < kept <= min(base.history_tokens, len(ids)):
        # only the ids after those the prompt kept of the record's (the registry appends them to its lineage, or
        # starts a new lineage with the kept ones copied inside the history store)
        request.base_tokens, request.base_turn = kept, base.turn
        request.token_ids.extend(ids[kept:])
        try:
            return _kept(rt, req, await rt.registry.RecordTurn(request, timeout=rt.control_timeout_s), hasher)
        except grpc.aio.AioRpcError as exc:
            if exc.code() != grpc.StatusCode.FAILED_PRECONDITION or "history changed" not in (exc.details() or ""):
                raise
            request.ClearField("token_ids")
            request.base_tokens = request.base_turn = 0
    request.token_ids.extend(ids)
    return _kept(rt, req, await rt.registry.RecordTurn(request, timeout=rt.control_timeout_s), hasher)


def text_boundaries(text: str, cuts: Sequence[tuple[int, int, bool]]) -> list[common_pb2.TextBoundary]:
    """The record's boundaries for ``cuts`` (chars, tokens, loop_start) of ``text``, keyed in one pass."""
    hasher, done, out = hashlib.sha256(), 0, []
    for chars, tokens, loop_start in cuts:
        hasher.update(text[done:chars].encode())
        done = chars
        out.append(common_pb2.TextBoundary(key=hasher.copy().digest(), chars=chars, tokens=tokens,
                                           loop_start=loop_start))
    return out


def _resume(rt: TurnServices, req, base: common_pb2.Session | None,
            wanted: list[int]) -> tuple[PrefixHasher, dict[int, bytes]]:
    """The digest state to continue from, and the digests of ``wanted`` lengths it already covers: this gateway's
    state over ``base``'s whole history when it kept one (the lengths within it come from ``base``'s own digests),
    else a fresh state (every length hashed)."""
    hasher = rt.history_hasher(req.tenant, req.session_id, base) if base is not None else None
    if hasher is None:
        return PrefixHasher(), {}
    known = {cp.tokens: cp.digest for cp in base.checkpoints}
    known[base.covered_tokens] = base.prefix_digest
    known[hasher.length] = hasher.digest()
    if any(n <= hasher.length and n not in known for n in wanted):
        return PrefixHasher(), {}
    return hasher, {n: known[n] for n in wanted if n <= hasher.length}


def _kept(rt: TurnServices, req, resp: registry_pb2.RecordTurnResponse,
          hasher: PrefixHasher) -> registry_pb2.RecordTurnResponse:
    """Keep the digest state over the recorded history for the session's next turn on this gateway."""
    if req.session_id and hasher.length == resp.session.history_tokens:
        rt.keep_hasher(req.tenant, req.session_id, resp.session, hasher)
    return resp


def end_marker(rt: TurnServices, output: list[int], hidden: set[int] | frozenset[int]) -> str:
    """The text of the answer's last token when it is an EOS token left out of the answer's text."""
    eos = getattr(rt.tokenizer, "eos_token_ids", None)
    last = output[-1] if output else None
    if last is None or last not in hidden or not isinstance(eos, list) or last not in eos:
        return ""
    return rt.tokenizer.decode([last], False)


def free_unrecorded(rt: TurnServices, ctx: TurnContext) -> None:
    """A turn whose handle nothing records (no session id, or the registry could not take it) would leave its
    decode worker holding the blocks until its TTL, where no turn can pull them and the scheduler cannot find
    them (clients that send no session id would fill it): free them now, in the background (a one-block read
    on the turn's prefill worker)."""
    final: Final | None = ctx.final
    if not rt.free_unrecorded_kv or final is None or not final.kv_transfer_params:
        return
    try:
        params, prompt = kv_params.free_read(kv_params.parse_handle(final.kv_transfer_params),
                                             [*ctx.prompt_ids, *ctx.output_ids], ctx.plan.decode.block_size)
    except kv_params.HandleError as exc:
        log.debug("turn %s: its KV handle cannot be freed (%s)", ctx.id, exc)
        return

    async def free() -> None:
        try:
            if await rt.engine(ctx.plan.prefill).read_to_free(f"{ctx.id}-free", prompt, params,
                                                              timeout_s=rt.prefill_timeout_s,
                                                              cache_salt=rt.cache_salt(ctx.request.tenant),
                                                              adapter=ctx.request.adapter):
                rt.released_handles += 1
        except EngineError as exc:
            log.debug("turn %s: could not free its unrecorded KV handle: %s", ctx.id, exc)

    rt.background(free())


def release_unused_handle(rt: TurnServices, ctx: TurnContext) -> asyncio.Task | None:
    """A turn that recomputed leaves the session's previous KV handle unread, and its decode worker would keep
    those blocks until its TTL (``decoder_kv_blocks_ttl``, minutes): under steady load that fills D's KV cache
    and new turns wait for blocks. Free them: claim the handle (so no other turn can be reading it), then have
    this turn's P read its first block, whose tokens the prompt provably repeats (P usually has that block in its
    own cache just now, and then only notifies D); D frees all of a handle's blocks after any read.

    Runs in the background; the record is written only after it (the claim is at the old record's revision)."""
    req, plan = ctx.request, ctx.plan
    snapshot = ctx.known_session.snapshot
    if (plan.decision != scheduler_pb2.DECISION_RECOMPUTE or snapshot is None or not rt.release_unused_handles
            or req.disable_pull):  # a forced recompute (benchmarks, comparisons) leaves the session's KV alone
        return None
    record = snapshot.session
    if record.model != req.model:
        return None  # another model's KV: this turn's P (of the turn's model) must never read it
    n = min(record.covered_tokens, record.block_size)
    if not plan.figures.source_worker_alive or not session_rules.freeable(record, len(ctx.prompt_ids), time.time()):
        return None
    # The record's head_token_ids are its history's first ids (the digests prove only whole covered prefixes)
    if n <= 0 or len(record.head_token_ids) < n or list(ctx.prompt_ids[:n]) != list(record.head_token_ids[:n]):
        return None  # the prompt's first block differs: P must not take D's KV for it
    return asyncio.create_task(release_span(free_handle(
        rt, f"{ctx.id}-release", record, plan.prefill, ctx.prompt_ids, req.tenant, req.session_id)))


def adapter_of(record: common_pb2.Session, prefill: common_pb2.Worker) -> str | None:
    """The LoRA adapter ``record``'s KV was computed under, as ``prefill`` (of its base model) serves it; None: the
    base model's."""
    return record.model if record.model and record.model != prefill.model else None


async def free_handle(rt: TurnServices, request_id: str, record: common_pb2.Session, prefill: common_pb2.Worker,
                      ids: Sequence[int], tenant: str, session_id: str) -> bool:
    """Claim ``record``'s handle, then have ``prefill`` read its first block (from ``ids``, tokens that repeat
    the handle's: kv_params.free_read, EngineClient.read_to_free); D then frees all of the handle's blocks. Best
    effort: False when not freed."""
    try:
        params, prompt = kv_params.free_read(kv_params.parse_handle(record.kv_transfer_params_json), ids,
                                             record.block_size)
        claim = await rt.registry.ClaimSession(registry_pb2.ClaimSessionRequest(
            session_id=session_id, tenant=tenant, revision=record.revision), timeout=rt.control_timeout_s)
        if not claim.claimed:
            return False  # a concurrent turn took it (and reads it), or the record changed
        if not await rt.engine(prefill).read_to_free(request_id, prompt, params, timeout_s=rt.prefill_timeout_s,
                                                     cache_salt=rt.cache_salt(tenant),
                                                     adapter=adapter_of(record, prefill)):
            log.debug("%s: freeing a KV handle failed at the prefill worker", request_id)
            return False
    except (grpc.aio.AioRpcError, EngineError, kv_params.HandleError) as exc:
        log.debug("%s: could not free a KV handle: %s", request_id, exc)
        return False
    rt.released_handles += 1
    return True
