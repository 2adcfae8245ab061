"""One lane = one conversation replayed in one mode; each turn returns a measured :class:`TurnSample`.

Every lane starts its clock when it has the turn's messages and stops it at the first generated token, so the
modes pay for the same work: rendering the chat, tokenizing, and whatever sits between the client and the engines.

- :class:`GatewayLane` (modes ``pull``, ``recompute`` and ``local``): the gateway's OpenAI API, streamed (SSE); the
  local mode names a scheduler policy that continues every later turn on D.
- :class:`DirectLane` (mode ``direct``): a minimal P→D client with no registry or scheduler. It keeps D's handle in
  memory and pulls it on the next turn (what vLLM's example proxy does): the baseline for the control plane's cost.
- :class:`IdealLane` (mode ``ideal``): one vLLM worker with prefix caching and no disaggregation; the history is
  already in its cache, no KV moves. The physical limit.

The direct and ideal lanes continue the conversation's exact token ids the way the gateway does, so all modes see the
same prompts and (fp32, greedy) give the same answers.

Every lane but the ideal one also notes when each streamed token reached it (:class:`TurnStream`, ``last_stream``): a
clock reading and a list append per chunk while the stream runs, the chunks read afterwards. The report compares the
inter-token delays of D's streams while other turns prefill with those while none does.

**Tool calls.** A conversation with tools sends them with every request, and a turn that calls a tool
(:attr:`~kvshuttle.services.devtools.bench.workload.Turn.call`) names it in ``tool_choice``: the gateway forces the
call as guided decoding on D (which then samples the answer's first token too) and returns it parsed as
``message.tool_calls``. The gateway lanes echo that message back whole, ids included, and answer the call with the
next turn's ``tool`` messages. The direct and ideal lanes talk to vLLM without the gateway, so they force the same
call themselves: the same constraint (``control_plane.constraints.forced_tool_calls``, hermes syntax) on the worker
that samples the first token, the same sampling, and the answer read as the gateway's hermes parser reads it
(:func:`answer_message`), with call ids ``call_<turn>_<index>`` (chat templates do not render ids, so the prompts
are the same token for token). A random test model writes random arguments, in JSON whose free whitespace the
re-rendered echo does not reproduce (the next turn could then not continue the recorded ids, and would pull almost
nothing): with :func:`forced_call_bias` (a logit bias on ``{`` and ``}``) every forced call is ``{}``, which renders
back exactly.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import re
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import httpx
from kvshuttle.control_plane import kv_params
from kvshuttle.control_plane.constraints import CALL_SYNTAX, forced_tool_calls
from kvshuttle.control_plane.continuation import plan_continuation, text_key
from kvshuttle.services.devtools.bench.samples import IDEAL, LOCAL, TurnSample, TurnStream
from kvshuttle.services.devtools.bench.workload import CALL_MIN_TOKENS, Conversation, Turn
from kvshuttle.services.devtools.chat_stream import StreamError, stream_chat
from kvshuttle.services.engine.client import EngineClient, Final
from kvshuttle.services.gateway.tokens.tokenizer import GatewayTokenizer

DIRECT = "direct"
CALL_PARSER = "hermes"  # the tool-call syntax the bench forces (the gateway must run --tool-call-parser hermes)
CALL_BIAS = 100.0  # logit bias of "{" and "}" in forced calls: the arguments close at once


def digest(text: str) -> str:
    return hashlib.sha1(text.encode()).hexdigest()[:12]


def message_digest(message: dict[str, Any]) -> str:
    """A short hash of an answer: its content and its calls' names and arguments (not their ids)."""
    calls = [(c["function"]["name"], c["function"]["arguments"]) for c in message.get("tool_calls") or []]
    if not calls:
        return digest(message.get("content") or "")
    return digest(json.dumps([message.get("content") or "", calls], ensure_ascii=False))


