"""The gateway's gRPC API (kvshuttle.v1.Gateway): the same turns as the HTTP API, as protobuf. It translates the
protos' spelling only: the turn's rules are turns/builder.py's (its answers are the raw text: no parsers)."""

from __future__ import annotations

import hmac
import logging
from collections.abc import Sequence
from typing import Any

import grpc
from google.protobuf import duration_pb2, json_format, unknown_fields
from google.protobuf.message import DecodeError, Message
from google.rpc import code_pb2, error_details_pb2, status_pb2
from kvshuttle.control_plane.answer_blocks import APPENDED, REASONING_BLOCK, TEXT_BLOCK, AnswerBlocks, Step
from kvshuttle.services.gateway.edge import input_check
from kvshuttle.services.gateway.edge.auth import AuthError, KeyRing, Principal
from kvshuttle.services.gateway.edge.tenant_limits import TenantQuotas
from kvshuttle.services.gateway.turns import Delta, Finished, KvOutcome, TurnContext, TurnError, TurnRequest, TurnRunner
from kvshuttle.services.gateway.turns.builder import TurnBuilder
from kvshuttle.services.gateway.turns.catalog import AdapterSource, ModelCatalog, ServedModel
from kvshuttle.services.gateway.turns.reply import Usage, drain
from kvshuttle.v1 import gateway_pb2, gateway_pb2_grpc, scheduler_pb2

log = logging.getLogger(__name__)
_DECISIONS = {"pull": scheduler_pb2.DECISION_PULL, "recompute": scheduler_pb2.DECISION_RECOMPUTE,
              "local": scheduler_pb2.DECISION_LOCAL}


def kv_report(kv: KvOutcome) -> gateway_pb2.KvReport:
    return gateway_pb2.KvReport(
        decision=_DECISIONS[kv.decision], reason=kv.reason, reason_code=kv.reason_code, pulled_tokens=kv.pulled_tokens,
        computed_tokens=kv.computed_tokens, retried_as_recompute=kv.retried_as_recompute,
        prefill_worker_id=kv.prefill_worker_id, decode_worker_id=kv.decode_worker_id, figures=kv.figures,
        worker_failures=kv.worker_failures, session_source=kv.session_source, session_id=kv.session_id,
        record=kv.record, record_error=kv.record_error)


def turn_timings(t: dict[str, float]) -> gateway_pb2.TurnTimings:
    return gateway_pb2.TurnTimings(**{f.name: t.get(f.name, 0.0) for f in gateway_pb2.TurnTimings.DESCRIPTOR.fields})


def usage(f: Finished) -> gateway_pb2.Usage:
    used = Usage.of(f)
    return gateway_pb2.Usage(prompt_tokens=used.prompt, completion_tokens=used.completion, total_tokens=used.total,
                             cached_tokens=used.cached)


def unknown_field(msg: Message, path: str = "") -> str | None:
    """The first field of ``msg`` (or of a message in it) that this gateway's protos do not know, as
    ``path#number``: a client built from newer protos sent it, and this gateway would not apply it."""
    found = unknown_fields.UnknownFieldSet(msg)
    if len(found):
        return f"{path or msg.DESCRIPTOR.name}#{found[0].field_number}"
    for fd, value in msg.ListFields():
        if fd.message_type is None or fd.message_type.GetOptions().map_entry:
            continue
        for i, item in enumerate(value if fd.is_repeated else [value]):
            name = f"{path}.{fd.name}" if path else fd.name
            inner = unknown_field(item, f"{name}[{i}]" if fd.is_repeated else name)
            if inner:
                return inner
    return None


async def _internal(context, what: str) -> None:
    """INTERNAL with a message for an unexpected error (logged with its traceback), never an unhandled exception."""
    log.exception("gRPC Gateway API: %s failed", what)
    await context.abort(grpc.StatusCode.INTERNAL, f"internal error in {what}")


BRIDGED = "x-kvshuttle-bridged"  # metadata: the call comes from this gateway's REST bridge (value: its token)


def trailers(exc: TurnError) -> tuple[tuple[str, str | bytes], ...]:
    """A failed call's trailing metadata: with a retry delay, ``retry-after`` (whole seconds, as HTTP's) and
    google.rpc.RetryInfo in ``grpc-status-details-bin`` (the rich error model clients read)."""
    if not exc.retry_after_s:
        return ()
    info = error_details_pb2.RetryInfo(retry_delay=duration_pb2.Duration(seconds=int(exc.retry_after_s)))
    status = status_pb2.Status(code=getattr(code_pb2, exc.code.name), message=exc.message)
    status.details.add().Pack(info)
    return (("retry-after", str(exc.retry_after_s)), ("grpc-status-details-bin", status.SerializeToString()))


