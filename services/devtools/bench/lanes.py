"""One lane = one conversation replayed in one mode; each turn returns a measured :class:`TurnSample`.

Every lane starts its clock when it has the turn's messages and stops it at the first generated token, so the
modes pay for the same work: rendering the chat, tokenizing, and whatever sits between the client and the engines.

- :class:`GatewayLane` (modes ``pull`` and ``recompute``): the gateway's OpenAI API, streamed (SSE).
- :class:`DirectLane` (mode ``direct``): a minimal P→D client with no registry or scheduler. It keeps D's handle in
  memory and pulls it on the next turn (what vLLM's example proxy does): the baseline for the control plane's cost.
- :class:`IdealLane` (mode ``ideal``): one vLLM worker with prefix caching and no disaggregation; the history is
  already in its cache, no KV moves. The physical limit.

The direct and ideal lanes continue the conversation's exact token ids the way the gateway does, so all modes see the
same prompts and (fp32, greedy) give the same answers.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
import uuid
from typing import Any

import httpx
from kvshuttle.control_plane import kv_params
from kvshuttle.control_plane.continuation import plan_continuation
from kvshuttle.services.devtools.bench.samples import IDEAL, TurnSample
from kvshuttle.services.engine.client import EngineClient, Final
from kvshuttle.services.gateway.chat_stream import StreamError, stream_chat
from kvshuttle.services.gateway.tokenizer import GatewayTokenizer

DIRECT = "direct"


def digest(text: str) -> str:
    return hashlib.sha1(text.encode()).hexdigest()[:12]


class LaneError(Exception):
    """A turn that failed; the benchmark reports it and stops that conversation."""


class _History:
    """The chat so far and the sizes of the previous turn (for ``history_tokens``)."""

    def __init__(self, system: str | None):
        self.messages: list[dict[str, str]] = [{"role": "system", "content": system}] if system else []
        self.turn = 0
        self.previous_tokens = 0  # last turn's prompt + answer

    def add_user(self, text: str) -> None:
        self.messages.append({"role": "user", "content": text})
        self.turn += 1

    def add_answer(self, text: str, prompt_tokens: int, output_tokens: int) -> None:
        self.messages.append({"role": "assistant", "content": text})
        self.previous_tokens = prompt_tokens + output_tokens


class GatewayLane:
    def __init__(self, client: httpx.AsyncClient, mode: str, conversation: str, system: str | None, run_id: str,
                 model: str | None = None, *, disable_pull: bool | None = None, policy: str = ""):
        """``disable_pull`` defaults to ``mode != "pull"``; ``policy`` names a scheduler policy ("": its default)."""
        self.client, self.mode, self.conversation, self.model = client, mode, conversation, model
        self.disable_pull = mode != "pull" if disable_pull is None else disable_pull
        self.policy = policy
        self.session = f"bench-{run_id}-{conversation}-{mode}"
        self.history = _History(system)
        self.last_timings: dict[str, float] = {}  # the gateway's per-hop timers for the last turn
        self.last_kv: dict[str, Any] = {}  # the gateway's kvshuttle report of the last turn (decision, figures)

    async def turn(self, user_text: str, max_tokens: int) -> TurnSample:
        h = self.history
        h.add_user(user_text)
        body: dict[str, Any] = {"messages": h.messages, "max_tokens": max_tokens, "temperature": 0,
                                "disable_pull": self.disable_pull}
        if self.policy:
            body["policy"] = self.policy
        if self.model:
            body["model"] = self.model
        try:
            got = await stream_chat(self.client, self.session, body)
        except StreamError as exc:
            raise LaneError(str(exc)) from None
        text, info, usage = got.text, got.kv, got.usage
        prompt, output = usage["prompt_tokens"], usage["completion_tokens"]
        history = h.previous_tokens if h.turn > 1 else 0
        h.add_answer(text, prompt, output)
        self.last_timings = dict(info.get("timings_ms", {}))
        self.last_kv = dict(info)
        return TurnSample(
            mode=self.mode, conversation=self.conversation, turn=h.turn, prompt_tokens=prompt,
            history_tokens=history, new_tokens=prompt - history,
            ttft_ms=got.ttft_ms, latency_ms=got.latency_ms, output_tokens=output,
            decision=info["decision"], pulled_tokens=info["pulled_tokens"], computed_tokens=info["computed_tokens"],
            output_digest=digest(text))

    async def close(self) -> None:
        await self.client.delete(f"/v1/sessions/{self.session}")


class _ExactIdsLane:
    """Renders the chat and continues the previous turn's exact ids, as the gateway does."""

    def __init__(self, tokenizer: GatewayTokenizer, conversation: str, system: str | None):
        self.tokenizer = tokenizer
        self.conversation = conversation
        self.history = _History(system)
        self._text = ""  # last prompt text + raw answer
        self._ids: list[int] = []  # last prompt ids + answer ids

    async def _prompt(self) -> tuple[list[int], str, bool]:
        text = await asyncio.to_thread(self.tokenizer.render_chat, self.history.messages, True)
        cont = plan_continuation(self._text, self._ids, text)
        suffix = await asyncio.to_thread(self.tokenizer.encode, cont.suffix_text, False)
        return [*cont.prefix_ids, *suffix], text, cont.continues

    def _finish(self, mode: str, prompt_ids: list[int], prompt_text: str, output: list[int], started: float,
                first: float | None, ended: float, cached: int, pulled: int, decision: str) -> TurnSample:
        h = self.history
        text = self.tokenizer.decode(output, True)
        history = h.previous_tokens if h.turn > 1 else 0
        h.add_answer(text, len(prompt_ids), len(output))
        self._text = prompt_text + self.tokenizer.decode(output, False)
        self._ids = [*prompt_ids, *output]
        return TurnSample(
            mode=mode, conversation=self.conversation, turn=h.turn, prompt_tokens=len(prompt_ids),
            history_tokens=history, new_tokens=len(prompt_ids) - history,
            ttft_ms=((first or ended) - started) * 1000, latency_ms=(ended - started) * 1000,
            output_tokens=len(output), decision=decision, pulled_tokens=pulled,
            computed_tokens=len(prompt_ids) - cached, output_digest=digest(text))