_HERMES_CALL = re.compile(r"<tool_call>\s*(\{.*?\})\s*</tool_call>", re.S)


def answer_message(text: str, tools: list[dict[str, Any]] | None, turn: int) -> dict[str, Any]:
    """The assistant message the gateway returns for an answer's ``text`` (EOS left out): with ``tools``, an answer
    made only of hermes calls (``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, what a forced call
    generates) is those calls, arguments re-serialised as the gateway's and vLLM's hermes parsers do; anything else
    is content. Call ids are ``call_<turn>_<index>``."""
    calls = []
    if tools and text.strip():
        names = {t["function"]["name"] for t in tools}
        end = 0
        for m in _HERMES_CALL.finditer(text):
            if text[end:m.start()].strip():
                break
            try:
                call = json.loads(m.group(1))
            except ValueError:
                break
            if not isinstance(call, dict) or call.get("name") not in names or not isinstance(call.get("arguments"),
                                                                                            dict):
                break
            calls.append((call["name"], json.dumps(call["arguments"], ensure_ascii=False)))
            end = m.end()
        if text[end:].strip():
            calls = []
    if not calls:
        return {"role": "assistant", "content": text}
    return {"role": "assistant", "content": None, "tool_calls": [
        {"id": f"call_{turn}_{i}", "type": "function", "function": {"name": name, "arguments": args}}
        for i, (name, args) in enumerate(calls)]}


def forced_call_bias(tokenizer: GatewayTokenizer) -> dict[int, float]:
    """The logit bias the bench gives forced calls: ``{`` and ``}`` (each a token of its own) strongly favoured, so
    the arguments object closes as soon as it opens (every parameter of the bench's tools is optional)."""
    out = {}
    for text in ("{", "}"):
        ids = tokenizer.encode(text, False)
        if len(ids) == 1:
            out[ids[0]] = CALL_BIAS
    return out


def template_message(message: dict[str, Any]) -> dict[str, Any]:
    """A message as the gateway hands it to the chat template (apis/openai/models.py, ChatMessageIn.plain): content a string
    ("" for none), tool call arguments as objects."""
    out: dict[str, Any] = {"role": message["role"], "content": message.get("content") or ""}
    if message.get("tool_calls"):
        out["tool_calls"] = [
            {"id": c["id"], "type": "function",
             "function": {"name": c["function"]["name"],
                          "arguments": json.loads(c["function"]["arguments"] or "{}")}}
            for c in message["tool_calls"]]
    if message.get("tool_call_id") is not None:
        out["tool_call_id"] = message["tool_call_id"]
    reasoning = message.get("reasoning_content")
    if reasoning is not None:
        out["reasoning_content"] = out["reasoning"] = reasoning
    return out


def check_template(tokenizer: GatewayTokenizer, tools: list[dict[str, Any]]) -> None:
    """Raise ValueError unless the model's chat template renders ``tools``, an assistant's tool call exactly as a
    forced hermes call is generated (so an echoed call continues the recorded ids), and tool results."""
    name = tools[0]["function"]["name"]
    syntax = CALL_SYNTAX[CALL_PARSER]
    call_text = f"{syntax.begin}{name}{syntax.middle}{{}}{syntax.end}"
    probe = "kvshuttle-bench-tool-result"
    messages = [{"role": "user", "content": "go"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "call_0", "type": "function", "function": {"name": name, "arguments": "{}"}}]},
                {"role": "tool", "tool_call_id": "call_0", "content": probe}]
    try:
        text = tokenizer.render_chat([template_message(m) for m in messages], True, tools=tools)
    except ValueError as exc:
        raise ValueError(f"the chat template of {tokenizer.model_dir} cannot render a tool conversation: "
                         f"{exc}") from None
    missing = [what for what, found in (("the tools", json.dumps(tools[0]["function"]["description"])[1:-1] in text),
                                        (f"a tool call as {call_text!r}", call_text in text),
                                        ("tool results", probe in text)) if not found]
    if missing:
        raise ValueError(f"the chat template of {tokenizer.model_dir} does not render {', '.join(missing)}: the "
                         f"bench's conversations need a template with tools and hermes tool calls (e.g. the tiny-tools "
                         f"test model, or Qwen 2.5/3)")


