"""The session store in etcd, shared by the registry and the scheduler.

* ``keys``: the key layout (every key is built there; one owner).
* ``codec``: what each key holds (record, claim, index summary, leader values; one owner).
* ``interface``: the store's errors, a claim's result, and ``ClaimStore``, the small interface the scheduler uses.
* ``etcd_connection``: ``EtcdConnection``, the channel, the retries (``call``), the watch stream, txn compares.
* one store per kind of record, each on that connection: ``etcd_workers`` (workers and their watch),
  ``etcd_sessions`` (records and their indexes), ``etcd_claims`` (handle claims, the KV a worker holds),
  ``etcd_responses`` (stored responses), ``etcd_leases`` (leases, leader campaigns), ``etcd_outcomes`` and
  ``etcd_snapshots`` (shared learning's outcome log and learned snapshots).
* ``etcd_store``: ``EtcdStore``, the connection with those parts (``store.workers``, ``store.sessions``, ...).
* ``etcd_channel``: the gRPC channel to etcd (TLS, user/password auth).
* ``etcd_maintenance``: each etcd member's database size, and defragmentation one member at a time.
* ``history``: ``HistoryStore``, sessions' exact token ids outside etcd (etcd keeps a small record), and its helpers.
* ``history_sqlite``, ``history_redis``: its backends (an embedded file for one registry; Redis for a cluster).
"""
