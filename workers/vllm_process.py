"""The vLLM gRPC server of one worker: its command line and environment, and its life as a child process.

:func:`vllm_command` is the single source of truth for how a worker's vLLM is started (the Helm chart renders the
same). :class:`VllmProcess` runs it in its own process group, so stopping it (SIGTERM, then SIGKILL after a grace
period) takes vLLM's engine-core and helper processes with it.
"""

from __future__ import annotations

import dataclasses
import json
import shlex
import shutil
import sys
from pathlib import Path

from kvshuttle.control_plane.kv_index import hashing
from kvshuttle.services.common.config import TelemetryConfig, require, require_effect, setting
from kvshuttle.services.common.processes import ChildProcess
from kvshuttle.services.common.tls import TlsClientConfig

ROLES = ("prefill", "decode")
# A plain vLLM server that prefills and decodes itself (no KV connector): the benchmark's "ideal" baseline.
COLOCATED = "colocated"
WILDCARD_HOSTS = ("0.0.0.0", "::", "[::]", "")


@dataclasses.dataclass
class WorkerConfig(TelemetryConfig, TlsClientConfig):
    """Worker agent: runs one vLLM gRPC server (prefill or decode) and keeps it registered."""

    ENV_PREFIX = "KVSHUTTLE_WORKER_"
    role: str = setting("", "Worker role", choices=ROLES)
    model: str = setting("", "Model directory")
    served_model_name: str = setting("", "Served model name (default: the model directory's name)")
    host: str = setting("127.0.0.1", "vLLM gRPC listen host")
    grpc_port: int = setting(50061, "vLLM gRPC port")
    advertise_host: str = setting("", "Host others use to reach this worker (default: --host)")
    nixl_host: str = setting("127.0.0.1", "NIXL side-channel host (VLLM_NIXL_SIDE_CHANNEL_HOST)")
    nixl_port: int = setting(5600, "NIXL side-channel port (VLLM_NIXL_SIDE_CHANNEL_PORT)")
    cpu_bind: str = setting("", "CPU vLLM: cores for the OMP threads (VLLM_CPU_OMP_THREADS_BIND); empty: unset")
    cuda_visible_devices: str = setting("", "GPU vLLM: CUDA_VISIBLE_DEVICES for this worker's vLLM; empty: inherit")
    kv_cache_gib: int = setting(1, "CPU vLLM: KV cache size in GiB (VLLM_CPU_KVCACHE_SPACE); 0: unset")
    gpu_memory_utilization: float = setting(0.0, "GPU vLLM: --gpu-memory-utilization; 0: vLLM's default")
    tensor_parallel_size: int = setting(1, "GPU vLLM: --tensor-parallel-size (GPUs per worker)")
    kv_buffer_device: str = setting("cpu", "NixlConnector kv_buffer_device", choices=("cpu", "cuda", "xpu"))
    dtype: str = setting("float32", "Model dtype (float32 for exact-equality tests; bfloat16 for speed)")
    block_size: int = setting(0, "KV block size in tokens; 0: vLLM's default")
    prefix_hash_algo: str = setting(
        hashing.DEFAULT_ALGO, "vLLM --prefix-caching-hash-algo: how its prefix cache (and its KV events) name "
        "blocks; only those kvshuttle's KV index can reproduce", choices=hashing.ALGOS)
    prefix_hash_seed: str = setting(
        "", "Seed of vLLM's prefix-cache block hashes, given to vLLM as PYTHONHASHSEED (an integer 0..4294967295); "
            "empty: an inherited PYTHONHASHSEED is removed and vLLM uses its fixed default. Whatever indexes this "
            "worker's KV events must use the same")
    kv_feed: str = setting(
        "", "Redis URL of the KV feed (redis://host:port/db): a prefill worker turns on vLLM's KV-cache events and "
            "its agent publishes them there for the planners' index of what each prefill worker caches; empty: off",
        env="KVSHUTTLE_KV_FEED")
    kv_feed_key_prefix: str = setting("/kvshuttle/", "Key prefix of the KV feed in Redis (the planners' --key-prefix)",
                                      env="KVSHUTTLE_KV_FEED_KEY_PREFIX")
    load_feed_interval_s: float = setting(
        0.5, "With --kv-feed: seconds between this worker's load samples (its engine's GetLoads, polled by its agent "
             "over loopback) published to the feed for the planners, which then need not poll it; 0: not published")
    kv_feed_snapshot_s: float = setting(5.0, "Seconds between the KV feed snapshots of this worker's cache (while it "
                                             "changes): how soon a planner that missed entries knows it again")
    decoder_kv_blocks_ttl: int = setting(480, "Seconds a decode worker keeps a finished turn's blocks")
    kv_recompute_threshold: int = setting(
        1, "vLLM skips a pull shorter than this many tokens; kvshuttle decides itself, so keep it at 1 (0 = off)")
    kv_lease_duration_s: int = setting(
        30, "Seconds P keeps blocks for a decode worker that has not read them yet (D's heartbeats extend it)")
    nixl_progress_delay_us: int = setting(0, "Delay between NIXL UCX progress-thread polls (kvshuttle's vLLM plugin); "
                                                 "0 leaves NIXL's busy polling. Small CPU hosts: ~500")
    vllm_idle_spin_ms: int = setting(-1, "How long vLLM's queue readers spin after a message before sleeping "
                                          "(kvshuttle's vLLM plugin; vLLM: 1000). Small CPU hosts: ~20. -1: vLLM's")
    cpu_affinity: str = setting("", "Pin every thread of the vLLM process tree to these CPUs once it is up "
                                    "(e.g. '0' or '2-3'); empty: leave vLLM's own placement")
    nixl_num_threads: int = setting(-1, "NIXL UCX backend threads (NixlConnector num_threads); -1: vLLM's default")
    kv_load_failure_policy: str = setting("fail", "What P does when a pull fails", choices=("fail", "recompute"))
    enforce_eager: bool = setting(True, "Skip torch.compile/graph capture (faster start)")
    max_model_len: int = setting(0, "Max model length; 0: the model's")
    max_num_seqs: int = setting(0, "Max concurrent sequences; 0: vLLM's default")
    lora_modules: str = setting(
        "", "LoRA adapters this worker serves, NAME=DIR entries separated by commas (PEFT directories; vLLM "
            "--lora-modules): each registered as an adapter of this worker's model, asked for by NAME")
    lora_modules_file: str = setting(
        "", "A JSON file of adapter NAME -> DIR, re-read while the worker runs: adapters added there are served and "
            "registered, removed ones are no longer (with --lora-modules: both)")
    lora_modules_poll_s: float = setting(2.0, "Seconds between reads of --lora-modules-file")
    max_lora_rank: int = setting(0, "vLLM --max-lora-rank; 0: the smallest vLLM takes that covers the adapters given "
                                    "at start (at least 16)")
    max_loras: int = setting(0, "vLLM --max-loras (adapters in one batch); 0: the adapters given at start (>= 1)")
    extra_args: str = setting("", "More vLLM arguments (shell-quoted)")
    vllm_otlp_traces_endpoint: str = setting(
        "", "OTLP/gRPC endpoint for vLLM's own spans (vLLM --otlp-traces-endpoint): one 'llm_request' span per "
            "request, in the caller's trace; empty: vLLM does not trace")
    python: str = setting("", "Python interpreter that runs vLLM (default: this one)")
    vllm_log: str = setting("", "File vLLM's output is appended to; '-': this agent's own stdout/stderr (in a "
                                "container, the pod's log); empty: <work dir>/vllm.log")
    registry: str = setting("127.0.0.1:50051", "Session registry gRPC address", env="KVSHUTTLE_REGISTRY_ADDRESS")
    lease_ttl_s: int = setting(10, "Registry lease TTL in seconds")
    worker_id: str = setting("", "Worker id (default: <role>-<advertise host>-<grpc port>)")
    work_dir: str = setting("", "Work directory for vLLM caches, metrics and log (default: var/workers/<id>)")
    ready_timeout_s: float = setting(300.0, "Seconds to wait for vLLM to report SERVING")
    warmup: bool = setting(True, "Send one tiny request before registering (the first request can stall)")
    warmup_timeout_s: float = setting(180.0, "Deadline of the warm-up request")
    health_interval_s: float = setting(5.0, "Seconds between vLLM liveness checks")
    stop_grace_s: float = setting(20.0, "Seconds between SIGTERM and SIGKILL when stopping vLLM")
    nice: int = setting(0, "Run vLLM at this nice level (idle vLLM-CPU engines busy-poll their cores; a positive "
                           "value keeps the agent and control plane responsive on small machines)")
    metrics_listen: str = setting("", "Serve vLLM's Prometheus metrics (its vllm:* series, read from its "
                                      "multiprocess files) and the agent's at http://HOST:PORT/metrics (port 0: a "
                                      "free one, logged at start-up); empty: no metrics endpoint")
    log_level: str = setting("INFO", "Log level", env="KVSHUTTLE_LOG_LEVEL")
    print_vllm_command: bool = setting(False, "Print the vLLM command line and environment this worker would run, "
                                              "as JSON, and exit")

    def validate(self) -> None:
        if self.cpu_affinity:
            from kvshuttle.workers.affinity import parse_cpus

            try:
                parse_cpus(self.cpu_affinity)
            except ValueError:
                require(False, f"--cpu-affinity {self.cpu_affinity!r} is not a CPU list like '0' or '0-3,6'")
        require(self.role in ROLES, "--role must be prefill or decode")
        require(bool(self.model), "--model is required")
        require(0 < self.grpc_port < 65536 and 0 < self.nixl_port < 65536, "ports must be in 1..65535")
        require(self.lease_ttl_s >= 2, "--lease-ttl-s must be >= 2")
        require(self.tensor_parallel_size >= 1, "--tensor-parallel-size must be >= 1")
        require(self.public_host not in WILDCARD_HOSTS, "--advertise-host is required when --host is a wildcard")
        require(not self.kv_feed or self.kv_feed.startswith(("redis://", "rediss://", "unix://")),
                "--kv-feed must be a redis://, rediss:// or unix:// URL")
        require(self.kv_feed_snapshot_s > 0, "--kv-feed-snapshot-s must be > 0")
        require(self.load_feed_interval_s >= 0, "--load-feed-interval-s must be >= 0")
        require_effect(self, "load_feed_interval_s", bool(self.kv_feed), "without --kv-feed")
        require(self.kv_recompute_threshold >= 0, "--kv-recompute-threshold must be >= 0")
        require(self.kv_lease_duration_s >= 1 and self.decoder_kv_blocks_ttl >= 1, "KV lease and TTL must be >= 1 s")
        seed = self.prefix_hash_seed
        require(seed == "" or (seed.isascii() and seed.isdigit() and int(seed) <= 4294967295),
                "--prefix-hash-seed must be empty or an integer 0..4294967295 (Python's rule for PYTHONHASHSEED)")
        if self.lora_modules:
            from kvshuttle.workers.lora_modules import AdapterError, parse_lora_modules

            try:
                parse_lora_modules(self.lora_modules)
            except AdapterError as exc:
                require(False, str(exc))
        require(self.lora_modules_poll_s > 0, "--lora-modules-poll-s must be > 0")
        require_effect(self, "lora_modules_poll_s", bool(self.lora_modules_file), "without --lora-modules-file")
        require(self.max_lora_rank in (0, 1, 8, 16, 32, 64, 128, 256, 320, 512),
                "--max-lora-rank must be 0 or one of vLLM's: 1, 8, 16, 32, 64, 128, 256, 320, 512")
        require(self.max_loras >= 0, "--max-loras must be >= 0")
        for name in ("max_lora_rank", "max_loras"):
            require_effect(self, name, self.serves_adapters, "without --lora-modules or --lora-modules-file")
        self.validate_tls_client()  # towards the registry (vLLM's own gRPC server stays plaintext)
        from kvshuttle.services.common.metrics_http import check_listen

        check_listen(self.metrics_listen)

    @property
    def serves_adapters(self) -> bool:
        """Whether this worker's vLLM runs with LoRA on (adapters given now, or possibly later by the file)."""
        return bool(self.lora_modules or self.lora_modules_file)

    @property
    def adapter_table_path(self) -> Path:
        """The adapter table the agent writes and kvshuttle's vLLM plugin reads (workers/vllm_call_options.py)."""
        return self.work_path / "lora-adapters.json"

    def adapters_at_start(self) -> dict[str, str]:
        """The adapters to serve now: --lora-modules and --lora-modules-file's (AdapterError: a bad entry)."""
        from kvshuttle.workers.lora_modules import AdapterError, parse_lora_modules, read_modules_file

        wanted = parse_lora_modules(self.lora_modules)
        if self.lora_modules_file:
            for name, path in read_modules_file(self.lora_modules_file).items():
                if name in wanted and wanted[name] != path:
                    raise AdapterError(f"adapter {name!r} is in --lora-modules and --lora-modules-file with "
                                       "different directories")
                wanted[name] = path
        return wanted

    def lora_limits(self) -> tuple[int, int]:
        """vLLM's --max-loras and --max-lora-rank for this worker (reads the adapters' configs)."""
        from kvshuttle.workers.lora_modules import adapter_rank, vllm_rank

        wanted = self.adapters_at_start()
        rank = self.max_lora_rank or vllm_rank([adapter_rank(p) for p in wanted.values()])
        return self.max_loras or max(1, len(wanted)), rank

    @property
    def kv_events(self) -> bool:
        """Whether this worker's vLLM publishes KV-cache events (a prefill worker with a KV feed)."""
        return bool(self.kv_feed) and self.role == "prefill"

    @property
    def load_feed(self) -> bool:
        """Whether this worker's agent publishes its engine's load samples to the feed (any role)."""
        return bool(self.kv_feed) and self.load_feed_interval_s > 0

    @property
    def public_host(self) -> str:
        return self.advertise_host or self.host

    @property
    def grpc_address(self) -> str:
        return f"{self.public_host}:{self.grpc_port}"

    @property
    def local_grpc_address(self) -> str:
        """Where the agent itself reaches vLLM (loopback when vLLM listens on all interfaces)."""
        host = "127.0.0.1" if self.host in WILDCARD_HOSTS else self.host
        return f"{host}:{self.grpc_port}"

    @property
    def id(self) -> str:
        return self.worker_id or f"{self.role}-{self.public_host}-{self.grpc_port}"

    @property
    def model_name(self) -> str:
        return self.served_model_name or Path(self.model.rstrip("/")).name

    @property
    def work_path(self) -> Path:
        return Path(self.work_dir or Path("var") / "workers" / self.id)

    def prefix_hash_scheme(self, block_size: int) -> hashing.HashScheme:
        """How this worker's vLLM hashes prompt blocks (``block_size``: the one vLLM reports, GetServerInfo)."""
        return hashing.HashScheme(block_size=block_size, algo=self.prefix_hash_algo,
                                  seed=self.prefix_hash_seed or None)