def forced_calls(conversations: list[Conversation]) -> list[tuple[list[dict[str, Any]], str]]:
    """(tools, function name) of the conversations' forced calls, one per distinct constraint."""
    out: dict[str, tuple[list[dict[str, Any]], str]] = {}
    for conv in conversations:
        for turn in conv.turns:
            if turn.call and conv.tools:
                out.setdefault(forced_tool_calls(CALL_SYNTAX[CALL_PARSER], conv.tools, turn.call).value,
                               (conv.tools, turn.call))
    return list(out.values())


async def warm_up_forced_calls(calls: list[tuple[list[dict[str, Any]], str]], call_bias: dict[int, float], *,
                               client: httpx.AsyncClient | None = None, engine: EngineClient | None = None,
                               tokenizer: GatewayTokenizer | None = None) -> None:
    """Force each of ``calls`` once before the measured turns, through the gateway (``client``: its D) and on a
    colocated ``engine`` (the ideal worker, prompts rendered with ``tokenizer``): vLLM sets up its grammar backend
    on a worker's first constrained request (seconds on CPU) and compiles each grammar once, which the first
    measured turn of whichever mode came first would otherwise pay for."""
    messages = [{"role": "user", "content": "Warm up: call the tool."}]
    for tools, name in calls:
        if client is not None:
            session = f"bench-warm-up-{uuid.uuid4().hex[:8]}"
            body: dict[str, Any] = {"messages": messages, "tools": tools, "max_tokens": CALL_MIN_TOKENS,
                                    "tool_choice": {"type": "function", "function": {"name": name}},
                                    "temperature": 0}
            if call_bias:
                body["logit_bias"] = {str(k): v for k, v in call_bias.items()}
            try:  # streamed, as the measured turns are
                await stream_chat(client, session, body)
            except StreamError as exc:
                raise LaneError(f"warming up the forced call of {name}: {exc}") from None
            await client.post(f"/v1/sessions/{session}/end")
        if engine is not None and tokenizer is not None:
            prompt = tokenizer.encode(tokenizer.render_chat(messages, True, tools=tools), False)
            c = forced_tool_calls(CALL_SYNTAX[CALL_PARSER], tools, name)
            async for _ in engine.generate(f"bench-warm-up-{uuid.uuid4().hex[:8]}", prompt,
                                           max_tokens=CALL_MIN_TOKENS, temperature=0.0, constraint=(c.kind, c.value),
                                           logit_bias=call_bias or None, stream=False):
                pass


class LaneError(Exception):
    """A turn that failed; the benchmark reports it and stops that conversation."""


class _History:
    """The chat so far (as the client sends it) and the sizes of the previous turn (for ``history_tokens``)."""

    def __init__(self, system: str | None, tools: list[dict[str, Any]] | None):
        self.messages: list[dict[str, Any]] = [{"role": "system", "content": system}] if system else []
        self.tools = tools
        self.turn = 0
        self.previous_tokens = 0  # last turn's prompt + answer
        self.call_ids: list[str] = []  # the ids of the last answer's tool calls

    def add_inputs(self, turn: Turn) -> None:
        """The turn's tool results (answering the last answer's call: the first one, as a forced call is one) and
        user message."""
        if turn.tool_results and not self.call_ids:
            raise LaneError(f"turn {self.turn + 1} carries tool results, but the answer before it called no tool")
        for k, text in enumerate(turn.tool_results):
            call_id = self.call_ids[min(k, len(self.call_ids) - 1)]
            self.messages.append({"role": "tool", "tool_call_id": call_id, "content": text})
        if turn.user is not None:
            self.messages.append({"role": "user", "content": turn.user})
        self.turn += 1

    def add_answer(self, message: dict[str, Any], turn: Turn, finish: str | None, prompt_tokens: int,
                   output_tokens: int) -> None:
        """The answer as the client echoes it back; a turn made to call a tool must have called it."""
        calls = message.get("tool_calls") or []
        if turn.call is not None and [c["function"]["name"] for c in calls] != [turn.call]:
            raise LaneError(f"turn {self.turn}: the forced call of {turn.call} came back as "
                            f"{[c['function']['name'] for c in calls] or 'no tool call'} (finish_reason {finish}; "
                            f"content {str(message.get('content'))[:120]!r})")
        self.messages.append(message)
        self.call_ids = [c["id"] for c in calls]
        self.previous_tokens = prompt_tokens + output_tokens


