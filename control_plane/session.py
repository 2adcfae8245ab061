"""Session registry rules, without I/O: validation, building a Session from a finished turn, expiry, claims.

Times are float seconds since the epoch (the registry's wall clock). ``InvalidArgument`` means the caller sent
something wrong; ``FailedPrecondition`` means the request is fine but the system is not in a state to honour it.
"""

from __future__ import annotations

import hashlib
import math
import re
from dataclasses import dataclass

from kvshuttle.control_plane import models
from kvshuttle.control_plane.kv_eviction import MIN_LEFT_S
from kvshuttle.control_plane.kv_eviction import REASONS as FREE_REASONS
from kvshuttle.control_plane.kv_params import HandleError, blocks_for, parse_handle
from kvshuttle.control_plane.prefix import HASH_BYTES, MAX_CHECKPOINTS, ids_bytes, prefix_digest
from kvshuttle.v1 import common_pb2, registry_pb2

MAX_ID_LEN = 256
# An id: the alphabet below, and not only dots ("." and ".." name paths: a URL path or a proxy would resolve them).
# No look-around, so JSON Schema, pydantic (Rust regex) and Python share the one pattern (ID_PATTERN, "" allowed).
ID_PATTERN = r"^(|[.]*[A-Za-z0-9_:@=+-][A-Za-z0-9._:@=+-]*)$"
_ID_RE = re.compile(ID_PATTERN)
# The session record's lease outlives the handle by this much, so a reader sees "expired" (negative expires_in_s)
# rather than the record vanishing while a turn plans with it. Claims check expires_at, never the lease.
LEASE_GRACE_S = 2
MAX_LEASE_TTL_S = 24 * 3600
# A session's ids stay in the history store this long after its record's lease would end.
HISTORY_GRACE_S = 60
# A KV handle longer than this is kept in the history store, not in etcd's record (Session.handle_digest).
HANDLE_INLINE_BYTES = 1024
# etcd refuses requests over --max-request-bytes (1.5 MiB by default); stay well below with the key and framing.
MAX_RECORD_BYTES = 1_400_000
TOKEN_ID_MAX = 2**31 - 1

# Claim refusal reasons (ClaimSessionResponse.reason starts with one of these).
MISSING = "missing"
CLAIMED = "already claimed"
CHANGED = "changed"
NO_HANDLE = "no handle"
EXPIRED = "expired"
# A plan's reason starts with this when the turn recomputes because the session store (the registry or etcd) could
# not be reached; the gateway counts such turns.
STORE_UNAVAILABLE = "session store unavailable"


class InvalidArgument(ValueError):
    """The request is malformed (maps to INVALID_ARGUMENT)."""


class FailedPrecondition(ValueError):
    """The request is well formed but cannot be honoured now (maps to FAILED_PRECONDITION)."""


DEFAULT_TENANT = "default"


def validate_id(kind: str, value: str) -> str:
    """Ids become etcd key segments and URL path segments: 1..256 chars of ``A-Z a-z 0-9 . _ : @ = + -`` (no ``/``,
    no spaces), not only dots (``.``, ``..``)."""
    if not value:
        raise InvalidArgument(f"{kind} is required")
    if len(value) > MAX_ID_LEN:
        raise InvalidArgument(f"{kind} is {len(value)} characters long; at most {MAX_ID_LEN} allowed")
    if not _ID_RE.fullmatch(value):
        if value.strip(".") == "":
            raise InvalidArgument(f"{kind} {value[:64]!r} is not an id: an id of dots only names a path")
        raise InvalidArgument(f"{kind} {value[:64]!r} has characters outside A-Z a-z 0-9 . _ : @ = + -")
    return value


def validate_model(model: str) -> str:
    """A model's served name as a session records it (may be empty: none named): at most MAX_ID_LEN characters, no
    control characters (names such as ``Qwen/Qwen3-8B`` or ``org/model:lora-1`` are fine; they are hashed into keys)."""
    if len(model) > MAX_ID_LEN:
        raise InvalidArgument(f"model is {len(model)} characters long; at most {MAX_ID_LEN} allowed")
    if any(ord(c) < 32 or ord(c) == 127 for c in model):
        raise InvalidArgument(f"model {model[:64]!r} has control characters")
    return model


def session_ref(tenant: str, session_id: str) -> tuple[str, str]:
    """A request's (tenant, session id), the tenant defaulted, after the id checks (InvalidArgument names the one that
    fails; an empty tenant is the default tenant)."""
    validate_id("session_id", session_id)
    if tenant:
        validate_id("tenant", tenant)
    return tenant or DEFAULT_TENANT, session_id


