"""`kvshuttle bench-gateway`: the gateway's own streaming capacity. Every generated token goes through one Python
gateway process (gRPC in from vLLM, parse, detokenize, SSE out); this drives the real ``kvshuttle gateway`` process
(planner in-process, records on) against fake prefill and decode engines that serve vLLM's gRPC API and stream
tokens at a set rate per stream with no model (services/devtools/bench/fake_engine.py, each in its own process), on
a real etcd and session registry (its own process too), and measures:

* streamed tokens per second per gateway core: tokens delivered to the clients / the gateway process's CPU seconds
  (utime + stime from /proc) over the same interval;
* the inter-token delay the clients see (p50 / p99 over every gap of every stream), and whether the level's streams
  are held under ``--itl-bound-ms`` at p99;

at each concurrency level (``--streams``), with the answer parsers off (no tools, no reasoning parser) and on
(``--tool-call-parser`` + ``--reasoning-parser`` on the gateway, ``tools`` in every request). Every stream's text is
checked against the detokenized token ids the fake engine sent. Writes ``gateway.json`` under ``--out``.

The same levels, modes and request bodies are driven through SMG (PyPI ``smg``, ``smg launch
--pd-disaggregation``, as ``kvshuttle bench --modes smg`` starts it; ``--smg required|auto|off``), each level right
after kvshuttle's (both gateways run through a mode; a drift of the machine's speed over the run moves both figures of
a level, not their ratio), in front of the same fake prefill engine and a fake decode engine of its own (SMG streams
D's tokens only, and drops P's first token, so its D starts the answer at its first token; the kvshuttle gateway's D
continues after P's). SMG's CPU seconds
are its process tree's, read the same way; the report divides the two gateways' tokens per core level by level.

Each level runs ``--repeats`` times, kvshuttle and SMG alternating (kvshuttle, SMG, kvshuttle, SMG, ...): a level's
comparison pools its runs (each gateway's tokens over its CPU seconds, summed over the runs) and lists each pair's
own ratio. On a small shared machine one run's figure moves by 10-20 % with what else ran meanwhile
(docs/performance.md); the pooled figure is the level's, the pairs show the spread.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from kvshuttle.services.commands.gateway import PROFILE_ENV
from kvshuttle.services.common.config import load, require, setting
from kvshuttle.services.common.processes import ChildProcess
from kvshuttle.services.devtools.bench.smg import (
    DEFAULT_SMG_BIN,
    SMG_TOOL_CALL_PARSERS,
    SmgMissing,
    SmgRouter,
    smg_binary,
)
from kvshuttle.services.devtools.server_process import free_port

log = logging.getLogger("kvshuttle.bench.gateway")
REPO = Path(__file__).resolve().parents[3]
TEXT = ("The quick brown fox jumps over the lazy dog while the five boxing wizards jump quickly, and every "
        "sentence keeps going with plain words so that each token decodes to ordinary text. ")
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather for a city",
                                           "parameters": {"type": "object",
                                                          "properties": {"city": {"type": "string"}},
                                                          "required": ["city"]}}}]


SMG_MODES = ("required", "auto", "off")
SMG_LOOP = "smg"  # the ``loop`` of SMG's rows (its own runtime, tokio)


@dataclasses.dataclass
class GatewayBenchConfig:
    """The gateway's streaming capacity against fake engines (no vLLM)."""

    ENV_PREFIX = "KVSHUTTLE_BENCH_GATEWAY_"
    streams: str = setting("1,64,512", "Concurrent streams per level, comma-separated")
    tokens: int = setting(256, "Tokens per stream (max_tokens)")
    interval_ms: float = setting(20.0, "The fake decode engine's delay between a stream's tokens (0: as fast as read)")
    modes: str = setting("off,on", "Answer parsers: off (no tools, no reasoning parser), on (tools in each request, "
                                   "--tool-call-parser and --reasoning-parser on the gateway), comma-separated")
    loops: str = setting("uvloop", "The gateway's event loop(s) (its --event-loop), comma-separated: uvloop (the "
                                   "gateway's default), asyncio: both measure one against the other in one run")
    tool_call_parser: str = setting("hermes", "The gateway's --tool-call-parser in mode on")
    reasoning_parser: str = setting("qwen3", "The gateway's --reasoning-parser in mode on")
    itl_bound_ms: float = setting(50.0, "The p99 inter-token delay a level's streams must stay under")
    repeats: int = setting(3, "Runs of each level per gateway, kvshuttle and SMG alternating; the comparison pools "
                              "them and lists each pair's ratio")
    model_dir: str = setting("", "Model directory (tokenizer + chat template; default: the offline tiny-tools model, "
                                 "built on first use)", env="KVSHUTTLE_MODEL_DIR")
    gateway_args: str = setting("", "More `kvshuttle gateway` flags (space-separated)")
    out: str = setting("", "Output directory for gateway.json and logs (default var/bench/gateway-<timestamp>)")
    timeout_s: float = setting(300.0, "Deadline of one level")
    profile: bool = setting(False, "cProfile each gateway process (the event loop's thread): <out>/gateway-<mode>.prof "
                                   "and the top functions by own time in <out>/gateway-<mode>.prof.txt")
    log_level: str = setting("WARNING", "Log level (also the gateway's)")
    smg: str = setting("auto", "Drive SMG (`smg launch --pd-disaggregation`) at the same levels against the same fake "
                               "engines: required (an error when it is not installed), auto (its rows say why when "
                               "it is not), off", choices=SMG_MODES)
    smg_bin: str = setting(DEFAULT_SMG_BIN, "The smg executable (relative: from the repository root)")

    def validate(self) -> None:
        for name, allowed in (("loops", ("asyncio", "uvloop")), ("modes", ("off", "on"))):
            values = [v.strip() for v in getattr(self, name).split(",") if v.strip()]
            require(bool(values) and all(v in allowed for v in values),
                    f"--{name} takes {' or '.join(allowed)}, comma-separated; got {getattr(self, name)!r}")
        try:
            levels = [int(v) for v in self.streams.split(",") if v.strip()]
        except ValueError:
            levels = []
        require(bool(levels) and all(n >= 1 for n in levels), "--streams takes stream counts >= 1, comma-separated")
        require(self.tokens >= 1 and self.interval_ms >= 0 and self.timeout_s > 0 and self.repeats >= 1,
                "--tokens >= 1, --interval-ms >= 0, --timeout-s > 0, --repeats >= 1")


