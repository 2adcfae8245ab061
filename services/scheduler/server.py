"""`kvshuttle scheduler`: the TransferScheduler gRPC service."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence

from kvshuttle.control_plane.cost_model import PrefillCostModel
from kvshuttle.control_plane.kv_eviction import KvLimits
from kvshuttle.control_plane.planner import Planner
from kvshuttle.control_plane.policies import (
    KINDS,
    PolicyError,
    make_policy,
    make_prior,
    parse_params,
    parse_policy_specs,
)
from kvshuttle.control_plane.selection import SELECTORS, make_selector
from kvshuttle.services.common import metrics
from kvshuttle.services.common.config import TelemetryConfig, require, require_effect, setting
from kvshuttle.services.common.grpc_server import Server, client_channel, service_main
from kvshuttle.services.common.metrics_http import MetricsServer, check_listen
from kvshuttle.services.common.tls import EtcdSecurityConfig, TlsConfig
from kvshuttle.services.common.worker_view import WorkerView
from kvshuttle.services.scheduler.claims import EtcdClaims, RegistryClaims, SessionClaims
from kvshuttle.services.scheduler.kv_manager import KvManager
from kvshuttle.services.scheduler.learning import Learning, LocalLearning, SharedLearning
from kvshuttle.services.scheduler.load_monitor import LoadMonitor
from kvshuttle.services.scheduler.prefix_index import PrefixIndex
from kvshuttle.services.scheduler.servicer import TransferSchedulerServicer
from kvshuttle.services.store.etcd_store import EtcdStore, parse_endpoints
from kvshuttle.services.store.history_url import check_history_url, open_history_store
from kvshuttle.v1 import common_pb2, registry_pb2_grpc, scheduler_pb2_grpc

SERVICE_NAME = "kvshuttle.v1.TransferScheduler"
log = logging.getLogger(__name__)


@dataclasses.dataclass
class SchedulerConfig(TelemetryConfig, TlsConfig, EtcdSecurityConfig):
    """Transfer scheduler: plans each turn's prefill/decode workers and pull-vs-recompute."""

    ENV_PREFIX = "KVSHUTTLE_SCHEDULER_"
    listen: str = setting("127.0.0.1:50052", "gRPC listen address (host:port; port 0 picks a free one)")
    registry: str = setting("127.0.0.1:50051", "Session registry gRPC address", env="KVSHUTTLE_REGISTRY_ADDRESS")
    etcd_endpoints: str = setting("", "etcd client endpoints (host:port,...) of the registry's store: when set, the "
                                      "scheduler reads session records and claims KV handles in etcd itself, with "
                                      "the registry's store code, instead of through the registry (one hop less "
                                      "per plan); empty: through the registry", env="KVSHUTTLE_ETCD_ENDPOINTS")
    key_prefix: str = setting("/kvshuttle/", "The registry's etcd key prefix (with --etcd-endpoints)",
                              env="KVSHUTTLE_REGISTRY_KEY_PREFIX")
    history_store: str = setting("", "The registry's history store (with --etcd-endpoints): where records keep KV "
                                     "handles too long for etcd (sqlite:PATH on the registry's machine, or its Redis "
                                     "URL); empty: such handles cannot be read, and those sessions recompute",
                                 env="KVSHUTTLE_HISTORY_STORE")
    policy: str = setting("cost", "Default pull-vs-recompute policy: cost (pull unless the learned cost model "
                                  "predicts recomputing faster) or threshold (pull when enough tokens are reusable, "
                                  "vLLM's rule)", choices=tuple(KINDS))
    policy_params: str = setting("", "The default policy's parameters as key=value,... (threshold: "
                                     "pull_threshold_tokens; cost: min_pull_tokens, explore_every, explore_ratio, "
                                     "warmup_pulls, recompute_margin, continue_on_decode (auto, always or never: "
                                     "whether a turn that could pull may continue on the decode worker holding its "
                                     "KV instead), local_margin, decode_itl_slo_ms; both: expiry_guard_s)")
    policies: str = setting("", "More named policies a request may choose (PlanTurnRequest.policy, the gateway's "
                                "`policy` field), for A/B tests and benchmarks: name=kind[:key=value,...];...")
    cost_model_params: str = setting("", "The cost model's priors and fitting (key=value,...): fixed_ms, "
                                         "ms_per_ktoken, ms_per_ktoken_per_kcontext, ms_per_transfer, "
                                         "ms_per_kpulled, prior_weight, window, half_life, memory, surprise, change_after")
    selector: str = setting("load", "How prefill and decode workers are chosen: load (predicted time and queue for "
                                    "P, free KV cache for D) or round_robin", choices=tuple(SELECTORS))
    candidates: int = setting(0, "Workers of each role scored per turn: a random sample of this many, plus the "
                                 "session's last prefill worker (for fleets of hundreds of workers); 0: all")
    load_poll_interval_s: float = setting(0.5, "Poll each worker's vLLM GetLoads this often (0: never; every "
                                               "worker then counts as idle)")
    load_timeout_s: float = setting(1.0, "Deadline of one GetLoads poll")
    kv_feed: str = setting("", "Redis URL of the KV feed the prefill workers publish their KV-cache events to "
                               "(their --kv-feed; keys under --key-prefix): the planner then knows which prompt "
                               "blocks each prefill worker caches and routes turns to them, and reads the workers' "
                               "load samples there instead of polling each (it polls those whose samples stop); "
                               "empty: it knows only which worker served each session's last turn, and polls every "
                               "worker", env="KVSHUTTLE_KV_FEED")
    pull_threshold_tokens: int = setting(16, "threshold policy: fewest reusable tokens worth a pull")
    expiry_guard_s: float = setting(2.0, "Refuse a pull when the handle expires within this many seconds")
    decode_itl_slo_ms: float = setting(100.0, "Decode inter-token SLO: a turn is never continued on its decode worker "
                                              "when the prefill it would add to that worker's batch is predicted to "
                                              "delay each stream it is decoding by more than this (cost policies; a "
                                              "policy's decode_itl_slo_ms overrides it)")
    registry_timeout_s: float = setting(2.0, "Deadline for each registry (or etcd) call on the planning path")
    metrics_listen: str = setting("", "Serve Prometheus metrics at http://HOST:PORT/metrics (port 0: a free one, "
                                      "logged at start-up); empty: no metrics endpoint")
    kv_manage: bool = setting(True, "Manage the decode workers' held KV: free sessions idle past --kv-idle-limit-s, "
                                    "free the least valuable held handles when a decode worker's KV passes "
                                    "--kv-high-water (or held KV --kv-held-budget), and make room before a turn "
                                    "lands on a full one. Needs --etcd-endpoints (without them the scheduler says "
                                    "so at start and in GetStats; held KV then ends with the workers' TTL)")
    kv_high_water: float = setting(0.8, "Free held KV on a decode worker once its KV cache usage passes this fraction")
    kv_low_water: float = setting(0.6, "... until its usage is back under this fraction")
    kv_held_budget: float = setting(0.7, "Held KV (sessions between turns) may take at most this fraction of a "
                                         "decode worker's KV cache; past it, free down to it less the "
                                         "high/low-water gap (0: no budget)")
    kv_idle_limit_s: float = setting(240.0, "Free a session's KV after this many seconds without a turn; keep it "
                                            "below the decode workers' decoder_kv_blocks_ttl (0: never)")
    kv_eviction_ranking: str = setting("value", "What to free first under pressure: value (lowest expected "
                                                "prefill time saved per byte: the chance the session comes back "
                                                "before expiry x what a pull saves / KV held) or lru (least recently "
                                                "used)", choices=("value", "lru"))
    kv_interval_s: float = setting(1.0, "Seconds between two rounds of the decode-KV manager")
    kv_room_timeout_s: float = setting(3.0, "Longest a turn waits for room to be made on a full decode worker "
                                            "(then it goes ahead)")
    learning: str = setting("shared", "How the cost model learns: shared (needs --etcd-endpoints: every outcome "
                                      "reported to any replica, gateway-embedded planners included, goes through "
                                      "etcd and every replica applies all of them in the same order, so all of "
                                      "them fit the same model; a replica starting later begins from the latest "
                                      "snapshot) or local (each replica learns from the outcomes reported to it)",
                            choices=("shared", "local"))
    learning_snapshot_interval_s: float = setting(30.0, "shared learning: seconds between two snapshots of the "
                                                        "learned state (written by one replica)")
    learning_batch_ttl_s: int = setting(120, "shared learning: how long etcd keeps each batch of outcomes (a replica "
                                             "starting from a snapshot older than half of this misses some); etcd "
                                             "holds about this many seconds of outcomes, ~100 bytes each")
    max_connection_age_s: float = setting(300.0, "Close each client's connection after this many seconds (gRPC "
                                                 "MAX_CONNECTION_AGE; calls in flight get 30 s more): gateways that "
                                                 "dial every replica by name (dns:///) then resolve it again and "
                                                 "spread their plans over replicas added since; 0: never")
    log_level: str = setting("INFO", "Log level", env="KVSHUTTLE_LOG_LEVEL")

    def validate(self) -> None:
        check_listen(self.metrics_listen)
        if self.history_store:
            problem = check_history_url(self.history_store)
            require(problem is None, problem or "")
            require(self.history_store != "sqlite::memory:", "--history-store sqlite::memory: is the registry's "
                                                             "own memory: give the scheduler its file or Redis URL")
        try:
            self.kv_limits()
        except ValueError as exc:
            require(False, f"--kv-high-water/--kv-low-water/--kv-held-budget/--kv-idle-limit-s: {exc}")
        require(self.learning_snapshot_interval_s > 0, "--learning-snapshot-interval-s must be > 0")
        require(self.max_connection_age_s >= 0, "--max-connection-age-s must be >= 0")
        require(self.learning_batch_ttl_s >= max(10, 2 * self.learning_snapshot_interval_s),
                "--learning-batch-ttl-s must be >= 10 and at least twice --learning-snapshot-interval-s")
        require(self.kv_interval_s > 0 and self.kv_room_timeout_s > 0,
                "--kv-interval-s and --kv-room-timeout-s must be > 0")
        require(self.pull_threshold_tokens >= 1, "--pull-threshold-tokens must be >= 1")
        require(self.expiry_guard_s >= 0, "--expiry-guard-s must be >= 0")
        require(self.decode_itl_slo_ms > 0, "--decode-itl-slo-ms must be > 0")
        require(self.registry_timeout_s > 0, "--registry-timeout-s must be > 0")
        if self.etcd_endpoints:
            try:
                parse_endpoints(self.etcd_endpoints)
            except ValueError:
                require(False, "--etcd-endpoints (KVSHUTTLE_ETCD_ENDPOINTS) must list host:port,... or be empty")
        require(self.key_prefix.startswith("/"), "--key-prefix must start with '/'")
        if not self.key_prefix.endswith("/"):
            self.key_prefix += "/"
        require(self.load_poll_interval_s >= 0 and self.load_timeout_s > 0,
                "--load-poll-interval-s must be >= 0 and --load-timeout-s > 0")
        require_effect(self, "load_timeout_s", self.load_poll_interval_s > 0, "with --load-poll-interval-s 0 (no polls)")
        for name in ("kv_high_water", "kv_low_water", "kv_held_budget", "kv_idle_limit_s", "kv_eviction_ranking",
                     "kv_interval_s", "kv_room_timeout_s"):
            require_effect(self, name, self.kv_manage, "with --no-kv-manage")
        for name in ("learning_snapshot_interval_s", "learning_batch_ttl_s"):
            require_effect(self, name, self.learning == "shared", "with --learning local")
        require_effect(self, "history_store", bool(self.etcd_endpoints),
                       "without --etcd-endpoints (the scheduler then reads records through the registry)")
        require_effect(self, "key_prefix", bool(self.etcd_endpoints or self.kv_feed),
                       "without --etcd-endpoints or --kv-feed (the scheduler then reads records through the registry)")
        require(not self.kv_feed or self.kv_feed.startswith(("redis://", "rediss://", "unix://")),
                "--kv-feed (KVSHUTTLE_KV_FEED) must be a redis://, rediss:// or unix:// URL, or empty")
        self.validate_tls()
        self.validate_etcd_security()
        try:
            self.make_planner()
        except PolicyError as exc:
            require(False, f"--policy/--policy-params/--policies/--cost-model-params: {exc}")

    def kv_limits(self) -> KvLimits:
        return KvLimits(high_water=self.kv_high_water, low_water=self.kv_low_water, held_budget=self.kv_held_budget,
                        idle_limit_s=self.kv_idle_limit_s)

    def make_planner(self) -> Planner:
        """The default policy (named after its kind), the named extra policies, one cost model shared by them."""
        model = PrefillCostModel(make_prior(parse_params(self.cost_model_params)))
        params = parse_params(self.policy_params)
        if self.policy == "threshold":
            params.setdefault("pull_threshold_tokens", str(self.pull_threshold_tokens))
        policies = {self.policy: make_policy(self.policy, params, model=model, expiry_guard_s=self.expiry_guard_s,
                                             decode_itl_slo_ms=self.decode_itl_slo_ms)}
        for name, kind, extra in parse_policy_specs(self.policies):
            if name in policies:
                raise PolicyError(f"policy name {name!r} is used twice")
            policies[name] = make_policy(kind, extra, model=model, expiry_guard_s=self.expiry_guard_s, name=name,
                                         decode_itl_slo_ms=self.decode_itl_slo_ms)
        return Planner(policies, self.policy, model, make_selector(self.selector), candidates=self.candidates)