def validate_worker(worker: common_pb2.Worker) -> None:
    """What a worker record must carry to be registered (decode workers also their KV TTL)."""
    validate_id("worker.worker_id", worker.worker_id)
    if worker.role not in (common_pb2.WORKER_ROLE_PREFILL, common_pb2.WORKER_ROLE_DECODE):
        raise InvalidArgument("worker.role must be WORKER_ROLE_PREFILL or WORKER_ROLE_DECODE")
    if not worker.grpc_address:
        raise InvalidArgument("worker.grpc_address is required")
    if worker.block_size <= 0:
        raise InvalidArgument(f"worker.block_size must be positive, got {worker.block_size}")
    if worker.role == common_pb2.WORKER_ROLE_DECODE and worker.kv_blocks_ttl_s <= 0:
        raise InvalidArgument(f"a decode worker needs kv_blocks_ttl_s > 0, got {worker.kv_blocks_ttl_s}")
    if worker.kv_blocks_ttl_s < 0 or not 0 <= worker.nixl_port <= 65535:
        raise InvalidArgument("worker.kv_blocks_ttl_s must be >= 0 and nixl_port within 0..65535")


def validate_free_reason(reason: str) -> None:
    """A claim that frees the KV names why: one of kv_eviction.REASONS (or "" for a pull's claim)."""
    if reason and reason not in FREE_REASONS:
        raise InvalidArgument(f"free_reason must be empty or one of {', '.join(FREE_REASONS)}, got {reason[:64]!r}")


def worker_lease_ttl(requested: int, default: int) -> int:
    """The lease TTL for a registration: ``requested`` seconds, or ``default`` when 0."""
    if requested < 0 or requested > MAX_LEASE_TTL_S:
        raise InvalidArgument(f"lease_ttl_s must be within 0..{MAX_LEASE_TTL_S}, got {requested}")
    return requested or default


def to_seconds(ts) -> float:
    return ts.seconds + ts.nanos / 1e9


def set_seconds(ts, t: float) -> None:
    ts.FromNanoseconds(int(round(t * 1e9)))


def expires_in(session: common_pb2.Session, now: float) -> float:
    """Seconds until the session's handle expires (negative once expired)."""
    return to_seconds(session.expires_at) - now


FREE_MIN_LEFT_S = MIN_LEFT_S  # a handle closer to its expiry is left to expire (P declines reads 5 s before it)


def freeable(session: common_pb2.Session, tokens: int, now: float) -> bool:
    """Whether the record's handle can be freed by reading its first block (or all of it, when it covers less)
    from a prompt of ``tokens`` tokens that repeats them (kv_params.free_read; the record's ``head_token_ids`` are
    such tokens): an unclaimed handle, far enough from its expiry."""
    bs = session.block_size
    return (bool(session.kv_transfer_params_json) and not session.claimed and bs > 0 and session.covered_tokens > 0
            and tokens > min(session.covered_tokens, bs) and expires_in(session, now) >= FREE_MIN_LEFT_S)


def lease_ttl_for(expires_at: float, now: float) -> int:
    """etcd lease TTL (whole seconds) that keeps a record until a little after ``expires_at``."""
    return max(1, math.ceil(expires_at - now)) + LEASE_GRACE_S


@dataclass(frozen=True)
class SessionPlan:
    """A Session record to store, the TTL of the lease to attach it to, and the history store's part: the ids to
    write at ``history_start`` of lineage ``session.history_generation`` (after copying the first
    ``history_start`` ids of lineage ``copy_from`` into it, when set), and the lineage this record replaces (to drop
    once the record is stored), if any."""

    session: common_pb2.Session
    lease_ttl_s: int
    history_start: int = 0
    history_ids: bytes = b""
    replaces_generation: int = 0
    # A new lineage that begins as the first history_start ids of this one (a history that continues only part of
    # the previous record's): the history store copies them itself.
    copy_from: int = 0


RESPONSE_TTL_RANGE_S = (1, 30 * 86400)  # how long a stored response may be kept


