"""Pull, recompute or continue on D: the per-turn safety rules, as pure code.

The scheduler adapts it to gRPC; a simulator can call it directly. A PULL is only ever planned when the new
prompt provably extends the handle's tokens (prefix digests), the handle is unexpired, unclaimed and its decode worker
alive, and enough tokens are reusable to be worth a transfer. The same rules make a turn safe to continue on that
decode worker (LOCAL): its held blocks are the reusable tokens, served from its own prefix cache; whether a safe
turn pulls, recomputes or continues on D is the policy's choice (:mod:`.policies`).
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from kvshuttle.control_plane import kv_eviction, kv_params
from kvshuttle.control_plane import reasons as why
from kvshuttle.control_plane.prefix import matched_prefix_tokens


class Choice(enum.Enum):
    PULL = "pull"  # P loads the history's KV from the decode worker holding it, computes the rest
    RECOMPUTE = "recompute"  # P computes the prompt (less its own prefix-cache hit)
    LOCAL = "local"  # the decode worker holding the history serves the whole turn from its own prefix cache


@dataclass(frozen=True)
class PullPolicy:
    """Knobs of the threshold policy."""

    # Fewest reusable tokens worth a pull (below it, P computes them: the transfer's fixed cost dominates).
    pull_threshold_tokens: int = 16
    # Refuse a pull when the handle expires within this many seconds (the transfer must finish before expiry).
    expiry_guard_s: float = 2.0


@dataclass(frozen=True)
class HandleView:
    """What the decision needs to know about a session's recorded handle."""

    kv_transfer_params_json: str
    covered_tokens: int
    block_size: int
    expires_in_s: float
    claimed: bool
    source_alive: bool
    # One hash of the covered tokens (Session.prefix_digest), and (tokens, digest) of shorter prefixes
    # (Session.checkpoints): control_plane/prefix.py
    prefix_digest: bytes = b""
    checkpoints: Sequence[tuple[int, bytes]] = ()
    # Why the scheduler freed the handle's KV before this turn (Session.kv_freed: "idle", "pressure", "room")
    kv_freed: str = ""
    # Leading prompt ids the caller found equal to the recorded ids themselves (PlanTurnRequest.history_match_tokens;
    # 0: unknown): counted where the digests prove fewer.
    verified_tokens: int = 0
    # The KV was computed by another model than the turn's (its decode worker serves another): never reused.
    other_model: bool = False


@dataclass
class Plan:
    choice: Choice
    reason: str
    prompt_tokens: int
    matched_tokens: int = 0
    reusable_tokens: int = 0
    prefill_params: dict[str, Any] = field(default_factory=kv_params.prefill_request_params)
    # A RECOMPUTE that could have pulled safely: the tokens that pull would have loaded (the option not taken).
    pullable_tokens: int = 0
    # ``reason`` as one code of kvshuttle.control_plane.reasons (bounded: metrics labels use it)
    code: str = field(kw_only=True)

    @property
    def compute_tokens(self) -> int:
        return self.prompt_tokens - self.reusable_tokens


def reusable_tokens(matched: int, covered: int, prompt_len: int, block_size: int) -> int:
    """Tokens P may safely pull: the whole handle when the prompt extends it, else whole matched blocks.

    P must compute at least one prompt token itself, so a pull never covers the prompt's last token.
    """
    limit = min(matched, prompt_len - 1)
    if limit == covered:
        return covered
    return (limit // block_size) * block_size


def decide(prompt: Sequence[int], handle: HandleView | None, policy: PullPolicy,
           disable_pull: bool = False) -> Plan:
    n = len(prompt)
    if n == 0:
        raise ValueError("empty prompt")

    def recompute(code: str, reason: str, matched: int = 0, pullable: int = 0) -> Plan:
        return Plan(Choice.RECOMPUTE, reason, n, matched_tokens=matched, pullable_tokens=pullable, code=code)

    if disable_pull:
        return recompute(why.PULL_DISABLED, "pull disabled for this turn")
    if handle is None:
        return recompute(why.NO_RECORD, "no recorded KV for this session")
    if handle.kv_freed:
        idle = handle.kv_freed == kv_eviction.IDLE
        return recompute(why.KV_FREED_IDLE if idle else why.KV_FREED_PRESSURE,
                         "KV freed: idle" if idle else f"KV freed under pressure ({handle.kv_freed}): the decode "
                         "worker's KV cache needed the room")
    if handle.claimed or not handle.kv_transfer_params_json:
        return recompute(why.HANDLE_USED, "the session's KV handle was already used by another turn")
    if handle.expires_in_s <= policy.expiry_guard_s:
        return recompute(why.EXPIRED, f"KV handle expired or expires within {policy.expiry_guard_s:g}s "
                                      f"({handle.expires_in_s:.1f}s left)")
    if handle.other_model:
        return recompute(why.OTHER_MODEL, "the session's KV is another model's than this turn's (recorded for it, "
                                          "or held by a decode worker serving it)")
    if not handle.source_alive:
        return recompute(why.DECODE_WORKER_UNAVAILABLE, "the decode worker holding the KV is not alive")
    if handle.block_size <= 0 or handle.covered_tokens <= 0 or not handle.prefix_digest:
        return recompute(why.INCONSISTENT_RECORD,
                         "the session record is inconsistent (no block size, covered tokens or prefix digest)")
    matched = max(matched_prefix_tokens(handle.covered_tokens, handle.block_size, prompt, handle.prefix_digest,
                                        handle.checkpoints),
                  min(handle.verified_tokens, handle.covered_tokens, n))
    reusable = reusable_tokens(matched, handle.covered_tokens, n, handle.block_size)
    if reusable < policy.pull_threshold_tokens:
        if matched < min(handle.covered_tokens, n):
            code, what = why.DIVERGED, f"prompt diverges from the recorded tokens at block boundary {matched}"
        else:
            code, what = why.BELOW_THRESHOLD, "too few reusable tokens"
        return recompute(code, f"{what}: {reusable} reusable < threshold {policy.pull_threshold_tokens}", matched,
                         pullable=reusable)
    try:
        params = kv_params.pull_params(kv_params.parse_handle(handle.kv_transfer_params_json), reusable,
                                       handle.block_size)
    except kv_params.HandleError as exc:
        return recompute(why.HANDLE_UNUSABLE, f"recorded KV handle unusable: {exc}", matched)
    if reusable == handle.covered_tokens:
        code, reason = why.PULL_ALL, f"prompt extends the recorded {handle.covered_tokens} tokens: pull them all"
    else:
        code, reason = why.PULL_PREFIX, (f"prompt matches {matched} of {handle.covered_tokens} recorded tokens: "
                                         f"pull the first {reusable} (whole blocks)")
    return Plan(Choice.PULL, reason, n, matched_tokens=matched, reusable_tokens=reusable, prefill_params=params,
                code=code)
