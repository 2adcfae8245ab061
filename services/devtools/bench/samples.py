"""What one measured turn of the benchmark is: the record the runner produces and the report aggregates."""

from __future__ import annotations

from dataclasses import asdict, dataclass

# The three modes measured side by side in one run.
PULL = "pull"  # the gateway with bi-directional KV transfer: turns 2+ pull the history from the decode worker
RECOMPUTE = "recompute"  # the same gateway and workers with pulls disabled per request: P recomputes the history
IDEAL = "ideal"  # the same conversation on one vLLM worker with prefix caching (no disaggregation, no KV moved)
MODES = (PULL, RECOMPUTE, IDEAL)
# Not kvshuttle: SMG (PyPI smg) in front of the same P and D workers, driven over its OpenAI API
# (services/devtools/bench/smg.py); P recomputes whatever its prefix cache lacks, nothing is pulled from D.
SMG = "smg"


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
    decision: str  # "pull" or "recompute" as the gateway reported it; "ideal" for the ideal worker; SMG: "recompute"
    pulled_tokens: int  # prompt tokens P loaded over NIXL (worker-reported); 0 when not pulled
    computed_tokens: int  # prompt tokens the prefilling worker computed itself
    output_digest: str = ""  # short hash of the generated token ids: equal across modes when answers agree
    # Where and when (the gateway modes; the simulator's validation replays them): the workers that served the turn,
    # the prompt tokens P found in its own prefix cache, and the wall-clock time the request was sent (Unix s).
    prefill_worker: str = ""
    decode_worker: str = ""
    cached_tokens: int = 0
    sent_at: float = 0.0

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> TurnSample:
        return cls(**data)
