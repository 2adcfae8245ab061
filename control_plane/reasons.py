"""Why a turn pulls or recomputes, as a small fixed vocabulary of codes (pure).

Every plan carries a human-readable ``reason`` (free text with figures) and one of these codes: the codes are what
metrics label turns with (``kvshuttle_plans_total{reason=...}``, ``kvshuttle_turns_total{reason=...}``), so the set
must stay small and fixed. Add a code here, with its description, before any code path produces it.
"""

from __future__ import annotations

# PULL: the prompt provably extends the recorded tokens; P pulls all of them.
PULL_ALL = "pull_all"
# PULL: the prompt shares whole blocks with the recorded tokens; P pulls those blocks.
PULL_PREFIX = "pull_prefix"
# PULL: the cost model predicts recomputing faster, but the pull is kept to keep measuring the P-D link.
PULL_EXPLORE = "pull_explore"

# LOCAL (continue on D): the turn could pull; the decode worker holding the history serves it from its own prefix
# cache instead (no transfer, no prefill worker).
LOCAL_FASTEST = "local_fastest"  # the cost model predicts continuing on D (its streams' delay included) about as fast
# as the best option on P
LOCAL_ALWAYS = "local_always"  # the policy continues on D whenever it can (continue_on_decode=always)

# RECOMPUTE, decided by the safety rules (kvshuttle.control_plane.decision):
PULL_DISABLED = "pull_disabled"  # the request disabled pulls (or a re-plan after a failed worker)
NO_RECORD = "no_record"  # no recorded KV for the session (first turn, another tenant's id, dropped record)
HANDLE_USED = "handle_used"  # the record's KV handle was already claimed by another turn
EXPIRED = "expired"  # the handle has expired or expires within the expiry guard
DECODE_WORKER_UNAVAILABLE = "decode_worker_unavailable"  # the KV's decode worker is gone, elsewhere or not answering
OTHER_MODEL = "other_model"  # the KV is another model's or adapter's: never reused across models
INCONSISTENT_RECORD = "inconsistent_record"  # no block size, covered tokens or prefix digest
DIVERGED = "diverged"  # the prompt diverges from the recorded tokens before enough whole blocks
BELOW_THRESHOLD = "below_threshold"  # the prompt extends the record, but too few tokens are reusable
HANDLE_UNUSABLE = "handle_unusable"  # the recorded kv_transfer_params cannot be turned into a pull
KV_FREED_IDLE = "kv_freed_idle"  # the scheduler freed the session's KV on its decode worker: idle past the limit
KV_FREED_PRESSURE = "kv_freed_pressure"  # ... to make room on a decode worker whose KV cache was filling
# RECOMPUTE, decided by a policy (kvshuttle.control_plane.policies):
COST_MODEL = "cost_model"  # the cost model predicts recomputing faster by more than the margin
WOULD_EXPIRE = "would_expire"  # the pull would end (waiting included) within the expiry guard of the handle's expiry
# RECOMPUTE, decided by the scheduler while reading or claiming the record:
STORE_UNAVAILABLE = "store_unavailable"  # the registry or etcd could not be reached (UNAVAILABLE, DEADLINE_EXCEEDED)
STORE_ERROR = "store_error"  # the registry or etcd answered the read or claim with another error
CLAIM_REFUSED = "claim_refused"  # a concurrent turn claimed the handle first, or the record changed
CLAIM_MISMATCH = "claim_mismatch"  # the claimed record gives another plan than the one planned with
# RECOMPUTE, decided by the gateway during the turn:
PULL_FAILED = "pull_failed"  # the planned pull failed at the prefill worker; the turn was run again as a recompute
WORKER_FAILED = "worker_failed"  # the prefill worker failed; the turn was planned again and recomputed elsewhere

# A code that is not in this vocabulary (e.g. from a newer or older scheduler) is counted as this.
UNKNOWN = "unknown"

PULL_CODES = (PULL_ALL, PULL_PREFIX, PULL_EXPLORE)
LOCAL_CODES = (LOCAL_FASTEST, LOCAL_ALWAYS)
RECOMPUTE_CODES = (PULL_DISABLED, NO_RECORD, HANDLE_USED, KV_FREED_IDLE, KV_FREED_PRESSURE, EXPIRED,
                   DECODE_WORKER_UNAVAILABLE, OTHER_MODEL, INCONSISTENT_RECORD, DIVERGED, BELOW_THRESHOLD, HANDLE_UNUSABLE, COST_MODEL, WOULD_EXPIRE, STORE_UNAVAILABLE,
                   STORE_ERROR, CLAIM_REFUSED, CLAIM_MISMATCH, PULL_FAILED, WORKER_FAILED)
VOCABULARY = frozenset((*PULL_CODES, *LOCAL_CODES, *RECOMPUTE_CODES, UNKNOWN))