class _TimedResponse:
    """A streamed response that notes when each line arrives."""

    def __init__(self, resp: httpx.Response, lines: list[tuple[float, str]]):
        self._resp, self._lines = resp, lines

    @property
    def status_code(self) -> int:
        return self._resp.status_code

    async def aread(self) -> bytes:
        return await self._resp.aread()

    async def aiter_lines(self) -> AsyncIterator[str]:
        lines, clock = self._lines, time.perf_counter
        async for line in self._resp.aiter_lines():
            lines.append((clock(), line))
            yield line


class TimedClient:
    """The client as ``stream_chat`` uses it (``stream``), noting when the request went out (``sent``) and when each
    line of the answer arrived (``lines``): one clock reading and one append per line; nothing is parsed twice while
    the stream runs (:func:`token_times` reads the lines afterwards)."""

    def __init__(self, client: httpx.AsyncClient):
        self.client = client
        self.sent = 0.0
        self.lines: list[tuple[float, str]] = []

    @contextlib.asynccontextmanager
    async def stream(self, method: str, url: str, **kwargs: Any) -> AsyncIterator[_TimedResponse]:
        self.sent = time.perf_counter()
        async with self.client.stream(method, url, **kwargs) as resp:
            yield _TimedResponse(resp, self.lines)


def token_times(lines: list[tuple[float, str]]) -> list[float]:
    """The arrival times of the chunks that carried generated tokens, from a streamed chat's timed SSE lines: those
    whose choice carries ``logprobs`` (the lanes ask for them: the gateway sends them with the first chunk of each
    engine output, also while its tool-call parser holds the text back). Other chunks (the finish, the usage, the
    text a parser releases at the end) carry no new token."""
    out = []
    for at, line in lines:
        if not line.startswith("data: {") or '"logprobs"' not in line:
            continue
        try:
            chunk = json.loads(line[6:])
        except ValueError:
            continue
        if any(choice.get("logprobs") for choice in chunk.get("choices") or []):
            out.append(at)
    return out