def _model_dir(cfg: GatewayBenchConfig) -> Path:
    if cfg.model_dir:
        return Path(cfg.model_dir).resolve()
    from kvshuttle.workers.model_builder import TINY_TOOLS, build_model

    path = REPO / "var" / "models" / TINY_TOOLS
    build_model(path, TINY_TOOLS)  # a no-op when already complete
    return path


def _cpu_times(pid: int) -> tuple[float, float]:
    """``pid``'s user and system CPU seconds (every thread), from /proc."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    tick = os.sysconf("SC_CLK_TCK")
    return int(fields[11]) / tick, int(fields[12]) / tick


def _children(pid: int) -> list[int]:
    """``pid``'s child processes (from every thread's /proc children list)."""
    kids: list[int] = []
    try:
        for task in os.listdir(f"/proc/{pid}/task"):
            try:
                with open(f"/proc/{pid}/task/{task}/children") as f:
                    kids.extend(int(k) for k in f.read().split())
            except OSError:
                pass
    except OSError:
        pass
    return kids


def tree_cpu_times(pid: int, cpu_times=_cpu_times, children=_children) -> tuple[float, float]:
    """User and system CPU seconds (every thread) of ``pid`` and its descendants that are running now
    (``cpu_times`` and ``children`` read /proc)."""
    user = system = 0.0
    todo, seen = [pid], set()
    while todo:
        p = todo.pop()
        if p in seen:
            continue
        seen.add(p)
        try:
            u, s = cpu_times(p)
        except (OSError, IndexError, ValueError):
            continue  # exited meanwhile
        user, system = user + u, system + s
        todo.extend(children(p))
    return user, system


def smg_plan(choice: str, path: str, root: Path = REPO) -> tuple[Path | None, str]:
    """Whether the run drives SMG: (its executable, or None, and what its part of the report says). ``path`` is
    relative to ``root``. SmgMissing with ``required`` when it is not there."""
    if choice == "off":
        return None, "not measured (--smg off)"
    candidate = Path(path) if Path(path).is_absolute() else root / path
    try:
        binary = smg_binary(str(candidate))
    except SmgMissing as exc:
        if choice == "required":
            raise
        return None, f"not measured: {exc}"
    return binary, f"measured ({binary})"


def smg_parser_flags(tools: bool, tool_call_parser: str, reasoning_parser: str) -> tuple[str, str]:
    """SMG's ``tool_call_parser`` (the gateway's name, which ``smg_command`` translates) and extra flags for a
    mode: none with the parsers off; the gateway's parsers' counterparts with them on."""
    if not tools:
        return "", ""
    if tool_call_parser not in SMG_TOOL_CALL_PARSERS:
        raise ValueError(f"no SMG tool-call parser known for {tool_call_parser!r}")
    return tool_call_parser, (f"--reasoning-parser {reasoning_parser}" if reasoning_parser else "")


def _pooled(runs: list[dict]) -> tuple[float | None, float | None]:
    """Tokens per core and cores per 10k tokens/s of a level's runs together (their tokens over their CPU seconds;
    None: no CPU tick or no token was counted)."""
    tokens = sum(r.get("tokens") or 0 for r in runs)
    cpu = sum(r.get("gateway_cpu_s") or 0.0 for r in runs)
    return (round(tokens / cpu, 1) if cpu and tokens else None,
            round(cpu / tokens * 10000, 3) if cpu and tokens else None)


def compare(kvshuttle: list[dict], smg: list[dict]) -> list[dict]:
    """Per level (loop, parsers, streams) of kvshuttle's rows, in the order first run: SMG's runs of the same
    parsers and streams; tokens per core of both, pooled over the level's runs, their ratio (kvshuttle / SMG; None
    when either is missing), each pair's ratio (the k-th kvshuttle run of the loop with SMG's k-th, measured right
    after it), gateway cores per 10k decode tokens/s of both, and whether every run held the ITL bound."""
    smg_runs: dict[tuple, list[dict]] = {}
    for r in smg:
        smg_runs.setdefault((r["tools_and_reasoning"], r["streams"]), []).append(r)
    levels: dict[tuple, list[dict]] = {}
    for r in kvshuttle:
        levels.setdefault((r["loop"], r["tools_and_reasoning"], r["streams"]), []).append(r)
    out = []
    for (loop, tools, streams), runs in levels.items():
        others = smg_runs.get((tools, streams), [])
        kv_core, kv_cores = _pooled(runs)
        smg_core, smg_cores = _pooled(others) if others else (None, None)
        pairs = [round(a["tokens_per_core_s"] / b["tokens_per_core_s"], 3)
                 if a.get("tokens_per_core_s") and b.get("tokens_per_core_s") else None
                 for a, b in zip(runs, others, strict=False)]
        out.append({"loop": loop, "tools_and_reasoning": tools, "streams": streams, "runs": len(runs),
                    "kvshuttle_tokens_per_core_s": kv_core, "smg_tokens_per_core_s": smg_core,
                    "ratio_per_core": round(kv_core / smg_core, 3) if kv_core and smg_core else None,
                    "pair_ratios": pairs,
                    "kvshuttle_cores_per_10k_tokens_s": kv_cores, "smg_cores_per_10k_tokens_s": smg_cores,
                    "kvshuttle_held": all(r["held_under_bound"] for r in runs),
                    "smg_held": all(r.get("held_under_bound") for r in others) if others else None})
    return out


def streams_held(rows: list[dict]) -> dict[str, int]:
    """The most streams held under the bound (0: none), per ``loop/parsers``: a level is held when every run of it
    was."""
    runs: dict[tuple, bool] = {}
    for r in rows:
        level = (r["loop"], r["tools_and_reasoning"], r["streams"])
        runs[level] = runs.get(level, True) and r["held_under_bound"]
    held: dict[str, int] = {}
    for (loop, tools, streams), ok in runs.items():
        key = f"{loop}/{'on' if tools else 'off'}"
        held[key] = max(held.get(key, 0), streams if ok else 0)
    return held


def _pct(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


class Services:
    """etcd, the registry, the fake P and D engines, and a gateway process: each in its own process (the registry
    in this one would share its event loop and CPU with the clients of 512 streams, and fall behind)."""

    def __init__(self, cfg: GatewayBenchConfig, work: Path, model_dir: Path, token_ids: list[int], smg: bool = False):
        self.cfg, self.work, self.model_dir, self.token_ids, self.smg = cfg, work, model_dir, token_ids, smg
        self.etcd = None
        self.registry = ""  # its address
        self.engines: dict[str, tuple[ChildProcess, str]] = {}
        self.children: list[ChildProcess] = []

    async def start(self) -> None:
        from kvshuttle.services.devtools.etcd_process import EtcdProcess

        self.etcd = EtcdProcess(data_dir=self.work / "etcd")
        await self.etcd.astart()
        port = free_port()
        registry = ChildProcess("registry", [sys.executable, "-m", "kvshuttle.services.commands", "registry",
                                             "--listen", f"127.0.0.1:{port}", "--etcd-endpoints", self.etcd.endpoints,
                                             "--key-prefix", "/bench-gateway/", "--log-level", self.cfg.log_level],
                                self.work / "registry.log", cwd=REPO)
        await registry.start()
        self.children.append(registry)
        self.registry = f"127.0.0.1:{port}"
        # SMG's decode engine starts the answer at the first token (SMG streams D's tokens only); the gateway's
        # continues after P's first token.
        for role in ("prefill", "decode", *(("decode-smg",) if self.smg else ())):
            port = free_port()
            child = ChildProcess(f"fake-{role}", [sys.executable, "-m", "kvshuttle.services.devtools.bench.fake_engine",
                                                  "--port", str(port), "--engine-id", f"engine-{role}",
                                                  "--interval-ms", str(0 if role == "prefill" else self.cfg.interval_ms),
                                                  "--tokens", ",".join(map(str, self.token_ids)),
                                                  "--offset", "1" if role == "decode" else "0",
                                                  "--model-path", str(self.model_dir)],
                                 self.work / f"fake-{role}.log", cwd=REPO)
            await child.start()
            self.children.append(child)
            self.engines[role] = (child, f"127.0.0.1:{port}")
        await self._register()

    async def _register(self) -> None:
        import grpc
        from kvshuttle.services.common.grpc_server import client_channel
        from kvshuttle.v1 import common_pb2, registry_pb2, registry_pb2_grpc

        deadline = time.monotonic() + 30
        for role, address in (("registry", self.registry), *((role, a) for role, (_, a) in self.engines.items())):
            from grpc_health.v1 import health_pb2, health_pb2_grpc
            async with grpc.aio.insecure_channel(address) as ch:  # it is up
                while True:
                    try:
                        await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=1)
                        break
                    except grpc.aio.AioRpcError:
                        if time.monotonic() > deadline:
                            raise TimeoutError(f"the {role} process did not start") from None
                        await asyncio.sleep(0.2)
        channel = client_channel(self.registry)
        stub = registry_pb2_grpc.SessionRegistryStub(channel)
        for role, (_, address) in self.engines.items():
            if role not in ("prefill", "decode"):
                continue  # SMG's own: it is SMG's worker, not the registry's
            port = int(address.rsplit(":", 1)[1])
            worker = common_pb2.Worker(
                worker_id=f"{role}-0", engine_id=f"engine-{role}", grpc_address=address,
                role=common_pb2.WORKER_ROLE_PREFILL if role == "prefill" else common_pb2.WORKER_ROLE_DECODE,
                nixl_host="127.0.0.1", nixl_port=port + 1, block_size=16, kv_blocks_ttl_s=480,
                model=self.model_dir.name)  # the gateway's served model (its --model-dir's name)
            await stub.RegisterWorker(registry_pb2.RegisterWorkerRequest(worker=worker, lease_ttl_s=3600))
        await channel.close()

    async def gateway(self, name: str, *flags: str, uvloop: bool = False) -> tuple[ChildProcess, str]:
        import httpx

        http = free_port()
        child = ChildProcess(name, [sys.executable, "-m", "kvshuttle.services.commands", "gateway",
                                    "--http-listen", f"127.0.0.1:{http}", "--grpc-listen", f"127.0.0.1:{free_port()}",
                                    "--registry", self.registry, "--scheduler", "local",
                                    "--model-dir", str(self.model_dir), "--max-model-len", "4096",
                                    "--log-level", self.cfg.log_level, "--event-loop", "uvloop" if uvloop else "asyncio",
                                    *flags, *self.cfg.gateway_args.split()],
                             self.work / f"{name}.log", cwd=REPO,
                             env={"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
                                  PROFILE_ENV: str(self.work / f"{name}.prof") if self.cfg.profile else None})
        await child.start()
        self.children.append(child)
        base, deadline = f"http://127.0.0.1:{http}", time.monotonic() + 120
        async with httpx.AsyncClient(base_url=base, timeout=5) as client:
            while True:
                if child.returncode is not None:
                    raise RuntimeError(f"{name} exited ({child.returncode}):\n{child.log_tail(30)}")
                try:
                    if (await client.get("/health")).status_code == 200:
                        return child, base
                except httpx.TransportError:
                    pass
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{name} did not answer /health:\n{child.log_tail(30)}")
                await asyncio.sleep(0.3)

    async def stop(self) -> None:
        for child in reversed(self.children):
            await child.stop()
        if self.etcd is not None:
            await self.etcd.astop()


async def _counted(client, body: dict, gaps: list[float]) -> tuple[str, int]:
    """``_stream``, with a connection that failed (e.g. reset under the load of 512 streams on two cores) counted as an
    incomplete stream (the level's ``complete_streams``, and not held) and logged, instead of ending the run."""
    import httpx

    try:
        return await _stream(client, body, gaps)
    except httpx.TransportError as exc:
        log.warning("a stream's connection failed: %r", exc)
        return "", 0


async def _stream(client, body: dict, gaps: list[float]) -> tuple[str, int]:
    """One streamed chat answer: its text (content + reasoning + tool-call arguments) and completion tokens; each
    gap between two chunks that carried text goes to ``gaps`` (seconds)."""
    parts, usage, last = [], 0, None
    async with client.stream("POST", "/v1/chat/completions", json=body) as resp:
        if resp.status_code != 200:
            raise RuntimeError(f"HTTP {resp.status_code}: {(await resp.aread())[:300]!r}")
        async for line in resp.aiter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                usage = chunk["usage"]["completion_tokens"]
            for choice in chunk.get("choices") or ():
                delta = choice.get("delta") or {}
                text = (delta.get("content") or "") + (delta.get("reasoning_content") or "")
                for call in delta.get("tool_calls") or ():
                    text += (call.get("function") or {}).get("arguments") or ""
                if text:
                    now = time.perf_counter()
                    if last is not None:
                        gaps.append(now - last)
                    last = now
                    parts.append(text)
    return "".join(parts), usage


async def run_level(base: str, pid: int, streams: int, cfg: GatewayBenchConfig, tools: bool, expected: str,
                    model: str | None = None) -> dict:
    """One level through the gateway at ``base`` (``pid``: its process; CPU seconds of its process tree).
    ``model``: the ``model`` field of every request (SMG requires one; the kvshuttle gateway serves its own)."""
    import httpx

    limits = httpx.Limits(max_connections=streams + 8, max_keepalive_connections=streams + 8)
    gaps: list[float] = []
    async with httpx.AsyncClient(base_url=base, timeout=cfg.timeout_s, limits=limits) as client:
        def body(i: int) -> dict:
            b = {"messages": [{"role": "user", "content": f"Stream {i}: tell me a story."}],
                 "max_tokens": cfg.tokens, "stream": True, "stream_options": {"include_usage": True},
                 "temperature": 0}
            if tools:
                b["tools"] = TOOLS
            if model:
                b["model"] = model
            return b

        await asyncio.gather(*(_stream(client, body(-1 - i), []) for i in range(min(streams, 8))))  # warm-up
        (user0, sys0), t0 = tree_cpu_times(pid), time.perf_counter()
        results = await asyncio.wait_for(asyncio.gather(*(_counted(client, body(i), gaps) for i in range(streams))),
                                         cfg.timeout_s)
        wall, (user1, sys1) = time.perf_counter() - t0, tree_cpu_times(pid)
    user, system = user1 - user0, sys1 - sys0
    cpu = user + system
    tokens = sum(n for _, n in results)
    complete = sum(1 for text, n in results if n == cfg.tokens and text == expected)
    if complete < streams:
        log.warning("incomplete stream: %r (%d tokens) != %r", results[0][0][:120], results[0][1], expected[:120])
    p99 = _pct(gaps, 0.99) * 1000
    return {"streams": streams, "tools_and_reasoning": tools, "tokens": tokens, "complete_streams": complete,
            "wall_s": round(wall, 3), "gateway_cpu_s": round(cpu, 3), "gateway_user_s": round(user, 3),
            "gateway_sys_s": round(system, 3),
            "tokens_per_s": round(tokens / wall, 1), "gateway_cores": round(cpu / wall, 3),
            "tokens_per_core_s": round(tokens / cpu, 1) if cpu else None,
            "cores_per_10k_tokens_s": round(cpu / wall / (tokens / wall) * 10000, 3) if tokens else None,
            "itl_p50_ms": round(_pct(gaps, 0.5) * 1000, 2), "itl_p99_ms": round(p99, 2),
            "held_under_bound": p99 < cfg.itl_bound_ms and complete == streams}


def _profile_text(path: Path, top: int = 40) -> None:
    import io
    import pstats

    if not path.exists():
        log.warning("no profile at %s (the gateway did not exit cleanly)", path)
        return
    buf = io.StringIO()
    pstats.Stats(str(path), stream=buf).sort_stats("tottime").print_stats(top)
    Path(f"{path}.txt").write_text(buf.getvalue())


def smg_router(services: Services, binary: Path, cfg: GatewayBenchConfig, mode: str, out: Path) -> SmgRouter:
    """SMG in P/D mode in front of the fake P and SMG's fake D, with one parsers mode's flags."""
    tool_parser, extra = smg_parser_flags(mode == "on", cfg.tool_call_parser, cfg.reasoning_parser)
    return SmgRouter(binary, prefill=[services.engines["prefill"][1]], decode=[services.engines["decode-smg"][1]],
                     model_dir=services.model_dir, log_path=out / f"smg-{mode}.log", tool_call_parser=tool_parser,
                     silence_s=max(60, int(cfg.timeout_s)), extra_args=extra)


async def run_mode(services: Services, cfg: GatewayBenchConfig, mode: str, loops: list[str], levels: list[int],
                   expected: str, out: Path, smg_bin: Path | None, emit) -> tuple[list[dict], list[dict]]:
    """One parsers mode: a kvshuttle gateway per event loop and SMG, all started, then each level driven through
    each of them in turn, ``repeats`` times, so that the two gateways' figures of a level are measured within seconds
    of each other (a machine whose speed drifts over the run moves both, not their ratio). Returns (kvshuttle rows,
    SMG rows)."""
    tools = mode == "on"
    flags = ["--tool-call-parser", cfg.tool_call_parser, "--reasoning-parser", cfg.reasoning_parser] if tools else []
    gateways: list[tuple[str, str, ChildProcess, str]] = []
    router = smg_router(services, smg_bin, cfg, mode, out) if smg_bin is not None else None
    rows: list[dict] = []
    smg_rows: list[dict] = []
    try:
        for loop in loops:
            name = f"gateway-{mode}-{loop}"
            child, base = await services.gateway(name, *flags, uvloop=loop == "uvloop")
            gateways.append((loop, name, child, base))
        if router is not None:
            await router.start(timeout_s=60)
        for streams in levels:
            for run in range(cfg.repeats):
                for loop, _, child, base in gateways:
                    row = {"loop": loop, "run": run, **await run_level(base, child.pid, streams, cfg, tools, expected)}
                    emit(json.dumps(row))
                    rows.append(row)
                if router is not None:
                    row = {"loop": SMG_LOOP, "run": run, **await run_level(
                        router.base_url, router.child.pid, streams, cfg, tools, expected, model=router.model)}
                    emit(json.dumps(row))
                    smg_rows.append(row)
    finally:
        if router is not None:
            await router.stop()
        for _, name, child, _ in gateways:
            await child.stop()
            services.children.remove(child)
            if cfg.profile:
                _profile_text(out / f"{name}.prof")
    return rows, smg_rows


async def run_benchmark(cfg: GatewayBenchConfig, emit=print) -> tuple[dict, Path]:
    from transformers import AutoTokenizer

    out = Path(cfg.out or REPO / "var" / "bench" / f"gateway-{time.strftime('%Y%m%d-%H%M%S')}").resolve()
    out.mkdir(parents=True, exist_ok=True)
    model_dir = _model_dir(cfg)
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    token_ids = tok.encode(TEXT, add_special_tokens=False)
    expected_ids = [token_ids[i % len(token_ids)] for i in range(cfg.tokens)]
    expected = tok.decode(expected_ids)
    levels = [int(s) for s in cfg.streams.split(",") if s.strip()]
    modes = [m.strip() for m in cfg.modes.split(",") if m.strip()]
    loops = [x.strip() for x in cfg.loops.split(",") if x.strip()]
    smg_bin, smg_note = smg_plan(cfg.smg, cfg.smg_bin)  # SmgMissing (with --smg required) before anything starts
    services = Services(cfg, out, model_dir, token_ids, smg=smg_bin is not None)
    rows: list[dict] = []
    smg_rows: list[dict] = []
    load_start = os.getloadavg()
    try:
        await services.start()
        for mode in modes:
            mode_rows, mode_smg_rows = await run_mode(services, cfg, mode, loops, levels, expected, out, smg_bin, emit)
            rows += mode_rows
            smg_rows += mode_smg_rows
    finally:
        await services.stop()
    report = {"config": {k: getattr(cfg, k) for k in ("streams", "tokens", "interval_ms", "modes", "loops",
                                                    "itl_bound_ms", "repeats", "smg")},
              "host": {"cpus": os.cpu_count(), "loadavg": os.getloadavg(), "loadavg_start": load_start},
              "kvshuttle": rows, "smg": {"status": smg_note, "rows": smg_rows},
              "comparison": compare(rows, smg_rows) if smg_rows else [],
              "streams_held": streams_held(rows + smg_rows)}
    (out / "gateway.json").write_text(json.dumps(report, indent=2))
    emit(table(report))
    return report, out


def table(report: dict) -> str:
    """The rows of both gateways (SMG's ``loop``: smg), then the ratio of tokens per core level by level."""
    smg = report["smg"]
    lines = [f"{'loop':>7} {'parsers':>7} {'streams':>7} {'tok/s':>9} {'gw cores':>8} {'tok/s/core':>10} {'cores/10k':>9} "
             f"{'us/tok usr/sys':>14} {'itl p50':>7} {'itl p99':>7} {'held':>5} {'complete':>8}"]
    for r in report["kvshuttle"] + smg["rows"]:
        per_token = (f"{r['gateway_user_s'] / r['tokens'] * 1e6:.0f}/{r['gateway_sys_s'] / r['tokens'] * 1e6:.0f}"
                     if r.get("tokens") and "gateway_user_s" in r else "-")
        lines.append(f"{r['loop']:>7} {'on' if r['tools_and_reasoning'] else 'off':>7} {r['streams']:>7} {r['tokens_per_s']!s:>9} "
                     f"{r['gateway_cores']!s:>8} {r['tokens_per_core_s']!s:>10} {r['cores_per_10k_tokens_s']!s:>9} "
                     f"{per_token:>14} "
                     f"{r['itl_p50_ms']!s:>7} {r['itl_p99_ms']!s:>7} {str(r['held_under_bound']):>5} "
                     f"{r['complete_streams']:>4}/{r['streams']}")
    lines.append(f"smg: {smg['status']}")
    if report.get("comparison"):
        lines.append(f"{'loop':>7} {'parsers':>7} {'streams':>7} {'runs':>4} {'kvs tok/s/core':>14} "
                     f"{'smg tok/s/core':>14} {'kvs/smg':>7} {'pairs':>17} {'kvs cores/10k':>13} {'smg cores/10k':>13}")
        for c in report["comparison"]:
            pairs = ",".join(str(p) for p in c.get("pair_ratios") or ()) or "-"
            lines.append(f"{c['loop']:>7} {'on' if c['tools_and_reasoning'] else 'off':>7} {c['streams']:>7} "
                         f"{c.get('runs', 1):>4} {c['kvshuttle_tokens_per_core_s']!s:>14} "
                         f"{c['smg_tokens_per_core_s']!s:>14} {c['ratio_per_core']!s:>7} {pairs:>17} "
                         f"{c['kvshuttle_cores_per_10k_tokens_s']!s:>13} {c['smg_cores_per_10k_tokens_s']!s:>13}")
    held = report.get("streams_held") or {}
    if held:
        lines.append("streams held (p99 ITL under the bound): " + ", ".join(f"{k} {v}" for k, v in held.items()))
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> None:
    cfg = load(GatewayBenchConfig, argv, prog="kvshuttle bench-gateway")
    logging.basicConfig(level=cfg.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        stream=sys.stderr)
    try:
        asyncio.run(run_benchmark(cfg))
    except KeyboardInterrupt:
        raise SystemExit(130) from None


if __name__ == "__main__":
    main()