async def abort(context, exc: TurnError) -> None:
    await context.abort(exc.code, exc.message, trailing_metadata=trailers(exc))


class _Undecodable:
    """A request protobuf could not decode (e.g. a string field that is not UTF-8)."""

    def __init__(self, error: str):
        self.error = error


def _decoder(message_class):
    def decode(data: bytes):
        try:
            return message_class.FromString(data)
        except DecodeError as exc:
            return _Undecodable(str(exc))
    return decode


def _refusing_undecodable(method, streaming: bool):
    """``method``, but INVALID_ARGUMENT for a request protobuf could not decode (gRPC alone answers UNKNOWN)."""
    if streaming:
        async def stream(request, context):
            if isinstance(request, _Undecodable):
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"undecodable request: {request.error}")
            async for item in method(request, context):
                yield item
        return stream

    async def unary(request, context):
        if isinstance(request, _Undecodable):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"undecodable request: {request.error}")
        return await method(request, context)
    return unary


def add_gateway_servicer(servicer: gateway_pb2_grpc.GatewayServicer, server) -> None:
    """gateway_pb2_grpc.add_GatewayServicer_to_server, except that a request that does not decode (text that is not
    UTF-8) is INVALID_ARGUMENT with a message."""
    service = gateway_pb2.DESCRIPTOR.services_by_name["Gateway"]
    handlers = {}
    for method in service.methods:
        make = grpc.unary_stream_rpc_method_handler if method.server_streaming else grpc.unary_unary_rpc_method_handler
        handlers[method.name] = make(
            _refusing_undecodable(getattr(servicer, method.name), method.server_streaming),
            request_deserializer=_decoder(getattr(gateway_pb2, method.input_type.name)),
            response_serializer=getattr(gateway_pb2, method.output_type.name).SerializeToString)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service.full_name, handlers),))
    server.add_registered_method_handlers(service.full_name, handlers)


def _limit(turn: TurnContext) -> dict[str, Any]:
    """The answer's limit and where it came from (the responses' max_tokens, max_tokens_source)."""
    return {"max_tokens": turn.request.max_tokens or 0, "max_tokens_source": turn.request.max_tokens_source}