class GatewayLane:
    def __init__(self, client: httpx.AsyncClient, mode: str, conversation: str, system: str | None, run_id: str,
                 model: str | None = None, *, disable_pull: bool | None = None, policy: str = "",
                 tools: list[dict[str, Any]] | None = None, call_bias: dict[int, float] | None = None):
        """``disable_pull`` defaults to ``mode != "pull"``; ``policy`` names a scheduler policy ("": its default);
        ``tools``: sent with every request; ``call_bias``: the logit bias of turns that force a call."""
        self.client, self.mode, self.conversation, self.model = client, mode, conversation, model
        self.disable_pull = mode != "pull" if disable_pull is None else disable_pull
        self.policy = policy
        self.call_bias = dict(call_bias or {})
        self.session = f"bench-{run_id}-{conversation}-{mode}"
        self.history = _History(system, tools)
        self.last_timings: dict[str, float] = {}  # the gateway's per-hop timers for the last turn
        self.last_kv: dict[str, Any] = {}  # the gateway's kvshuttle report of the last turn (decision, figures)
        self.last_stream: TurnStream | None = None  # when the last turn's tokens arrived

    def request(self, turn: Turn) -> dict[str, Any]:
        """The turn's chat completion request (the history must hold its inputs)."""
        h = self.history
        # logprobs: a chunk per token, so the client sees the first token even while the tool-call parser holds the
        # call's text (the direct and ideal lanes ask the engines for the same logprobs).
        body: dict[str, Any] = {"messages": h.messages, "max_tokens": turn.answer_tokens, "temperature": 0,
                                "disable_pull": self.disable_pull, "logprobs": True}
        if h.tools:
            body["tools"] = h.tools
            body["tool_choice"] = {"type": "function", "function": {"name": turn.call}} if turn.call else "auto"
            if turn.call and self.call_bias:
                body["logit_bias"] = {str(k): v for k, v in self.call_bias.items()}
        if self.policy:
            body["policy"] = self.policy
        if self.model:
            body["model"] = self.model
        return body

    async def turn(self, turn: Turn) -> TurnSample:
        h = self.history
        h.add_inputs(turn)
        sent_at = time.time()
        timed = TimedClient(self.client)
        try:
            got = await stream_chat(timed, self.session, self.request(turn))  # type: ignore[arg-type]
        except StreamError as exc:
            raise LaneError(str(exc)) from None
        info, usage = got.kv, got.usage
        prompt, output = usage["prompt_tokens"], usage["completion_tokens"]
        history = h.previous_tokens if h.turn > 1 else 0
        h.add_answer(got.message, turn, got.finish_reason, prompt, output)
        self.last_timings = dict(info.get("timings_ms", {}))
        self.last_kv = dict(info)
        decision, decode_worker = info["decision"], info.get("decode_worker", "")
        self.last_stream = TurnStream(self.mode, self.conversation, h.turn, decision, decode_worker, timed.sent,
                                      token_times(timed.lines))
        local = decision == LOCAL  # served by D alone: its prefix-cache hit is the usage's cached tokens
        return TurnSample(
            mode=self.mode, conversation=self.conversation, turn=h.turn, prompt_tokens=prompt,
            history_tokens=history, new_tokens=prompt - history,
            ttft_ms=got.ttft_ms, latency_ms=got.latency_ms, output_tokens=output,
            decision=decision, pulled_tokens=info["pulled_tokens"], computed_tokens=info["computed_tokens"],
            output_digest=message_digest(got.message), prefill_worker=info.get("prefill_worker", ""),
            decode_worker=decode_worker,
            cached_tokens=max(0, prompt - info["pulled_tokens"] - info["computed_tokens"]), sent_at=sent_at,
            reason_code=info.get("reason_code", ""),
            decode_cached_tokens=int((usage.get("prompt_tokens_details") or {}).get("cached_tokens", -1)) if local
            else -1,
            decode_read_tokens=0 if local else -1)

    async def close(self) -> None:
        await self.client.delete(f"/v1/sessions/{self.session}")