# What each code means (the documentation's reason-code reference is generated from this; tests check it covers the
# vocabulary exactly).
DESCRIPTIONS: dict[str, str] = {
    PULL_ALL: "the prompt extends the recorded tokens: all of them are pulled",
    PULL_PREFIX: "the prompt shares whole blocks with the recorded tokens: those are pulled",
    PULL_EXPLORE: "the cost model predicts recomputing faster, but the link is pulled to keep measuring it",
    LOCAL_FASTEST: "continued on the decode worker holding the history: its predicted time to first token, plus the "
                   "delay it adds to that worker's streams, is within `local_margin` of the best option on P, and "
                   "within the decode inter-token SLO",
    LOCAL_ALWAYS: "continued on the decode worker holding the history: the policy does whenever it can "
                  "(`continue_on_decode=always`), within the decode inter-token SLO",
    PULL_DISABLED: "the request disabled pulls (also re-plans after a failed worker)",
    NO_RECORD: "no recorded KV for the session (first turn, another tenant's id, dropped record)",
    HANDLE_USED: "the record's KV handle was already claimed by another turn",
    KV_FREED_IDLE: "the scheduler freed the session's KV on its decode worker: idle past `--kv-idle-limit-s` "
                   "(\"KV freed: idle\")",
    KV_FREED_PRESSURE: "the scheduler freed the session's KV to make room on a decode worker whose KV cache was "
                       "filling (\"KV freed under pressure\")",
    EXPIRED: "the handle expired or expires within `--expiry-guard-s`",
    DECODE_WORKER_UNAVAILABLE: "the decode worker holding the KV is gone, registered elsewhere, excluded or not "
                               "answering",
    OTHER_MODEL: "the session was recorded for another model or LoRA adapter than the turn's, or the decode worker "
                 "holding its KV does not serve the turn's: KV is never pulled or continued across models",
    INCONSISTENT_RECORD: "the record lacks a block size, covered tokens or a prefix digest",
    DIVERGED: "the prompt diverges from the recorded tokens before enough whole blocks",
    BELOW_THRESHOLD: "the prompt extends the record, but too few tokens are reusable",
    HANDLE_UNUSABLE: "the recorded `kv_transfer_params` cannot be turned into a pull",
    COST_MODEL: "the cost model predicts recomputing faster by more than the margin",
    WOULD_EXPIRE: "the pull would end (waiting at P included) within the expiry guard of the handle's expiry",
    STORE_UNAVAILABLE: "the registry or etcd could not be reached to read or claim the record (UNAVAILABLE, "
                       "DEADLINE_EXCEEDED)",
    STORE_ERROR: "the registry or etcd refused the read or claim otherwise",
    CLAIM_REFUSED: "a concurrent turn claimed the handle first, or the record changed",
    CLAIM_MISMATCH: "the claimed record gives another plan than the one planned with",
    PULL_FAILED: "the gateway: the planned pull failed at P and the turn was run again as a recompute",
    WORKER_FAILED: "the gateway: the prefill worker failed and the turn was planned again and recomputed on another",
    UNKNOWN: "not a code of this vocabulary (e.g. from a newer or older scheduler): what metrics count it as",
}


# What became of a turn's record (its KV handle and exact ids, for the next turn to pull): KvReport.record, the
# ``kvshuttle.record`` body field, the X-KV-Record header and ``kvshuttle_turn_records_total{outcome}``. Anything but
# ``recorded`` and ``unrecorded`` means the next turn cannot pull this one: never only a log line.
RECORDED = "recorded"  # the registry holds the turn's record
UNRECORDED = "unrecorded"  # no session to record (a chat without an id while finding sessions is off): KV freed
RECORD_REFUSED = "record_refused"  # the registry refused the record (INVALID_ARGUMENT: e.g. over its size limit)
RECORD_UNAVAILABLE = "record_unavailable"  # the registry or etcd could not be reached (UNAVAILABLE, DEADLINE_EXCEEDED)
RECORD_ERROR = "record_error"  # the registry failed the write otherwise
NO_HANDLE = "no_handle"  # the decode worker returned no KV handle: nothing to record
RECORD_OUTCOMES = (RECORDED, UNRECORDED, RECORD_REFUSED, RECORD_UNAVAILABLE, RECORD_ERROR, NO_HANDLE)
RECORD_DESCRIPTIONS: dict[str, str] = {
    RECORDED: "the registry holds the turn's record: its next turn can pull",
    UNRECORDED: "no session to record (a chat without a session id while `--find-sessions` is off); its KV was freed",
    RECORD_REFUSED: "the registry refused the record (INVALID_ARGUMENT, e.g. over its size limit): the next turn "
                    "recomputes",
    RECORD_UNAVAILABLE: "the registry or etcd could not be reached to write the record: the next turn recomputes",
    RECORD_ERROR: "the registry failed the write otherwise: the next turn recomputes",
    NO_HANDLE: "the decode worker returned no KV handle, so there was nothing to record: the next turn recomputes",
}


def record_outcome(grpc_code: str) -> str:
    """The record outcome of a RecordTurn that failed with this gRPC status code (its name)."""
    if grpc_code == "INVALID_ARGUMENT":
        return RECORD_REFUSED
    if grpc_code in ("UNAVAILABLE", "DEADLINE_EXCEEDED"):
        return RECORD_UNAVAILABLE
    return RECORD_ERROR


def known(code: str) -> str:
    """``code`` when it is in the vocabulary, else ``unknown`` (metrics labels must stay bounded)."""
    return code if code in VOCABULARY else UNKNOWN
