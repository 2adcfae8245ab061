"""`kvshuttle registry`: the SessionRegistry gRPC service over etcd."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence

from kvshuttle.services.common import metrics
from kvshuttle.services.common.config import TelemetryConfig, require, require_effect, setting
from kvshuttle.services.common.grpc_server import Server, service_main
from kvshuttle.services.common.metrics_http import MetricsServer, check_listen
from kvshuttle.services.common.tls import EtcdSecurityConfig, TlsConfig
from kvshuttle.services.registry.census import Census
from kvshuttle.services.registry.defrag import Defragmenter
from kvshuttle.services.registry.janitor import SessionJanitor
from kvshuttle.services.registry.servicer import SessionRegistryServicer
from kvshuttle.services.store.etcd_store import EtcdStore, parse_endpoints
from kvshuttle.services.store.history_url import check_history_url, open_history_store
from kvshuttle.v1 import registry_pb2_grpc

SERVICE_NAME = "kvshuttle.v1.SessionRegistry"
ANSWER_FRAMING_BYTES = 64 << 10  # kept free of GetResponseChain's bound in one answer (headers, framing)
log = logging.getLogger(__name__)


@dataclasses.dataclass
class RegistryConfig(TelemetryConfig, TlsConfig, EtcdSecurityConfig):
    """Session registry: workers under leases and where each session's KV lives, stored in etcd."""

    ENV_PREFIX = "KVSHUTTLE_REGISTRY_"
    listen: str = setting("127.0.0.1:50051", "gRPC listen address (host:port; port 0 picks a free one)")
    etcd_endpoints: str = setting("127.0.0.1:2379", "etcd client endpoints, comma-separated (host:port,...)",
                                  env="KVSHUTTLE_ETCD_ENDPOINTS")
    key_prefix: str = setting("/kvshuttle/", "etcd key prefix for all registry records")
    history_store: str = setting("sqlite::memory:", "Where sessions' exact token ids live (etcd keeps only a small "
                                                    "record): 'sqlite:PATH' for one registry (the local stack), "
                                                    "'redis://HOST:PORT/DB' for several replicas sharing it "
                                                    "(clusters); 'sqlite::memory:' is lost on restart",
                                 env="KVSHUTTLE_HISTORY_STORE")
    handle_inline_bytes: int = setting(1024, "A KV handle longer than this (vLLM's JSON lists every KV block) is kept "
                                             "in the history store, not in the etcd record; the schedulers then "
                                             "need the same --history-store")
    worker_lease_ttl_s: int = setting(10, "Worker lease TTL in seconds when RegisterWorker asks for 0")
    expiry_margin_s: float = setting(30.0, "Seconds subtracted from a decode worker's KV TTL for a handle's expiry")
    etcd_timeout_s: float = setting(5.0, "Deadline for each etcd operation, retries included")
    etcd_attempt_timeout_s: float = setting(2.0, "Deadline for one try of an etcd operation (then it is retried)")
    drop_departed_sessions: bool = setting(True, "Delete the session records of decode workers whose lease ended "
                                                 "(their KV is gone)")
    departed_grace_s: float = setting(10.0, "A departed worker's sessions stay this long; if it registers again "
                                            "with the same engine meanwhile (its lease was lost, not its KV), "
                                            "they are kept")
    metrics_listen: str = setting("", "Serve Prometheus metrics at http://HOST:PORT/metrics (port 0: a free one, "
                                      "logged at start-up); empty: no metrics endpoint")
    census_interval_s: float = setting(10.0, "With --metrics-listen: count the live workers and session records in "
                                             "etcd this often (kvshuttle_live_* gauges)")
    etcd_defrag_interval_s: float = setting(3600.0, "Check etcd's members this often and defragment (one at a time, "
                                                    "the leader last) those whose database file holds more than "
                                                    "--etcd-defrag-min-free-mb or --etcd-defrag-min-free-ratio of "
                                                    "pages freed by compaction (only defragmentation shrinks the "
                                                    "file); one registry replica does it (an etcd lease); 0: never")
    etcd_defrag_min_free_mb: int = setting(64, "Defragment an etcd member when more than this many MiB of its "
                                               "database file are free")
    etcd_defrag_min_free_ratio: float = setting(0.5, "Defragment an etcd member also when more than this share "
                                                     "of its database file is free (and at least 1 MiB)")
    etcd_defrag_timeout_s: float = setting(60.0, "Deadline for each etcd member's defragmentation (it blocks that "
                                                 "member while it runs)")
    log_level: str = setting("INFO", "Log level", env="KVSHUTTLE_LOG_LEVEL")

    def validate(self) -> None:
        check_listen(self.metrics_listen)
        require(self.census_interval_s > 0, "--census-interval-s must be > 0")
        require_effect(self, "census_interval_s", bool(self.metrics_listen),
                       "without --metrics-listen (the census feeds the metrics endpoint's gauges)")
        try:
            parse_endpoints(self.etcd_endpoints)
        except ValueError:
            require(False, "--etcd-endpoints (KVSHUTTLE_ETCD_ENDPOINTS) must list at least one host:port")
        problem = check_history_url(self.history_store)
        require(problem is None, problem or "")
        require(self.handle_inline_bytes >= 0, "--handle-inline-bytes must be >= 0")
        require(self.key_prefix.startswith("/"), "--key-prefix must start with '/'")
        if not self.key_prefix.endswith("/"):
            self.key_prefix += "/"
        require(self.worker_lease_ttl_s >= 1, "--worker-lease-ttl-s must be >= 1")
        require(self.expiry_margin_s >= 0, "--expiry-margin-s must be >= 0")
        require(self.departed_grace_s >= 0, "--departed-grace-s must be >= 0")
        require(self.etcd_timeout_s > 0, "--etcd-timeout-s must be > 0")
        require(self.etcd_attempt_timeout_s > 0, "--etcd-attempt-timeout-s must be > 0")
        require(self.etcd_defrag_interval_s >= 0, "--etcd-defrag-interval-s must be >= 0 (0: never)")
        require(self.etcd_defrag_min_free_mb >= 0, "--etcd-defrag-min-free-mb must be >= 0")
        require(0 < self.etcd_defrag_min_free_ratio <= 1, "--etcd-defrag-min-free-ratio must be in (0, 1]")
        require(self.etcd_defrag_timeout_s > 0, "--etcd-defrag-timeout-s must be > 0")
        self.validate_tls()
        self.validate_etcd_security()


