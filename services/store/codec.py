"""The etcd record codec of kvshuttle: what each key of :mod:`.keys` holds, encoded and parsed here.

* ``workers/...``: a ``Worker`` proto as sent by the worker (``lease_id`` included).
* ``sessions/...``: a ``Session`` proto without ``revision``, ``lease_id`` or ``claimed`` (those are etcd's: the
  key's mod_revision and lease, and whether the claim key exists). Read back, ``revision`` and ``lease_id`` are set
  from the key, and a claimed record comes with ``claimed`` set and its handle cleared.
* ``...!claim``: the claimed revision as text, then `` {free_reason}`` when the claim freed the KV.
* ``worker-sessions/...``: a summary of the record: a ``Session`` with ``covered_tokens``, ``block_size``, ``turn``
  and the three timestamps only (tens of bytes, whatever the history).
* ``worker-claims/...``: the claimed revision as text.
* ``leaders/...``: the holder's id (UTF-8).

Deployed clusters hold these bytes: a change here is a data migration.
"""

from __future__ import annotations

import logging

from google.protobuf.message import DecodeError
from kvshuttle.services.store.keys import CLAIM_SUFFIX
from kvshuttle.v1 import common_pb2, registry_pb2

log = logging.getLogger(__name__)


# -- workers -----------------------------------------------------------------------------------------------------

def worker_value(worker: common_pb2.Worker) -> bytes:
    return worker.SerializeToString()


def parse_worker(value: bytes) -> common_pb2.Worker | None:
    try:
        return common_pb2.Worker.FromString(value)
    except DecodeError:
        log.warning("skipping a worker record that does not parse (%d bytes)", len(value))
        return None


# -- sessions ----------------------------------------------------------------------------------------------------

def stored_record(session: common_pb2.Session) -> tuple[common_pb2.Session, bytes]:
    """A copy of ``session`` as stored (no revision, lease or claim: those are etcd's; no history ids: the history
    store holds those), and its value."""
    record = common_pb2.Session()
    record.CopyFrom(session)
    record.revision, record.lease_id, record.claimed = 0, 0, False
    record.ClearField("token_ids")
    if record.handle_digest:  # the history store keeps the handle
        record.kv_transfer_params_json = ""
    return record, record.SerializeToString()


def parse_session(value: bytes, mod_revision: int) -> common_pb2.Session | None:
    """A record (or an index entry's summary), ``revision`` = the key's mod_revision; None when it does not parse."""
    try:
        session = common_pb2.Session.FromString(value)
    except DecodeError:
        log.warning("ignoring a session record that does not parse (%d bytes)", len(value))
        return None
    session.revision = mod_revision
    return session


def session_from(kvs, key: str) -> common_pb2.Session | None:
    """The record among ``kvs`` (a range up to Keys.session_range_end), claimed when its claim key is there too: the
    handle is cleared then (it is spent)."""
    record = claim = None
    for kv in kvs:
        if kv.key == key.encode():
            record = kv
        elif kv.key == (key + CLAIM_SUFFIX).encode():
            claim = kv
    if record is None:
        return None
    session = parse_session(record.value, record.mod_revision)
    if session is None:
        return None
    session.lease_id = record.lease
    if claim is not None:
        session.claimed = True
        session.kv_transfer_params_json = ""
        session.kv_freed = claim_free_reason(claim.value)
    return session


def handle_cleared(session: common_pb2.Session | None) -> common_pb2.Session | None:
    """A copy of ``session`` without its handle (what a refused claim answers)."""
    if session is None:
        return None
    out = common_pb2.Session()
    out.CopyFrom(session)
    out.kv_transfer_params_json = ""
    return out


# -- claims ------------------------------------------------------------------------------------------------------

def claim_value(revision: int, free_reason: str) -> bytes:
    """A claim key's value: the claimed revision, then the free reason when the claim freed the KV."""
    return f"{revision} {free_reason}".encode() if free_reason else str(revision).encode()


def claim_free_reason(value: bytes) -> str:
    """The free reason of a claim key's value ('' when the claim was a turn's)."""
    return value.decode(errors="replace").partition(" ")[2]


def worker_claim_value(revision: int) -> bytes:
    """A worker-claims entry's value: the claimed revision (compared with its index entry's mod_revision)."""
    return str(revision).encode()


# -- the decode workers' index -----------------------------------------------------------------------------------

def summary(record: common_pb2.Session) -> bytes:
    """The index entry's value: what the KV manager weighs a held handle by (tens of bytes, whatever the history)."""
    out = common_pb2.Session(covered_tokens=record.covered_tokens, block_size=record.block_size, turn=record.turn)
    for name in ("expires_at", "updated_at", "created_at"):
        if record.HasField(name):
            getattr(out, name).CopyFrom(getattr(record, name))
    return out.SerializeToString()


def content_value(session_id: str) -> bytes:
    """A content-index entry's value: the session id."""
    return session_id.encode()


def content_session_id(value: bytes) -> str:
    return value.decode(errors="replace")


# -- stored responses --------------------------------------------------------------------------------------------

def response_value(response: registry_pb2.StoredResponse) -> bytes:
    return response.SerializeToString()


def parse_response(value: bytes) -> registry_pb2.StoredResponse | None:
    try:
        return registry_pb2.StoredResponse.FromString(value)
    except DecodeError:
        log.warning("ignoring a stored response that does not parse (%d bytes)", len(value))
        return None


# -- leaders -----------------------------------------------------------------------------------------------------

def leader_value(holder: str) -> bytes:
    return holder.encode()
