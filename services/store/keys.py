"""The etcd key layout of kvshuttle: every key the registry and the scheduler read or write is built here.

Under ``prefix`` (default ``/kvshuttle/``; always ends with ``/``)::

    workers/{worker_id}                   Worker proto, attached to the worker's lease (Worker.lease_id)
    sessions/{tenant}/{session_id}        Session proto, attached to its own lease (TTL = seconds until expiry + grace)
    sessions/{tenant}/{session_id}!claim  the record's claim (the claimed revision, as text), on the record's lease
    worker-sessions/{worker_id}/{tenant}/{session_id}
                                          the record's decode worker (an index), on the record's lease; its value is
                                          a small summary of the record (a Session without ids, text or handle)
    worker-claims/{worker_id}/{tenant}/{session_id}
                                          the claimed revision (text), put by a claim next to the record's claim key,
                                          on the record's lease: with the index, what each decode worker still holds
    content/{tenant}/{text_key_hex}       the session id whose record's recorded text has this content key
                                          (Session.text_key), or one of whose text boundaries does
                                          (Session.text_boundaries), on the record's lease: FindSession's index.
                                          A record of a model (Session.model) is indexed under
                                          SHA-256("model\0" + model + "\0" + text key) instead, so that one
                                          model's find never reaches another's sessions
    responses/{tenant}/{response_id}      a stored Responses API response's index entry (StoredResponse proto, its
                                          body in the history store), on its conversation's lease
    leaders/{name}                        the id of the replica that leads ``name`` (e.g. the scheduler replica that
                                          frees decode KV), on that replica's lease
    learned/outcomes/{replica}/{seq}      one scheduler replica's reported outcomes (OutcomeBatch proto; seq: 16 hex
                                          digits), on a lease of the replica's that ends a few minutes later: every
                                          replica applies every batch in revision order (shared learning)
    learned/snapshot                      the learned state's latest snapshot: a JSON manifest (revision, chunks,
                                          sha256) of the zlib-compressed JSON state in ...
    learned/snapshot-chunks/{id}/{i}      ... these chunks (each under etcd's request limit)
    ping                                  never written: read to check that etcd answers

Deployed clusters hold these keys: a change here is a data migration. The values are :mod:`.codec`'s.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

# A session's claim key is its record's key + this: ids never contain "!", and it sorts before every id character.
CLAIM_SUFFIX = "!claim"
DEFAULT_PREFIX = "/kvshuttle/"


def normalized_prefix(prefix: str) -> str:
    """``prefix`` ending with ``/``."""
    return prefix if prefix.endswith("/") else prefix + "/"


@dataclass(frozen=True)
class Keys:
    """The keys under one prefix (see the module's layout). Build with :meth:`under` (it adds the trailing ``/``)."""

    prefix: str

    @classmethod
    def under(cls, prefix: str = DEFAULT_PREFIX) -> Keys:
        return cls(normalized_prefix(prefix))

    @property
    def ping(self) -> str:
        return f"{self.prefix}ping"

    # -- workers ---------------------------------------------------------------------------------------------

    @property
    def workers(self) -> str:
        """The prefix of every worker record."""
        return f"{self.prefix}workers/"

    def worker(self, worker_id: str) -> str:
        return f"{self.workers}{worker_id}"

    def worker_id_of(self, key: str) -> str:
        """The worker id of a worker record's key."""
        return key[len(self.workers):]

    # -- sessions --------------------------------------------------------------------------------------------

    def session(self, tenant: str, session_id: str) -> str:
        return f"{self.prefix}sessions/{tenant}/{session_id}"

    def claim(self, tenant: str, session_id: str) -> str:
        """The claim of a session's current record: a small key right after the record's (see session_range_end)."""
        return self.session(tenant, session_id) + CLAIM_SUFFIX

    @staticmethod
    def claim_of(record_key: str) -> str:
        return record_key + CLAIM_SUFFIX

    @staticmethod
    def session_range_end(record_key: str) -> bytes:
        """End of the range holding exactly a session's record and its claim key: ids use no character below '+', so
        no other session's key starts with the record's key followed by a character below '"' (the claim's '!')."""
        return (record_key + '"').encode()

    # -- the decode workers' index ---------------------------------------------------------------------------

    @property
    def worker_sessions(self) -> str:
        """The prefix of the whole worker-sessions index."""
        return f"{self.prefix}worker-sessions/"

    def worker_sessions_of(self, worker_id: str) -> str:
        """The prefix of the index entries of the records whose KV lives on ``worker_id``."""
        return f"{self.worker_sessions}{worker_id}/"

    def worker_session(self, worker_id: str, tenant: str, session_id: str) -> str:
        """The index entry saying that a session's KV lives on ``worker_id`` (it ends with the record's lease)."""
        return f"{self.worker_sessions_of(worker_id)}{tenant}/{session_id}"

    def worker_claims_of(self, worker_id: str) -> str:
        """The prefix of the claims noted under ``worker_id``."""
        return f"{self.prefix}worker-claims/{worker_id}/"

    def worker_claim(self, worker_id: str, tenant: str, session_id: str) -> str:
        return f"{self.worker_claims_of(worker_id)}{tenant}/{session_id}"

    # -- the content index ----------------------------------------------------------------------------------

    def content(self, tenant: str, text_key: bytes, model: str = "") -> str:
        """The content-index entry of a recorded text's key for ``model``'s sessions (FindSession): its value is the
        session id."""
        if model:
            text_key = hashlib.sha256(b"model\0" + model.encode() + b"\0" + text_key).digest()
        return f"{self.prefix}content/{tenant}/{text_key.hex()}"

    def response(self, tenant: str, response_id: str) -> str:
        return f"{self.prefix}responses/{tenant}/{response_id}"

    # -- leaders ---------------------------------------------------------------------------------------------

    def leader(self, name: str) -> str:
        return f"{self.prefix}leaders/{name}"

    # -- shared learning -------------------------------------------------------------------------------------

    @property
    def outcome_batches(self) -> str:
        """The prefix of every replica's outcome batches."""
        return f"{self.prefix}learned/outcomes/"

    def outcome_batch(self, replica: str, seq: int) -> str:
        return f"{self.outcome_batches}{replica}/{seq:016x}"

    @property
    def learned_snapshot(self) -> str:
        return f"{self.prefix}learned/snapshot"

    def learned_snapshot_chunks(self, snapshot_id: str) -> str:
        """The prefix of one snapshot's chunks."""
        return f"{self.prefix}learned/snapshot-chunks/{snapshot_id}/"


def session_ref(rest: str) -> tuple[str, str]:
    """``{tenant}/{session_id}`` (the end of an index or worker-claims key, after its worker's prefix) -> (tenant,
    session id); the session id is empty when ``rest`` is not such a pair."""
    tenant, _, session_id = rest.partition("/")
    return tenant, session_id


def first_segment(rest: str) -> str:
    """The first segment of a key's end (e.g. the worker id after the worker-sessions prefix)."""
    return rest.partition("/")[0]