class RegistryService:
    """The registry's gRPC server and etcd store; ``start()``/``stop()`` for in-process use."""

    def __init__(self, cfg: RegistryConfig):
        self.cfg = cfg
        self.history = open_history_store(cfg.history_store, cfg.key_prefix)
        self.store = EtcdStore(cfg.etcd_endpoints, cfg.key_prefix, timeout_s=cfg.etcd_timeout_s,
                               attempt_timeout_s=cfg.etcd_attempt_timeout_s, security=cfg.etcd_security(),
                               on_op=metrics.etcd_op, handles=self.history)
        self.servicer = SessionRegistryServicer(self.store, self.history, default_lease_ttl_s=cfg.worker_lease_ttl_s,
                                                expiry_margin_s=cfg.expiry_margin_s,
                                                handle_inline_bytes=cfg.handle_inline_bytes,
                                                max_answer_bytes=cfg.max_message_bytes - ANSWER_FRAMING_BYTES)
        self.server = Server(cfg.listen, [SERVICE_NAME],
                             [lambda s: registry_pb2_grpc.add_SessionRegistryServicer_to_server(self.servicer, s)],
                             tls=cfg.server_tls(), max_message_bytes=cfg.max_message_bytes)
        self.address = self.server.address
        self.janitor = (SessionJanitor(self.store.workers, self.store.sessions, cfg.departed_grace_s)
                        if cfg.drop_departed_sessions else None)
        self.metrics = (MetricsServer(cfg.metrics_listen, metrics.registry_for("registry"), name="registry")
                        if cfg.metrics_listen else None)
        self.census = (Census(self.store.workers, self.store.sessions, cfg.census_interval_s)
                       if self.metrics is not None else None)
        self.defragmenter = (Defragmenter(self.store, cfg.etcd_defrag_interval_s,
                                          min_free_bytes=cfg.etcd_defrag_min_free_mb << 20,
                                          min_free_ratio=cfg.etcd_defrag_min_free_ratio,
                                          timeout_s=cfg.etcd_defrag_timeout_s)
                             if cfg.etcd_defrag_interval_s > 0 else None)

    async def start(self) -> None:
        await self.store.connect()
        await self.history.connect()
        if self.cfg.history_store == "sqlite::memory:":
            log.warning("sessions' token ids are kept in memory (--history-store sqlite::memory:): a restarted "
                        "registry loses them, and the next turns tokenize their text again")
        await self.server.start()
        if self.janitor is not None:
            self.janitor.start()
        if self.defragmenter is not None:
            self.defragmenter.start()
        if self.metrics is not None:
            await self.metrics.start()
            self.census.start()
        log.info("registry on %s, etcd %s, prefix %s", self.address, self.cfg.etcd_endpoints, self.cfg.key_prefix)

    async def stop(self, grace: float = 2.0) -> None:
        if self.metrics is not None:
            await self.census.stop()
            await self.metrics.stop()
        if self.defragmenter is not None:
            await self.defragmenter.stop()
        if self.janitor is not None:
            await self.janitor.stop()
        await self.server.stop(grace)
        await self.servicer.drain()
        await self.history.close()
        await self.store.close()


async def serve(cfg: RegistryConfig) -> RegistryService:
    """Start a registry in this process (tests, the local launcher); ``await service.stop()`` when done."""
    service = RegistryService(cfg)
    await service.start()
    return service


def main(argv: Sequence[str] | None = None) -> None:
    service_main(RegistryConfig, argv, "kvshuttle registry", "kvshuttle-registry", RegistryService)


if __name__ == "__main__":
    main()