class SchedulerService:
    """The scheduler with its registry channel and worker view; start()/stop() for in-process use."""

    def __init__(self, cfg: SchedulerConfig):
        self.cfg = cfg
        self.channel = client_channel(cfg.registry, cfg.client_tls(), max_message_bytes=cfg.max_message_bytes)
        registry = registry_pb2_grpc.SessionRegistryStub(self.channel)
        self.workers = WorkerView(registry)
        self.planner = cfg.make_planner()
        self.claims = self.make_claims(cfg, registry)
        self.loads = (LoadMonitor(self.workers, cfg.load_poll_interval_s, cfg.load_timeout_s,
                                  feed_url=cfg.kv_feed, feed_key_prefix=cfg.key_prefix)
                      if cfg.load_poll_interval_s > 0 else None)
        self.prefix = PrefixIndex(self.workers, cfg.kv_feed, cfg.key_prefix) if cfg.kv_feed else None
        self.kv = (KvManager(self.claims, self.workers, self.loads, self.planner.model, cfg.kv_limits(),
                             cfg.kv_eviction_ranking, interval_s=cfg.kv_interval_s,
                             room_timeout_s=cfg.kv_room_timeout_s)
                   if cfg.kv_manage and isinstance(self.claims, EtcdClaims) else None)
        self.learning: Learning = (SharedLearning(self.claims.store, self.planner,
                                                  snapshot_interval_s=cfg.learning_snapshot_interval_s,
                                                  batch_ttl_s=cfg.learning_batch_ttl_s)
                                   if cfg.learning == "shared" and isinstance(self.claims, EtcdClaims)
                                   else LocalLearning(self.planner))
        self.servicer = servicer = TransferSchedulerServicer(
            registry, self.workers, self.planner, cfg.registry_timeout_s, self.claims, self.loads, self.kv,
            self.learning, self.prefix)
        self.planning = servicer.planning  # the same, without gRPC (in_process.InProcessScheduler)
        self.server = Server(cfg.listen, [SERVICE_NAME],
                             [lambda s: scheduler_pb2_grpc.add_TransferSchedulerServicer_to_server(servicer, s)],
                             tls=cfg.server_tls(), max_message_bytes=cfg.max_message_bytes,
                             options=[("grpc.max_connection_age_ms", int(cfg.max_connection_age_s * 1000)),
                                      ("grpc.max_connection_age_grace_ms", 30_000)]
                             if cfg.max_connection_age_s > 0 else ())
        self.address = self.server.address
        metrics.SCHEDULER_STATE.register(self.metrics_state)
        self.metrics = (MetricsServer(cfg.metrics_listen, metrics.registry_for("scheduler"), name="scheduler")
                        if cfg.metrics_listen else None)

    def metrics_state(self) -> metrics.SchedulerState:
        """The workers by role and state (live: their load polls answer; unreachable: they fail; unknown: not polled
        yet, or polling off), the policies' regret and the decode KV, for the scheduler's /metrics."""
        counts = {(role, state): 0 for role in metrics.ROLES for state in metrics.WORKER_STATES}
        for role_name, role in (("prefill", common_pb2.WORKER_ROLE_PREFILL), ("decode", common_pb2.WORKER_ROLE_DECODE)):
            for w in self.workers.by_role(role):
                healthy = self.loads.healthy(w.worker_id) if self.loads is not None else None
                counts[(role_name, "unknown" if healthy is None else "live" if healthy else "unreachable")] += 1
        meter = self.planner.regret
        return metrics.SchedulerState(
            workers=counts, judged={name: meter.turns.get(name, 0) for name in self.planner.policies},
            regrets={name: meter.regrets.get(name, 0) for name in self.planner.policies},
            decode_kv=self.kv.metrics_rows() if self.kv is not None else ())

    @staticmethod
    def make_claims(cfg: SchedulerConfig, registry: registry_pb2_grpc.SessionRegistryStub) -> SessionClaims:
        if not cfg.etcd_endpoints:
            return RegistryClaims(registry, cfg.registry_timeout_s)
        history = open_history_store(cfg.history_store, cfg.key_prefix) if cfg.history_store else None
        store = EtcdStore(cfg.etcd_endpoints, cfg.key_prefix, timeout_s=cfg.registry_timeout_s,
                          attempt_timeout_s=cfg.registry_timeout_s / 2, security=cfg.etcd_security(),
                          on_op=metrics.etcd_op, handles=history)
        if history is None:
            log.warning("no --history-store: sessions whose KV handle the registry keeps in its history store "
                        "(handles over its --handle-inline-bytes) recompute; give the registry's")
        return EtcdClaims(store, history=history)

    async def start(self) -> None:
        await self.claims.start()
        await self.learning.start()
        if cfg_shared_but_local(self.cfg, self.learning):
            log.warning("learning is NOT shared: it needs --etcd-endpoints (KVSHUTTLE_ETCD_ENDPOINTS); each scheduler "
                        "replica learns only from the outcomes reported to it")
        self.workers.start()
        if self.loads is not None:
            self.loads.start()
        if self.prefix is not None:
            self.prefix.start()
        if self.kv is not None:
            self.kv.start()
            log.info("managing decode KV: %s", self.kv.describe())
        elif self.cfg.kv_manage:
            log.warning("decode KV is NOT managed: it needs --etcd-endpoints (KVSHUTTLE_ETCD_ENDPOINTS); held KV "
                        "ends with the decode workers' TTL")
        await self.server.start()
        if self.metrics is not None:
            await self.metrics.start()
        log.info("sessions are read and claimed via %s%s", self.claims.via,
                 f" ({self.cfg.etcd_endpoints}, prefix {self.cfg.key_prefix})" if self.cfg.etcd_endpoints else "")

    async def stop(self) -> None:
        if self.metrics is not None:
            await self.metrics.stop()
        await self.server.stop()
        if self.kv is not None:
            await self.kv.stop()
        if self.loads is not None:
            await self.loads.stop()
        if self.prefix is not None:
            await self.prefix.stop()
        await self.workers.stop()
        await self.learning.stop()
        await self.claims.close()
        await self.channel.close()


def cfg_shared_but_local(cfg: SchedulerConfig, learning: Learning) -> bool:
    return cfg.learning == "shared" and isinstance(learning, LocalLearning)


def main(argv: Sequence[str] | None = None) -> None:
    service_main(SchedulerConfig, argv, "kvshuttle scheduler", "kvshuttle-scheduler", SchedulerService)
