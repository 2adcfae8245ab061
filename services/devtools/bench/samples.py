"""What one measured turn of the benchmark is: the record the runner produces and the report aggregates."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

# The three modes measured side by side in one run.
PULL = "pull"  # the gateway with bi-directional KV transfer: turns 2+ pull the history from the decode worker
RECOMPUTE = "recompute"  # the same gateway and workers with pulls disabled per request: P recomputes the history
IDEAL = "ideal"  # the same conversation on one vLLM worker with prefix caching (no disaggregation, no KV moved)
MODES = (PULL, RECOMPUTE, IDEAL)
# Not kvshuttle: SMG (PyPI smg) in front of the same P and D workers, driven over its OpenAI API
# (services/devtools/bench/smg.py); P recomputes whatever its prefix cache lacks, nothing is pulled from D.
SMG = "smg"
# The gateway with a scheduler policy that continues every later turn on D, the decode worker holding the session's
# KV (DECISION_LOCAL): D serves the whole turn from its own prefix cache, no P, nothing moved. Its first turn
# recomputes (nothing is held yet); so does any turn the scheduler could not continue there (the sample's reason_code).
LOCAL = "local"


@dataclass
class TurnSample:
    mode: str  # one of MODES
    conversation: str  # conversation id (the same id in every mode)
    turn: int  # 1-based turn index within the conversation
    prompt_tokens: int  # tokens in this turn's prompt
    history_tokens: int  # tokens of the prompt that were already there last turn (prompt + answer); 0 on turn 1
    new_tokens: int  # prompt_tokens - history_tokens
    ttft_ms: float  # request sent -> first generated token received, client side
    latency_ms: float  # request sent -> last byte received, client side
    output_tokens: int  # tokens generated
    # "pull", "recompute" or "local" as the gateway reported it; "ideal" for the ideal worker; SMG: "recompute"
    decision: str
    pulled_tokens: int  # prompt tokens P loaded over NIXL (worker-reported); 0 when not pulled
    computed_tokens: int  # prompt tokens the prefilling worker computed itself
    output_digest: str = ""  # short hash of the generated token ids: equal across modes when answers agree
    # Where and when (the gateway modes; the simulator's validation replays them): the workers that served the turn,
    # the prompt tokens P found in its own prefix cache, and the wall-clock time the request was sent (Unix s).
    prefill_worker: str = ""
    decode_worker: str = ""
    cached_tokens: int = 0
    sent_at: float = 0.0
    # The gateway's reason code for the decision (gateway modes), e.g. local_always, or why a turn was not continued
    # on D.
    reason_code: str = ""
    # D's own prefix-cache hit of the prompt: a turn continued on D (the body's prompt_tokens_details.cached_tokens);
    # on other turns D's vLLM counter (local_cache_hit), read around the turn at concurrency 1. -1: not measured.
    decode_cached_tokens: int = -1
    # Prompt tokens D read from P over NIXL (P -> D): D's vLLM counter (external_kv_transfer) around the turn at
    # concurrency 1; 0 on a turn continued on D (no P). -1: not measured.
    decode_read_tokens: int = -1

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> TurnSample:
        return cls(**data)


@dataclass
class TurnStream:
    """When one turn's streamed tokens reached the client (``time.perf_counter()`` seconds: one clock for every lane of
    the run), for the inter-token delays of D's streams (report.itl_by_prefill). ``sent``: the request went out;
    ``tokens``: the arrival of each chunk that carried generated tokens (one per engine output; the first is the
    first token), so ``[sent, tokens[0]]`` is the turn's prefill as the client saw it."""

    mode: str
    conversation: str
    turn: int
    decision: str  # as in TurnSample
    decode_worker: str  # the worker that decoded (streamed) the turn ("": not known)
    sent: float
    tokens: list[float] = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)
