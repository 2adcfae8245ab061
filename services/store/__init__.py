"""The session store in etcd, shared by the registry and the scheduler.

* ``keys``: the key layout (every key is built there; one owner).
* ``codec``: what each key holds (record, claim, index summary, leader values; one owner).
* ``interface``: the store's errors, a claim's result, and ``ClaimStore``, the small interface the scheduler uses.
* ``etcd_store``: ``EtcdStore``, the connection, retries and transactions (claims, campaigns, the index reads).
* ``etcd_channel``: the gRPC channel to etcd (TLS, user/password auth).
* ``etcd_maintenance``: each etcd member's database size, and defragmentation one member at a time.
* ``history``: ``HistoryStore``, sessions' exact token ids outside etcd (etcd keeps a small record), and its helpers.
* ``history_sqlite``, ``history_redis``: its backends (an embedded file for one registry; Redis for a cluster).
"""