async def _stream(engine: EngineClient, request_id: str, prompt_ids: list[int], max_tokens: int,
                  params: dict | None) -> tuple[list[int], float | None, Final]:
    output: list[int] = []
    first = None
    final = None
    async for item in engine.generate(request_id, prompt_ids, max_tokens=max_tokens, temperature=0.0,
                                      kv_transfer_params=params, stream=True):
        if isinstance(item, Final):
            final = item
            break
        if item.token_ids:
            first = first or time.perf_counter()
            output.extend(item.token_ids)
    if final is None:
        raise LaneError("the engine's stream ended without a final message")
    if final.finish_reason == "error":
        raise LaneError("the engine finished the request with an error")
    return output, first, final


class IdealLane(_ExactIdsLane):
    def __init__(self, engine: EngineClient, tokenizer: GatewayTokenizer, conversation: str, system: str | None):
        super().__init__(tokenizer, conversation, system)
        self.engine = engine

    async def turn(self, user_text: str, max_tokens: int) -> TurnSample:
        self.history.add_user(user_text)
        started = time.perf_counter()
        prompt_ids, prompt_text, _ = await self._prompt()
        output, first, final = await _stream(self.engine, f"ideal-{uuid.uuid4().hex[:16]}", prompt_ids, max_tokens,
                                             None)
        return self._finish(IDEAL, prompt_ids, prompt_text, output, started, first, time.perf_counter(),
                            final.cached_tokens, 0, IDEAL)

    async def close(self) -> None:
        pass


class DirectLane(_ExactIdsLane):
    """P then D with vLLM's kv_transfer_params and nothing else: D's handle lives in this object."""

    def __init__(self, prefill: EngineClient, decode: EngineClient, block_size: int, tokenizer: GatewayTokenizer,
                 conversation: str, system: str | None):
        super().__init__(tokenizer, conversation, system)
        self.prefill, self.decode, self.block_size = prefill, decode, block_size
        self._handle: dict | None = None

    async def turn(self, user_text: str, max_tokens: int) -> TurnSample:
        self.history.add_user(user_text)
        started = time.perf_counter()
        prompt_ids, prompt_text, continues = await self._prompt()
        params, pulled = kv_params.prefill_request_params(), 0
        if self._handle is not None and continues:
            handle = kv_params.parse_handle(self._handle)
            pulled = min(handle.num_tokens, len(prompt_ids) - 1)
            params = kv_params.pull_params(handle, pulled, self.block_size)
        self._handle = None  # single use, pulled or not
        rid = uuid.uuid4().hex[:16]
        p_final = await self.prefill.prefill(f"direct-{rid}-p", prompt_ids, kv_transfer_params=params)
        if p_final.finish_reason == "error" or not p_final.output_ids:
            raise LaneError("P finished the prefill with an error")
        # As the gateway does: P's token is the first one, D continues after it.
        first_id, first = p_final.output_ids[-1], time.perf_counter()
        more, _, final = await _stream(self.decode, f"direct-{rid}-d", [*prompt_ids, first_id],
                                       max(1, max_tokens - 1), p_final.kv_transfer_params)
        ended = time.perf_counter()
        output = [first_id] if p_final.finish_reason == "stop" or max_tokens == 1 else [first_id, *more]
        self._handle = final.kv_transfer_params
        return self._finish(DIRECT, prompt_ids, prompt_text, output, started, first, ended,
                            p_final.cached_tokens, pulled, "pull" if pulled else "recompute")

    async def close(self) -> None:
        pass