def validate_stored_response(response, ttl_s: int) -> None:
    """A StoredResponse the registry can keep: ids (and the previous response's, if any), a body (one turn's items)
    within the record limit, a TTL in range."""
    validate_id("response_id", response.response_id)
    validate_id("tenant", response.tenant)
    validate_id("session_id", response.session_id)
    if response.previous_response_id:
        validate_id("previous_response_id", response.previous_response_id)
        if response.previous_response_id == response.response_id:
            raise InvalidArgument("a response cannot continue itself (previous_response_id == response_id)")
    if not response.body_json:
        raise InvalidArgument("body_json is required")
    low, high = RESPONSE_TTL_RANGE_S
    if not low <= ttl_s <= high:
        raise InvalidArgument(f"ttl_s must be between {low} and {high} seconds, got {ttl_s}")
    size = response.ByteSize()
    if size > MAX_RECORD_BYTES:
        raise InvalidArgument(f"the stored response would be {size} bytes; the store takes at most {MAX_RECORD_BYTES}")


TEXT_KEY_BYTES = 32  # a content key (Session.text_key): SHA-256
MAX_FIND_KEYS = 64  # FindSession's most keys per request
# A record's most text boundaries (Session.text_boundaries): the gateway sends two (where the last turn's answer
# began, and where the answer to the last user query began); with its whole text, at most 1 + this many index keys
# per record.
MAX_TEXT_BOUNDARIES = 4


def validate_find(text_keys) -> None:
    """FindSession's keys: 1 to MAX_FIND_KEYS content keys of TEXT_KEY_BYTES each."""
    if not text_keys:
        raise InvalidArgument("text_keys is required: content keys of the prompt text's prefixes, longest first")
    if len(text_keys) > MAX_FIND_KEYS:
        raise InvalidArgument(f"at most {MAX_FIND_KEYS} text_keys are allowed, got {len(text_keys)}")
    odd = [i for i, k in enumerate(text_keys) if len(k) != TEXT_KEY_BYTES]
    if odd:
        raise InvalidArgument(f"text_keys[{odd[0]}] must be {TEXT_KEY_BYTES} bytes (SHA-256), got "
                              f"{len(text_keys[odd[0]])}")