def kv_transfer_config(cfg: WorkerConfig) -> dict:
    """NixlConnector in pull mode with bi-directional transfer: D keeps each turn's blocks for P to pull."""
    return {
        "kv_connector": "NixlConnector",
        "kv_role": "kv_both",
        "kv_buffer_device": cfg.kv_buffer_device,
        "kv_load_failure_policy": cfg.kv_load_failure_policy,
        "kv_connector_extra_config": {
            "bidirectional_kv_xfer": True,
            # vLLM declines pulls shorter than this (count < threshold; 0 disables the check). kvshuttle has
            # already decided pull vs recompute, so the engine must not second-guess it.
            "kv_recompute_threshold": cfg.kv_recompute_threshold,
            "decoder_kv_blocks_ttl": cfg.decoder_kv_blocks_ttl,
            "kv_lease_duration": cfg.kv_lease_duration_s,
            **({"num_threads": cfg.nixl_num_threads} if cfg.nixl_num_threads >= 0 else {}),
        },
    }


def vllm_command(cfg: WorkerConfig) -> tuple[list[str], dict[str, str | None]]:
    """The vLLM gRPC server's argv and the changes to the inherited environment (None: the variable is removed)."""
    argv = [
        cfg.python or sys.executable, "-m", "vllm.entrypoints.launchers.grpc_server",
        "--model", cfg.model,
        "--served-model-name", cfg.model_name,
        "--host", cfg.host,
        "--port", str(cfg.grpc_port),
        "--dtype", cfg.dtype,
        "--prefix-caching-hash-algo", cfg.prefix_hash_algo,
    ]
    if cfg.role != COLOCATED:
        argv += ["--kv-transfer-config", json.dumps(kv_transfer_config(cfg), separators=(",", ":"))]
    if cfg.enforce_eager:
        argv.append("--enforce-eager")
    if cfg.block_size:
        argv += ["--block-size", str(cfg.block_size)]
    if cfg.max_model_len:
        argv += ["--max-model-len", str(cfg.max_model_len)]
    if cfg.max_num_seqs:
        argv += ["--max-num-seqs", str(cfg.max_num_seqs)]
    if cfg.gpu_memory_utilization:
        argv += ["--gpu-memory-utilization", str(cfg.gpu_memory_utilization)]
    if cfg.tensor_parallel_size > 1:
        argv += ["--tensor-parallel-size", str(cfg.tensor_parallel_size)]
    if cfg.vllm_otlp_traces_endpoint:
        argv += ["--otlp-traces-endpoint", cfg.vllm_otlp_traces_endpoint]
    if cfg.serves_adapters:
        max_loras, max_rank = cfg.lora_limits()
        argv += ["--enable-lora", "--max-loras", str(max_loras), "--max-lora-rank", str(max_rank)]
    argv += shlex.split(cfg.extra_args)

    work = cfg.work_path
    env: dict[str, str | None] = {
        "VLLM_NIXL_SIDE_CHANNEL_HOST": cfg.nixl_host,
        "VLLM_NIXL_SIDE_CHANNEL_PORT": str(cfg.nixl_port),
        "VLLM_CACHE_ROOT": str(work / "cache"),
        "PROMETHEUS_MULTIPROC_DIR": str(work / "prometheus"),
        "SMG_VLLM_SERVICER_WARMUP": "off",
        # The servicer turns vLLM's ZMQ KV-event publisher on (a free port) and relays it (SubscribeKvEvents),
        # with block hashes as ints (their low 64 bits: what the feed and the index carry).
        "SMG_VLLM_SERVICER_KV_EVENTS": None if cfg.kv_events else "0",
        "VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES": "1" if cfg.kv_events else None,
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "KVSHUTTLE_VLLM_DIE_WITH_PARENT": "1",  # workers/vllm_plugin.py: no vLLM process outlives its parent
        # vLLM seeds its block hashes with PYTHONHASHSEED when set (control_plane/kv_index/hashing.py): pinned, so
        # that a KV index outside the worker computes the same hashes whatever environment the worker inherited.
        "PYTHONHASHSEED": cfg.prefix_hash_seed or None,
    }
    if cfg.cpu_bind:
        env["VLLM_CPU_OMP_THREADS_BIND"] = cfg.cpu_bind
    if cfg.cuda_visible_devices:
        env["CUDA_VISIBLE_DEVICES"] = cfg.cuda_visible_devices
    if cfg.nixl_progress_delay_us:
        env["KVSHUTTLE_NIXL_PROGRESS_DELAY_US"] = str(cfg.nixl_progress_delay_us)
    if cfg.vllm_idle_spin_ms >= 0:
        env["KVSHUTTLE_VLLM_IDLE_SPIN_MS"] = str(cfg.vllm_idle_spin_ms)
    if cfg.kv_cache_gib:
        env["VLLM_CPU_KVCACHE_SPACE"] = str(cfg.kv_cache_gib)
    if cfg.serves_adapters:
        env["KVSHUTTLE_LORA_ADAPTERS_FILE"] = str(cfg.adapter_table_path.resolve())
    if cfg.vllm_otlp_traces_endpoint:
        env["OTEL_SERVICE_NAME"] = f"vllm-{cfg.role}"  # vLLM names no service itself ("unknown_service")
    return argv, env


class VllmProcess(ChildProcess):
    """vLLM as a child process in its own process group, its output appended to ``--vllm-log`` (default
    ``<work dir>/vllm.log``), or shared with the agent's when that is ``-``."""

    def __init__(self, cfg: WorkerConfig):
        argv, extra_env = vllm_command(cfg)
        if cfg.nice:
            argv = ["nice", "-n", str(cfg.nice), *argv]
        log = None if cfg.vllm_log == "-" else Path(cfg.vllm_log) if cfg.vllm_log else cfg.work_path / "vllm.log"
        super().__init__(f"vllm-{cfg.role}", argv, log, env=extra_env,
                         stop_grace_s=cfg.stop_grace_s)
        self.cfg = cfg

    async def start(self, stdout_pipe: bool = False) -> None:
        work = self.cfg.work_path
        work.mkdir(parents=True, exist_ok=True)
        # Prometheus multiprocess files from a previous run would be summed into this one's counters.
        shutil.rmtree(work / "prometheus", ignore_errors=True)
        (work / "prometheus").mkdir()
        (work / "cache").mkdir(exist_ok=True)
        await super().start(stdout_pipe)

    async def wait(self) -> int:
        assert self.proc is not None
        return await self.proc.wait()
