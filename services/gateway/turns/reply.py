"""What every API reports about a turn, computed once: the KV headers and the ``kvshuttle`` body object, the token
usage (each front end spells it in its API's shape), and a prepared turn run to its end."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import grpc
from kvshuttle.control_plane.answer import Event, Piece
from kvshuttle.control_plane.reasoning import REASONING
from kvshuttle.services.gateway.tokens import off_loop
from kvshuttle.services.gateway.turns.context import Finished, KvOutcome, Tokenizer, TurnContext
from kvshuttle.services.gateway.turns.errors import TurnError
from kvshuttle.services.gateway.turns.request import TurnRequest

if TYPE_CHECKING:
    from kvshuttle.services.gateway.turns.runner import TurnRunner


def kv_headers(kv: KvOutcome) -> dict[str, str]:
    """What happened to the turn's KV, as response headers (every HTTP front end sends them)."""
    return {
        "X-KV-Decision": kv.decision,
        "X-KV-Reason": kv.reason.encode("ascii", "replace").decode(),
        "X-KV-Reason-Code": kv.reason_code,
        "X-KV-Pulled-Tokens": str(kv.pulled_tokens),
        "X-KV-Computed-Tokens": str(kv.computed_tokens),
        "X-KV-Prefill-Worker": kv.prefill_worker_id,
        "X-KV-Decode-Worker": kv.decode_worker_id,
        **({"X-Session-Source": kv.session_source} if kv.session_source else {}),
        **({"X-KV-Record": kv.record} if kv.record else {}),  # known once answered (not on a stream's headers)
    }


def kv_body(kv: KvOutcome, timings: dict[str, float], req: TurnRequest) -> dict[str, Any]:
    """The same, and the plan's figures, as the ``kvshuttle`` object of a response body (or last stream event); with
    the answer's limit and where it came from (``request``, the gateway's ``default``, or the ``context`` left)."""
    fig = kv.figures
    return {
        "max_tokens": req.max_tokens, "max_tokens_source": req.max_tokens_source,
        "decision": kv.decision, "reason": kv.reason, "reason_code": kv.reason_code, "pulled_tokens": kv.pulled_tokens,
        "computed_tokens": kv.computed_tokens, "retried_as_recompute": kv.retried_as_recompute,
        "session_source": kv.session_source, "prefill_worker": kv.prefill_worker_id, "decode_worker": kv.decode_worker_id,
        "matched_tokens": fig.matched_tokens if fig else 0, "covered_tokens": fig.covered_tokens if fig else 0,
        "policy": fig.policy if fig else "", "pullable_tokens": fig.pullable_tokens if fig else 0,
        "predicted_pull_ms": fig.predicted_pull_ms if fig else 0.0,
        "predicted_recompute_ms": fig.predicted_recompute_ms if fig else 0.0,
        "worker_choice": fig.worker_choice if fig else "", "worker_failures": kv.worker_failures,
        # the planner's prediction of P's own prefix-cache hit (the KV feed's index, or the session's last P)
        "predicted_cached_tokens": fig.cached_tokens_estimate if fig else 0,
        # the turn continued on the session's decode worker: its predicted time to first token, the extra delay per
        # token it would add to each stream that worker is decoding, and how many it was decoding (0: no option)
        "predicted_local_ms": fig.predicted_local_ms if fig else 0.0,
        "predicted_itl_delay_ms": fig.predicted_itl_delay_ms if fig else 0.0,
        "decode_streams": fig.decode_streams if fig else 0,
        "record": kv.record, **({"record_error": kv.record_error} if kv.record_error else {}),
        "timings_ms": timings,
    }


@dataclass(frozen=True)
class Usage:
    """A finished turn's tokens. ``cached``: the prompt tokens not computed this turn (pulled from the decode worker
    or found in P's own prefix cache), the figure benchmark clients read. ``reasoning``: the answer's reasoning
    re-tokenized, an estimate (0 unless asked for: see ``with_reasoning``)."""

    prompt: int
    completion: int
    cached: int
    reasoning: int = 0

    @classmethod
    def at(cls, prompt: int, completion: int, kv: KvOutcome) -> Usage:
        return cls(prompt, completion, max(prompt - kv.computed_tokens, 0))

    @classmethod
    def of(cls, finished: Finished) -> Usage:
        return cls.at(finished.prompt_tokens, len(finished.output_ids), finished.kv)

    @property
    def total(self) -> int:
        return self.prompt + self.completion

    async def with_reasoning(self, tokenizer: Tokenizer, events: list[Event]) -> Usage:
        """The same with the reasoning tokens counted (tokenized off the event loop)."""
        text = "".join(e.text for e in events if isinstance(e, Piece) and e.kind == REASONING)
        count = len(await off_loop.encode(tokenizer, text)) if text else 0
        return Usage(self.prompt, self.completion, self.cached, min(count, self.completion))


async def drain(runner: TurnRunner, turn: TurnContext) -> Finished:
    """Run a prepared turn to its end (the whole answer, not streamed): its summary."""
    async for event in runner.decode(turn):
        if isinstance(event, Finished):
            return event
    raise TurnError(503, grpc.StatusCode.UNAVAILABLE, "decode ended without a result")