class GatewayServicer(gateway_pb2_grpc.GatewayServicer):
    def __init__(self, runner: TurnRunner, served_model: str, default_max_tokens: int, keys: KeyRing | None = None,
                 quotas: TenantQuotas | None = None, bridge_token: str = "", *, reasoning_parser: str = "",
                 more_models: Sequence[ServedModel] = (), adapters: AdapterSource | None = None):
        """``keys``: API keys (metadata ``authorization: Bearer <key>``); none: open, every caller the default
        tenant. ``quotas``: the tenants' limits (requests per second are counted here, except for calls from this
        gateway's REST bridge, which the HTTP guard counted: they carry ``bridge_token`` in BRIDGED).
        ``reasoning_parser``: the gateway's (vLLM's names): a chat answer's reasoning is split from its content, as
        in the HTTP APIs (the gRPC API takes no tools, so no calls are parsed). ``served_model`` on ``runner`` is
        the default of a request that names no model; ``more_models`` are served too, and the adapters of these
        that ``adapters`` lists."""
        self.runner = runner  # the default model's: ending a session goes through it (the registry is every model's)
        self.models = ModelCatalog([ServedModel(served_model, runner, TurnBuilder(
            served_model, default_max_tokens, reasoning_parser=reasoning_parser)), *more_models], adapters)
        self.keys = keys or KeyRing()
        self.quotas = quotas
        self.bridge_token = bridge_token.encode()

    def _caller(self, context) -> Principal:
        metadata = dict(context.invocation_metadata() or ())
        header = metadata.get("authorization")
        try:
            who = self.keys.from_header(header if isinstance(header, str) else None)
        except AuthError as exc:
            raise TurnError(401, grpc.StatusCode.UNAUTHENTICATED,
                            f"{exc} (gRPC metadata 'authorization: Bearer <key>')") from None
        bridged = metadata.get(BRIDGED)
        if self.quotas is not None and not (
                self.bridge_token and isinstance(bridged, str)
                and hmac.compare_digest(bridged.encode(), self.bridge_token)):
            refused = self.quotas.check_request(who.tenant)
            if refused is not None:
                raise refused
        return who

    def _authorized(self, req_fn, msg, context) -> TurnRequest:
        """The turn for ``msg``, as the caller's tenant (the key decides it; nothing in the request can)."""
        caller = self._caller(context)
        req = req_fn(msg, caller)
        req.tenant = caller.tenant
        return req

    async def EndSession(self, request: gateway_pb2.EndSessionRequest, context) -> gateway_pb2.EndSessionResponse:
        try:
            caller = self._caller(context)
            deleted, released = await self.runner.end_session(caller.tenant, request.session_id)
        except TurnError as exc:
            await abort(context, exc)
        except grpc.aio.AbortError:
            raise
        except Exception:
            await _internal(context, "EndSession")
        return gateway_pb2.EndSessionResponse(deleted=deleted, kv_released=released)

    def _request(self, msg, who: Principal, **prompt) -> TurnRequest:
        builder = self.models.get(msg.model, allowed=who.models).builder
        unknown = unknown_field(msg)
        if unknown:
            raise TurnError(400, grpc.StatusCode.INVALID_ARGUMENT,
                            f"unknown field {unknown}: this gateway does not apply it")
        try:  # the same check as the HTTP front ends' (edge/http_entry.py), on the message as proto-JSON
            input_check.check(json_format.MessageToDict(msg, preserving_proto_field_name=True), input_check.PROTO)
        except input_check.InputError as exc:
            raise TurnError(400, grpc.StatusCode.INVALID_ARGUMENT, str(exc)) from None
        s = msg.sampling
        return builder.request(
            session_id=msg.session_id, max_tokens=s.max_tokens, temperature=s.temperature, top_p=s.top_p or 1.0,
            seed=s.seed if s.HasField("seed") else None, ignore_eos=s.ignore_eos, stop=list(s.stop),
            disable_pull=msg.disable_pull, policy=msg.policy, top_k=s.top_k, min_p=s.min_p,
            presence_penalty=s.presence_penalty, frequency_penalty=s.frequency_penalty,
            repetition_penalty=s.repetition_penalty if s.HasField("repetition_penalty") else 1.0,
            min_tokens=s.min_tokens, stop_token_ids=list(s.stop_token_ids), logit_bias=dict(s.logit_bias),
            include_stop_str_in_output=s.include_stop_str_in_output,
            skip_special_tokens=s.skip_special_tokens if s.HasField("skip_special_tokens") else True,
            spaces_between_special_tokens=(s.spaces_between_special_tokens
                                           if s.HasField("spaces_between_special_tokens") else True),
            **prompt)

    def _complete_request(self, msg: gateway_pb2.CompleteRequest, who: Principal) -> TurnRequest:
        if msg.prompt and msg.prompt_token_ids:
            raise TurnError(400, grpc.StatusCode.INVALID_ARGUMENT, "give prompt or prompt_token_ids, not both")
        if msg.prompt_token_ids:
            return self._request(msg, who, prompt_ids=list(msg.prompt_token_ids))
        if not msg.prompt:
            raise TurnError(400, grpc.StatusCode.INVALID_ARGUMENT, "prompt or prompt_token_ids is required")
        return self._request(msg, who, prompt_text=msg.prompt)

    def _chat_request(self, msg: gateway_pb2.ChatCompleteRequest, who: Principal) -> TurnRequest:
        roles = {"system", "developer", "user", "assistant", "tool"}
        bad = [m.role for m in msg.messages if m.role not in roles]
        if bad:
            raise TurnError(400, grpc.StatusCode.INVALID_ARGUMENT, f"unknown message role {bad[0]!r}")
        reasoned = [i for i, m in enumerate(msg.messages) if m.reasoning_content and m.role != "assistant"]
        if reasoned:
            raise TurnError(400, grpc.StatusCode.INVALID_ARGUMENT,
                            f"messages[{reasoned[0]}].reasoning_content: only an assistant message has reasoning")
        return self._request(msg, who, messages=[_template_message(m) for m in msg.messages])

    async def _prepare(self, req: TurnRequest, context) -> TurnContext:
        turn = await self.models.runner_of(req).prepare(req)
        await context.send_initial_metadata((
            ("x-kv-decision", turn.kv.decision),
            ("x-kv-reason", turn.kv.reason.encode("ascii", "replace").decode()),
            ("x-kv-reason-code", turn.kv.reason_code),
            ("x-kv-pulled-tokens", str(turn.kv.pulled_tokens)),
        ))
        return turn

    async def _unary(self, req_fn, msg, context):
        try:
            req = self._authorized(req_fn, msg, context)
            turn = await self._prepare(req, context)
            return turn, await drain(self.models.runner_of(turn.request), turn)
        except TurnError as exc:
            await abort(context, exc)
        except grpc.aio.AbortError:
            raise
        except Exception:
            await _internal(context, "a turn")

    async def Complete(self, request, context):
        turn, f = await self._unary(self._complete_request, request, context)
        return gateway_pb2.CompleteResponse(
            id=turn.id, model=turn.request.model, text=f.text, token_ids=f.output_ids, prompt_token_ids=turn.prompt_ids,
            finish_reason=f.finish_reason, usage=usage(f), kv=kv_report(f.kv), timings=turn_timings(f.timings),
            **_limit(turn))

    async def ChatComplete(self, request, context):
        turn, f = await self._unary(self._chat_request, request, context)
        blocks = AnswerBlocks()  # the answer layer every API spells (control_plane/answer_blocks.py)
        blocks.whole(f.answer_events)
        message = gateway_pb2.ChatMessage(role="assistant", content=blocks.joined(TEXT_BLOCK) or "",
                                          reasoning_content=blocks.joined(REASONING_BLOCK) or "")
        return gateway_pb2.ChatCompleteResponse(
            id=turn.id, model=turn.request.model, message=message, token_ids=f.output_ids,
            prompt_token_ids=turn.prompt_ids, finish_reason=blocks.finish_reason(f.finish_reason), usage=usage(f),
            kv=kv_report(f.kv), timings=turn_timings(f.timings), **_limit(turn))

    async def _stream(self, req_fn, msg, context, chat: bool = False):
        """The turn's events; a chat's deltas also carry their content and reasoning (the answer layer's)."""
        try:
            turn = await self._prepare(self._authorized(req_fn, msg, context), context)
            yield gateway_pb2.TurnEvent(started=gateway_pb2.TurnEvent.Started(
                id=turn.id, model=turn.request.model, kv=kv_report(turn.kv), prompt_tokens=len(turn.prompt_ids),
                **_limit(turn)))
            blocks = AnswerBlocks()
            async for event in self.models.runner_of(turn.request).decode(turn):
                if isinstance(event, Delta):
                    parts = _parts(blocks.feed(event.events)) if chat else {}
                    yield gateway_pb2.TurnEvent(delta=gateway_pb2.TurnEvent.Delta(
                        text=event.text, token_ids=event.token_ids, **parts))
                    continue
                if chat and (parts := _parts(blocks.finish(event.events))):
                    yield gateway_pb2.TurnEvent(delta=gateway_pb2.TurnEvent.Delta(**parts))
                yield gateway_pb2.TurnEvent(finished=gateway_pb2.TurnEvent.Finished(
                    finish_reason=blocks.finish_reason(event.finish_reason), usage=usage(event),
                    kv=kv_report(event.kv), timings=turn_timings(event.timings)))
        except TurnError as exc:
            await abort(context, exc)
        except grpc.aio.AbortError:
            raise
        except Exception:
            await _internal(context, "a streamed turn")

    async def CompleteStream(self, request, context):
        async for event in self._stream(self._complete_request, request, context):
            yield event

    async def ChatCompleteStream(self, request, context):
        async for event in self._stream(self._chat_request, request, context, chat=True):
            yield event


def _template_message(m: gateway_pb2.ChatMessage) -> dict[str, str]:
    """A history message as the chat template gets it: a name as vLLM passes it (templates that do not use it
    ignore it), an assistant's reasoning under both of vLLM's names (as the HTTP chat API gives it)."""
    out = {"role": m.role, "content": m.content}
    if m.name:
        out["name"] = m.name
    if m.reasoning_content:
        out["reasoning_content"] = out["reasoning"] = m.reasoning_content
    return out


def _parts(steps: list[Step]) -> dict[str, str]:
    """What the answer layer's steps add to the content and to the reasoning (only the parts that are not empty)."""
    content = "".join(text for kind, block, text in steps if kind == APPENDED and block.kind == TEXT_BLOCK)
    reasoning = "".join(text for kind, block, text in steps if kind == APPENDED and block.kind == REASONING_BLOCK)
    return {k: v for k, v in (("content", content), ("reasoning_content", reasoning)) if v}