def build_session(req: registry_pb2.RecordTurnRequest, worker: common_pb2.Worker | None, *, now: float,
                  margin_s: float, previous: common_pb2.Session | None = None,
                  new_generation: int | None = None, handle_inline_bytes: int = HANDLE_INLINE_BYTES) -> SessionPlan:
    """The Session record for a finished turn on ``worker`` (the decode worker, looked up by the caller).

    covered_tokens is the handle's ``remote_num_tokens``. The ids are the request's ``token_ids`` after the first
    ``base_tokens`` of ``previous``'s history (which must then be at turn ``base_turn`` with at least that many ids;
    fewer than all of them start a new lineage that the history store copies those from):
    the record keeps their digests, count and first block, never the ids (the plan says where they go in the
    history store, and so does the handle when it is longer than ``handle_inline_bytes``: the record then carries its
    ``handle_digest``). The handle expires at ``finished_at + kv_blocks_ttl_s - margin_s``; a ``finished_at`` in the
    future (clock skew) counts as now, so skew never lengthens a handle's life. ``new_generation``: the lineage a
    whole history starts (default: from ``now``).
    """
    validate_id("session_id", req.session_id)
    validate_id("tenant", req.tenant)
    validate_id("decode_worker_id", req.decode_worker_id)
    validate_model(req.model)
    base, ids = req.base_tokens, req.token_ids
    if base < 0:
        raise InvalidArgument(f"base_tokens must not be negative, got {base}")
    if not base and not ids:
        raise InvalidArgument("token_ids is required: the exact ids the decode worker holds")
    if ids and min(ids) < 0:
        raise InvalidArgument("token_ids must not be negative")
    if not req.kv_transfer_params_json:
        raise InvalidArgument("kv_transfer_params_json is required")
    _validate_text(req)
    try:
        handle = parse_handle(req.kv_transfer_params_json)
    except HandleError as exc:
        raise InvalidArgument(f"kv_transfer_params_json: {exc}") from None
    covered, total = handle.num_tokens, base + len(ids)
    if covered > total:
        raise InvalidArgument(f"the handle covers {covered} tokens (remote_num_tokens) but the history holds only "
                              f"{total} ids ({base} recorded + {len(ids)} given)")
    digest, checkpoints = _digests(req, covered)
    if base and (previous is None or previous.turn != req.base_turn or previous.history_tokens < base
                 or not previous.history_generation):
        have = (f"at turn {previous.turn} with {previous.history_tokens} ids" if previous is not None
                else "absent")
        raise FailedPrecondition(f"the session's recorded history changed (the record is {have}, not at turn "
                                 f"{req.base_turn} with at least {base} ids): send the whole history (base_tokens 0)")
    if base and previous.model != req.model:
        raise FailedPrecondition(f"the session's recorded history is model {previous.model!r}'s, not {req.model!r}'s: "
                                 "another model's ids are not continued; send the whole history (base_tokens 0)")
    if worker is None:
        raise FailedPrecondition(f"decode worker {req.decode_worker_id!r} is not registered")
    if worker.role != common_pb2.WORKER_ROLE_DECODE:
        raise FailedPrecondition(f"worker {req.decode_worker_id!r} is a {common_pb2.WorkerRole.Name(worker.role)} "
                                 "worker, not a decode worker")
    if req.model and worker.model and not models.serves(worker, req.model):
        raise FailedPrecondition(f"decode worker {worker.worker_id!r} serves {models.served_names(worker)}, not model "
                                 f"{req.model!r}: its KV is not that model's")
    if worker.block_size <= 0 or worker.kv_blocks_ttl_s <= 0:
        raise FailedPrecondition(f"decode worker {worker.worker_id!r} has no block size or KV TTL registered")
    if worker.engine_id and handle.engine_id != worker.engine_id:
        raise InvalidArgument(f"the handle's remote_engine_id {handle.engine_id!r} is not decode worker "
                              f"{worker.worker_id!r}'s engine {worker.engine_id!r}")
    need = blocks_for(covered, worker.block_size)
    short = [len(g) for g in handle.block_groups if len(g) < need]
    if short:
        raise InvalidArgument(f"the handle holds {short[0]} blocks in a group; {covered} tokens need {need} "
                              f"blocks of {worker.block_size}")

    finished = min(to_seconds(req.finished_at), now) if req.HasField("finished_at") else now
    expires_at = finished + worker.kv_blocks_ttl_s - margin_s
    if expires_at <= now:
        raise FailedPrecondition(f"the handle has already expired: finished {now - finished:.1f}s ago, decode KV "
                                 f"TTL {worker.kv_blocks_ttl_s}s minus {margin_s:g}s margin")

    head_len = worker.block_size + 1
    copy_from = 0
    if base:
        head = list(previous.head_token_ids[:base])
        if len(head) == base:
            head.extend(ids[: head_len - base])
        if base == previous.history_tokens:  # appended to the previous lineage
            generation = previous.history_generation
        else:  # the first base ids of the previous one, then these: a new lineage, copied from that one
            generation = new_generation if new_generation is not None else int(now * 1_000_000)
            copy_from = previous.history_generation
            if generation == copy_from:
                generation += 1
    else:
        generation = new_generation if new_generation is not None else int(now * 1_000_000)
        head = ids[:head_len]
    session = common_pb2.Session(
        session_id=req.session_id, tenant=req.tenant, decode_worker_id=req.decode_worker_id,
        kv_transfer_params_json=req.kv_transfer_params_json, covered_tokens=covered,
        block_size=worker.block_size, prefix_digest=digest, checkpoints=checkpoints,
        history_tokens=total, history_generation=generation, head_token_ids=head[:head_len],
        text_key=req.text_key or (_text_key(req.text) if req.text else b""),
        text_chars=len(req.text) if req.text else req.text_chars, text_boundaries=req.text_boundaries,
        turn=(previous.turn if previous is not None else 0) + 1, claimed=False, model=req.model,
    )
    if len(req.kv_transfer_params_json.encode()) > handle_inline_bytes:
        session.handle_digest = handle_digest(req.kv_transfer_params_json)
    set_seconds(session.expires_at, expires_at)
    set_seconds(session.updated_at, now)
    if previous is not None and (previous.HasField("created_at") or previous.HasField("updated_at")):
        session.created_at.CopyFrom(previous.created_at if previous.HasField("created_at") else previous.updated_at)
    else:
        set_seconds(session.created_at, now)
    size = session.ByteSize() - (len(req.kv_transfer_params_json.encode()) if session.handle_digest else 0)
    if size > MAX_RECORD_BYTES:
        raise InvalidArgument(f"the session record would be {size} bytes; the store takes at most "
                              f"{MAX_RECORD_BYTES} (its KV handle lists too many blocks)")
    replaced = (previous.history_generation if previous is not None and previous.history_generation
                and previous.history_generation != generation else 0)
    return SessionPlan(session, lease_ttl_for(expires_at, now), history_start=base, history_ids=ids_bytes(ids),
                       replaces_generation=replaced, copy_from=copy_from)