class _ExactIdsLane:
    """Renders the chat and continues the previous turn's exact ids, as the gateway does."""

    def __init__(self, tokenizer: GatewayTokenizer, conversation: str, system: str | None,
                 tools: list[dict[str, Any]] | None = None, call_bias: dict[int, float] | None = None):
        self.tokenizer = tokenizer
        self.conversation = conversation
        self.history = _History(system, tools)
        self.call_bias = dict(call_bias or {})
        self._text = ""  # last prompt text + raw answer
        self._ids: list[int] = []  # last prompt ids + answer ids

    async def _prompt(self) -> tuple[list[int], str, bool]:
        h = self.history
        extra = {"tools": h.tools} if h.tools else {}
        messages = [template_message(m) for m in h.messages]
        text = await asyncio.to_thread(self.tokenizer.render_chat, messages, True, **extra)
        prev = self._text  # as the gateway's record keeps it: its length and key
        cont = plan_continuation(len(prev), text_key(prev) if prev else b"", self._ids, text)
        suffix = await asyncio.to_thread(self.tokenizer.encode, cont.suffix_text, False)
        return [*cont.prefix_ids, *suffix], text, cont.continues

    def _sampling(self, turn: Turn) -> dict[str, Any]:
        """Sampling as the gateway asks the workers for it (GatewayLane.request): greedy, the first token's logprob,
        and a forced call's logit bias."""
        out: dict[str, Any] = {"temperature": 0.0, "logprobs": 0}
        if turn.call and self.history.tools and self.call_bias:
            out["logit_bias"] = self.call_bias
        return out

    def _constraint(self, turn: Turn) -> tuple[str, Any] | None:
        """The guided decoding that forces the turn's call, exactly as the gateway builds it for a named
        ``tool_choice`` (as the chat route builds its AnswerShape, apis/openai/routes.py)."""
        if not turn.call or not self.history.tools:
            return None
        c = forced_tool_calls(CALL_SYNTAX[CALL_PARSER], self.history.tools, turn.call)
        return c.kind, c.value

    def _message(self, output: list[int]) -> dict[str, Any]:
        """The answer as the gateway would return it: its text without the stopping EOS (special tokens kept when
        tools are parsed, as the gateway asks), read by :func:`answer_message`."""
        h = self.history
        ids = output[:-1] if output and output[-1] in self.tokenizer.eos_token_ids else output
        return answer_message(self.tokenizer.decode(ids, not h.tools), h.tools, h.turn)

    def _finish(self, mode: str, turn: Turn, prompt_ids: list[int], prompt_text: str, output: list[int],
                finish: str | None, started: float, first: float | None, ended: float, cached: int, pulled: int,
                decision: str) -> TurnSample:
        h = self.history
        message = self._message(output)
        history = h.previous_tokens if h.turn > 1 else 0
        h.add_answer(message, turn, finish, len(prompt_ids), len(output))
        self._text = prompt_text + self.tokenizer.decode(output, False)
        self._ids = [*prompt_ids, *output]
        return TurnSample(
            mode=mode, conversation=self.conversation, turn=h.turn, prompt_tokens=len(prompt_ids),
            history_tokens=history, new_tokens=len(prompt_ids) - history,
            ttft_ms=((first or ended) - started) * 1000, latency_ms=(ended - started) * 1000,
            output_tokens=len(output), decision=decision, pulled_tokens=pulled,
            computed_tokens=len(prompt_ids) - cached, output_digest=message_digest(message))


async def _stream(engine: EngineClient, request_id: str, prompt_ids: list[int], max_tokens: int,
                  params: dict | None, constraint: tuple[str, Any] | None = None, times: list[float] | None = None,
                  **sampling: Any) -> tuple[list[int], float | None, Final]:
    """The streamed answer, its first token's time, and the final message; ``times`` gets each output's arrival."""
    output: list[int] = []
    first = None
    final = None
    async for item in engine.generate(request_id, prompt_ids, max_tokens=max_tokens, kv_transfer_params=params,
                                      stream=True, constraint=constraint, **sampling):
        if isinstance(item, Final):
            final = item
            break
        if item.token_ids:
            at = time.perf_counter()
            first = first or at
            if times is not None:
                times.append(at)
            output.extend(item.token_ids)
    if final is None:
        raise LaneError("the engine's stream ended without a final message")
    if final.finish_reason == "error":
        raise LaneError("the engine finished the request with an error")
    return output, first, final