def handle_digest(handle_json: str) -> bytes:
    """The digest a record names an out-of-record handle by (Session.handle_digest)."""
    return hashlib.blake2b(handle_json.encode(), digest_size=16, person=b"kvshuttle/handle").digest()


def _text_key(text: str) -> bytes:
    return hashlib.sha256(text.encode()).digest()  # continuation.text_key (which imports this module)


def _validate_text(req: registry_pb2.RecordTurnRequest) -> None:
    if req.text_key and len(req.text_key) != TEXT_KEY_BYTES:
        raise InvalidArgument(f"text_key must be {TEXT_KEY_BYTES} bytes (SHA-256 of the text), got {len(req.text_key)}")
    if req.text_chars < 0:
        raise InvalidArgument(f"text_chars must not be negative, got {req.text_chars}")
    if req.text and req.text_chars and req.text_chars != len(req.text):
        raise InvalidArgument(f"text_chars is {req.text_chars} but text has {len(req.text)} characters")
    if req.text_chars and not req.text and not req.text_key:
        raise InvalidArgument("text_key is required with text_chars: the text is kept only as its key")
    bounds = req.text_boundaries
    if len(bounds) > MAX_TEXT_BOUNDARIES:
        raise InvalidArgument(f"at most {MAX_TEXT_BOUNDARIES} text_boundaries are allowed, got {len(bounds)}")
    chars, ids = len(req.text) if req.text else req.text_chars, req.base_tokens + len(req.token_ids)
    last = (0, 0)
    for i, b in enumerate(bounds):
        if len(b.key) != TEXT_KEY_BYTES:
            raise InvalidArgument(f"text_boundaries[{i}].key must be {TEXT_KEY_BYTES} bytes (SHA-256), got {len(b.key)}")
        if not last[0] < b.chars < chars:
            raise InvalidArgument(f"text_boundaries[{i}].chars must increase and stay within 1..{chars - 1} (inside "
                                  f"the text), got {b.chars}")
        if not last[1] < b.tokens <= ids:
            raise InvalidArgument(f"text_boundaries[{i}].tokens must increase and stay within 1..{ids} (the "
                                  f"history's ids), got {b.tokens}")
        if req.text and b.key != _text_key(req.text[:b.chars]):
            raise InvalidArgument(f"text_boundaries[{i}].key is not the key of the text's first {b.chars} characters")
        last = (b.chars, b.tokens)


def _digests(req: registry_pb2.RecordTurnRequest, covered: int) -> tuple[bytes, list[common_pb2.PrefixCheckpoint]]:
    """The record's prefix digest and checkpoints: the caller's (checked for shape), or computed from the ids when
    the request holds the whole history and sends none."""
    if not req.prefix_digest:
        if req.base_tokens:
            raise InvalidArgument("prefix_digest is required with base_tokens > 0 (the digest of the whole history's "
                                  "first covered ids)")
        if req.checkpoints:
            raise InvalidArgument("checkpoints need a prefix_digest")
        return prefix_digest(req.token_ids, covered), []
    if len(req.prefix_digest) != HASH_BYTES:
        raise InvalidArgument(f"prefix_digest must be {HASH_BYTES} bytes, got {len(req.prefix_digest)}")
    if len(req.checkpoints) > MAX_CHECKPOINTS:
        raise InvalidArgument(f"at most {MAX_CHECKPOINTS} checkpoints are allowed, got {len(req.checkpoints)}")
    last = 0
    for i, cp in enumerate(req.checkpoints):
        if not last < cp.tokens < covered:
            raise InvalidArgument(f"checkpoints[{i}].tokens must increase and stay within 1..{covered - 1} (below "
                                  f"the covered tokens), got {cp.tokens}")
        if len(cp.digest) != HASH_BYTES:
            raise InvalidArgument(f"checkpoints[{i}].digest must be {HASH_BYTES} bytes, got {len(cp.digest)}")
        last = cp.tokens
    return req.prefix_digest, list(req.checkpoints)


def claim_refusal(session: common_pb2.Session | None, revision: int, now: float) -> str | None:
    """Why ``session`` cannot be claimed at ``revision`` now, or None when it can."""
    if session is None:
        return MISSING
    if session.claimed:
        return CLAIMED
    if session.revision != revision:
        return f"{CHANGED}: the record is at revision {session.revision}, not {revision}"
    if not session.kv_transfer_params_json:
        return NO_HANDLE
    left = expires_in(session, now)
    if left <= 0:
        return f"{EXPIRED} {-left:.1f}s ago"
    return None