class IdealLane(_ExactIdsLane):
    def __init__(self, engine: EngineClient, tokenizer: GatewayTokenizer, conversation: str, system: str | None,
                 tools: list[dict[str, Any]] | None = None, call_bias: dict[int, float] | None = None):
        super().__init__(tokenizer, conversation, system, tools, call_bias)
        self.engine = engine
        self.last_stream: TurnStream | None = None  # the ideal worker is not D: its streams are not D's

    async def turn(self, turn: Turn) -> TurnSample:
        self.history.add_inputs(turn)
        started = time.perf_counter()
        prompt_ids, prompt_text, _ = await self._prompt()
        output, first, final = await _stream(self.engine, f"ideal-{uuid.uuid4().hex[:16]}", prompt_ids,
                                             turn.answer_tokens, None, self._constraint(turn), **self._sampling(turn))
        return self._finish(IDEAL, turn, prompt_ids, prompt_text, output, final.finish_reason, started, first,
                            time.perf_counter(), final.cached_tokens, 0, IDEAL)

    async def close(self) -> None:
        pass


class DirectLane(_ExactIdsLane):
    """P then D with vLLM's kv_transfer_params and nothing else: D's handle lives in this object."""

    def __init__(self, prefill: EngineClient, decode: EngineClient, block_size: int, tokenizer: GatewayTokenizer,
                 conversation: str, system: str | None, tools: list[dict[str, Any]] | None = None,
                 call_bias: dict[int, float] | None = None, decode_worker: str = ""):
        super().__init__(tokenizer, conversation, system, tools, call_bias)
        self.prefill, self.decode, self.block_size = prefill, decode, block_size
        self.decode_worker = decode_worker  # D's worker id, for the streams' record
        self._handle: dict | None = None
        self.last_stream: TurnStream | None = None

    async def turn(self, turn: Turn) -> TurnSample:
        self.history.add_inputs(turn)
        started = time.perf_counter()
        prompt_ids, prompt_text, continues = await self._prompt()
        params, pulled = kv_params.prefill_request_params(), 0
        if self._handle is not None and continues:
            handle = kv_params.parse_handle(self._handle)
            pulled = min(handle.num_tokens, len(prompt_ids) - 1)
            params = kv_params.pull_params(handle, pulled, self.block_size)
        self._handle = None  # single use, pulled or not
        rid = uuid.uuid4().hex[:16]
        sampling, constraint, max_tokens = self._sampling(turn), self._constraint(turn), turn.answer_tokens
        times: list[float] = []
        p_final = await self.prefill.prefill(f"direct-{rid}-p", prompt_ids, kv_transfer_params=params, **sampling)
        if p_final.finish_reason == "error" or not p_final.output_ids:
            raise LaneError("P finished the prefill with an error")
        if constraint is not None:
            # As the gateway does: a constrained answer is D's from its first token (P's is dropped).
            output, first, final = await _stream(self.decode, f"direct-{rid}-d", prompt_ids, max_tokens,
                                                 p_final.kv_transfer_params, constraint, times, **sampling)
            ended, finish = time.perf_counter(), final.finish_reason
        else:
            # As the gateway does: P's token is the first one, D continues after it.
            first_id, first = p_final.output_ids[-1], time.perf_counter()
            times.append(first)
            more, _, final = await _stream(self.decode, f"direct-{rid}-d", [*prompt_ids, first_id],
                                           max(1, max_tokens - 1), p_final.kv_transfer_params, None, times,
                                           **sampling)
            ended = time.perf_counter()
            at_first = p_final.finish_reason == "stop" or max_tokens == 1
            output = [first_id] if at_first else [first_id, *more]
            finish = p_final.finish_reason if at_first else final.finish_reason
        self._handle = final.kv_transfer_params
        decision = "pull" if pulled else "recompute"
        self.last_stream = TurnStream(DIRECT, self.conversation, self.history.turn, decision, self.decode_worker,
                                      started, times)
        return self._finish(DIRECT, turn, prompt_ids, prompt_text, output, finish, started, first, ended,
                            p_final.cached_tokens, pulled, decision)

    async def close(self) -> None:
        pass
