"""`kvshuttle soak`: many concurrent multi-turn sessions through the gateway for minutes; every turn must succeed.

Each of ``--sessions`` loops runs agentic conversations one after the other (a new session id each; streamed and
plain requests alternate), through the gateway's OpenAI API, until ``--duration-s`` is over. Every turn is counted:
succeeded (pull or recompute) or failed (HTTP status, error in the stream, timeout, or an answer without content).
While it runs, the resident memory of each service (its process tree) is sampled every ``--sample-interval-s``.

The report: turns/s (overall and per window), failures by kind, decisions, TTFT and turn latency percentiles, and
per service the memory at the start of the measured window and at its end, with the fitted growth in MiB/min.
It starts the local stack unless ``--gateway-url`` names a running gateway (then memory is not sampled).
Outputs go to ``--out-dir``: ``soak.json`` (the report) and ``turns.jsonl`` (one line per turn).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import signal
import statistics
import time
import uuid
from collections.abc import Sequence
from pathlib import Path

import httpx
from kvshuttle.services.common.config import load, require, setting
from kvshuttle.services.devtools.bench.workload import agentic_conversations
from kvshuttle.services.devtools.stack import Stack, StackConfig

log = logging.getLogger("kvshuttle.soak")


@dataclasses.dataclass
class SoakConfig(StackConfig):
    """The soak; the local stack's settings apply when it starts the stack itself."""

    ENV_PREFIX = "KVSHUTTLE_SOAK_"
    gateway_url: str = setting("", "Drive this running gateway instead of starting the local stack")
    sessions: int = setting(16, "Sessions in flight at once")
    duration_s: float = setting(300.0, "How long to keep sending turns (turns in flight then finish)")
    warmup_s: float = setting(30.0, "Memory growth is measured from this long after the start")
    max_history_tokens: int = setting(2500, "Grow each conversation up to about this many tokens, then start another")
    turn_tokens_min: int = setting(60, "Smallest user turn (tokens, estimated)")
    turn_tokens_max: int = setting(400, "Largest user turn (tokens, estimated)")
    answer_tokens: int = setting(16, "Tokens generated per turn")
    request_timeout_s: float = setting(120.0, "A turn taking longer than this counts as failed (timeout)")
    sample_interval_s: float = setting(5.0, "Memory and decode-KV sampling period")
    end_sessions: bool = setting(False, "End each conversation (POST /v1/sessions/{id}/end) when it is over; by "
                                        "default conversations are simply abandoned, as real clients do")
    api_key: str = setting("", "API key for a gateway that requires one (the decode-KV samples need an admin key)",
                           env="KVSHUTTLE_API_KEY")
    seed: int = setting(0, "Workload seed")
    out_dir: str = setting("var/soak", "Where soak.json and turns.jsonl go")

    def validate(self) -> None:
        super().validate()
        require(self.sessions >= 1, "--sessions must be >= 1")
        require(self.duration_s > 0 and self.request_timeout_s > 0 and self.sample_interval_s > 0,
                "--duration-s, --request-timeout-s and --sample-interval-s must be > 0")
        require(0 <= self.warmup_s < self.duration_s, "--warmup-s must be in [0, duration)")
        require(1 <= self.turn_tokens_min <= self.turn_tokens_max, "need 1 <= --turn-tokens-min <= --turn-tokens-max")
        self.require_stack_started(self.gateway_url, also=("work_dir", "startup_timeout_s"))


@dataclasses.dataclass
class TurnResult:
    session: str
    turn: int
    started_s: float  # since the soak's start
    latency_ms: float
    ok: bool
    stream: bool
    decision: str = ""
    ttft_ms: float | None = None
    prompt_tokens: int = 0
    failure: str = ""  # kind of failure: "http 503", "stream error", "timeout", "transport", "empty answer"
    detail: str = ""


class Soak:
    def __init__(self, cfg: SoakConfig, base_url: str, processes: dict[str, int] | None = None):
        """``processes``: service name → pid whose process tree's memory is sampled."""
        self.cfg = cfg
        self.base_url = base_url
        self.processes = processes or {}
        self.results: list[TurnResult] = []
        self.memory: list[dict] = []  # {"t": s, "<service>": MiB, ...}
        self.kv: list[dict] = []  # {"t": s, "<decode worker>": {"usage": fraction, "held_sessions": n, ...}}
        self.started = 0.0
        # Plain chats (tool results as user text): the soak's stack runs no tool-call parser.
        self.conversations = [c.plain() for c in agentic_conversations(
            count=max(64, cfg.sessions * 4), seed=cfg.seed, max_history_tokens=cfg.max_history_tokens,
            system_tokens=min(400, cfg.max_history_tokens // 4), turn_tokens=(cfg.turn_tokens_min, cfg.turn_tokens_max),
            max_tokens=cfg.answer_tokens)]

    async def run(self) -> dict:
        self.started = time.monotonic()
        stop_at = self.started + self.cfg.duration_s
        sampler = asyncio.create_task(self._sample_memory(stop_at))
        limits = httpx.Limits(max_connections=self.cfg.sessions * 2 + 2, max_keepalive_connections=self.cfg.sessions)
        headers = {"Authorization": f"Bearer {self.cfg.api_key}"} if self.cfg.api_key else {}
        async with httpx.AsyncClient(base_url=self.base_url, timeout=self.cfg.request_timeout_s,
                                     limits=limits, headers=headers) as client:
            kv_sampler = asyncio.create_task(self._sample_kv(client, stop_at))
            await asyncio.gather(*(self._session_loop(client, i, stop_at) for i in range(self.cfg.sessions)))
            kv_sampler.cancel()
            await asyncio.gather(kv_sampler, return_exceptions=True)
            await self._sample_kv_once(client)
        sampler.cancel()
        await asyncio.gather(sampler, return_exceptions=True)
        self._sample_once()
        return report(self.results, self.memory, self.cfg, time.monotonic() - self.started, self.kv)

    async def _session_loop(self, client: httpx.AsyncClient, index: int, stop_at: float) -> None:
        n = index
        while time.monotonic() < stop_at:
            conversation = self.conversations[n % len(self.conversations)]
            n += self.cfg.sessions
            session = f"soak-{index}-{uuid.uuid4().hex[:8]}"
            messages = [{"role": "system", "content": conversation.system}] if conversation.system else []
            for turn, user in enumerate(t.user for t in conversation.turns):
                if time.monotonic() >= stop_at:
                    break
                messages.append({"role": "user", "content": user})
                result, answer = await self._turn(client, session, turn, messages, stream=(index + turn) % 2 == 1)
                self.results.append(result)
                if not result.ok:
                    break  # the conversation cannot go on without its answer: start another
                messages.append({"role": "assistant", "content": answer})
            if self.cfg.end_sessions:  # free its KV on the decode worker now, not at the end of its TTL
                try:
                    await client.post(f"/v1/sessions/{session}/end")
                except httpx.HTTPError:
                    pass

    async def _turn(self, client: httpx.AsyncClient, session: str, turn: int, messages: list[dict], *,
                    stream: bool) -> tuple[TurnResult, str]:
        t = time.monotonic()
        result = TurnResult(session, turn, round(t - self.started, 3), 0.0, False, stream)
        body = {"messages": messages, "max_tokens": self.cfg.answer_tokens, "temperature": 0, "stream": stream}
        answer = ""
        try:
            if stream:
                answer, kv = await self._streamed(client, session, body, result)
            else:
                resp = await client.post("/v1/chat/completions", headers={"X-Session-ID": session}, json=body)
                if resp.status_code != 200:
                    result.failure, result.detail = f"http {resp.status_code}", resp.text[:300]
                    return result, ""
                data = resp.json()
                answer, kv = data["choices"][0]["message"]["content"], data.get("kvshuttle")
                result.prompt_tokens = data["usage"]["prompt_tokens"]
            if kv is not None:
                result.decision = kv["decision"]
                result.ttft_ms = kv["timings_ms"].get("ttft_ms")
            if not result.failure:
                result.ok = bool(answer) and kv is not None
                if not result.ok:
                    result.failure = "empty answer"
        except httpx.TimeoutException:
            result.failure = "timeout"
        except httpx.HTTPError as exc:
            result.failure, result.detail = "transport", str(exc)[:300]
        finally:
            result.latency_ms = round((time.monotonic() - t) * 1000, 2)
        return result, answer

    async def _streamed(self, client: httpx.AsyncClient, session: str, body: dict, result: TurnResult,
                        ) -> tuple[str, dict | None]:
        pieces, kv = [], None
        async with client.stream("POST", "/v1/chat/completions", headers={"X-Session-ID": session},
                                 json=body) as resp:
            if resp.status_code != 200:
                result.failure = f"http {resp.status_code}"
                result.detail = (await resp.aread()).decode(errors="replace")[:300]
                return "", None
            async for line in resp.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    result.failure, result.detail = "stream error", chunk["error"].get("message", "")[:300]
                    return "", None
                for choice in chunk.get("choices", []):
                    pieces.append(choice.get("delta", {}).get("content") or "")
                kv = chunk.get("kvshuttle", kv)
        return "".join(pieces), kv

    async def _sample_kv(self, client: httpx.AsyncClient, stop_at: float) -> None:
        while time.monotonic() < stop_at:
            await self._sample_kv_once(client)
            await asyncio.sleep(self.cfg.sample_interval_s)

    async def _sample_kv_once(self, client: httpx.AsyncClient) -> None:
        """Each decode worker's KV usage (its engine's, via the scheduler's GetStats on the REST bridge) and what it
        holds for sessions between turns (when the scheduler manages decode KV)."""
        try:
            resp = await client.get("/v1/scheduler/stats", timeout=10)
        except httpx.HTTPError as exc:
            log.warning("decode KV sample failed: %s", exc)
            return
        if resp.status_code != 200:
            log.warning("decode KV sample failed: HTTP %d %s", resp.status_code, resp.text[:200])
            return
        sample = kv_sample(resp.json())
        if sample:
            self.kv.append({"t": round(time.monotonic() - self.started, 2), **sample})

    async def _sample_memory(self, stop_at: float) -> None:
        while time.monotonic() < stop_at:
            self._sample_once()
            await asyncio.sleep(self.cfg.sample_interval_s)

    def _sample_once(self) -> None:
        if not self.processes:
            return
        sample: dict = {"t": round(time.monotonic() - self.started, 2)}
        for name, pid in self.processes.items():
            sample[name] = tree_rss_mib(pid)
        self.memory.append(sample)


def kv_sample(stats: dict) -> dict[str, dict]:
    """GetStats (REST JSON) -> per decode worker: KV usage (engine's used/capacity tokens), waiting requests, and
    the held sessions/tokens and evictions when the scheduler manages decode KV. Workers without a capacity (prefill
    workers never hold KV between turns in this view) are left out unless the KV manager lists them."""
    out: dict[str, dict] = {}
    for row in stats.get("loads", []):
        capacity = int(row.get("capacityTokens") or 0)
        if capacity:
            out[row["workerId"]] = {"usage": round(int(row.get("usedTokens") or 0) / capacity, 4),
                                    "waiting": int(row.get("waiting") or 0), "running": int(row.get("running") or 0)}
    managed = stats.get("decodeKv", [])
    for row in managed:
        entry = out.setdefault(row["workerId"], {})
        entry.update(held_sessions=int(row.get("heldSessions") or 0), held_tokens=int(row.get("heldTokens") or 0),
                     evictions={k: int(v) for k, v in (row.get("evictions") or {}).items()})
    if managed:  # prefill workers have no decodeKv row: keep only the decode workers
        decode = {row["workerId"] for row in managed}
        out = {k: v for k, v in out.items() if k in decode}
    return out


def tree_rss_mib(pid: int) -> float | None:
    """Resident memory of ``pid`` and its descendants, in MiB (None when the process is gone)."""
    import psutil

    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.Error:
        return None
    total = 0
    for p in procs:
        try:
            total += p.memory_info().rss
        except psutil.Error:
            pass
    return round(total / 2**20, 1)


def _percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return round(values[min(len(values) - 1, int(q * len(values)))], 2)


def _slope_per_min(points: list[tuple[float, float]]) -> float | None:
    """Least-squares growth of (seconds, MiB) points, in MiB per minute."""
    if len(points) < 3:
        return None
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    var = sum((x - mx) ** 2 for x in xs)
    return round(60 * sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / var, 3) if var else None


def _kv_report(kv: list[dict], elapsed_s: float) -> dict:
    """Per worker in the KV samples: usage per minute (mean and max), the max overall, and the evictions at the end."""
    out = {}
    for worker in sorted({k for s in kv for k in s if k != "t"}):
        points = [(s["t"], s[worker]) for s in kv if worker in s and "usage" in s[worker]]
        if not points:
            continue
        minutes = []
        for start in range(0, int(elapsed_s) + 1, 60):
            window = [p[1]["usage"] for p in points if start <= p[0] < start + 60]
            if window:
                minutes.append({"from_s": start, "mean": round(statistics.fmean(window), 3), "max": max(window)})
        last = points[-1][1]
        out[worker] = {"max_usage": max(p[1]["usage"] for p in points), "per_minute": minutes,
                       "max_waiting": max(p[1].get("waiting", 0) for p in points),
                       "evictions": last.get("evictions", {}), "held_sessions_end": last.get("held_sessions")}
    return out


def report(results: list[TurnResult], memory: list[dict], cfg: SoakConfig, elapsed_s: float,
           kv: list[dict] | None = None) -> dict:
    ok = [r for r in results if r.ok]
    failures: dict[str, int] = {}
    for r in results:
        if not r.ok:
            failures[r.failure] = failures.get(r.failure, 0) + 1
    decisions: dict[str, int] = {}
    for r in ok:
        decisions[r.decision] = decisions.get(r.decision, 0) + 1
    window = 60.0
    per_window = []
    for start in range(0, int(elapsed_s) + 1, int(window)):
        done = [r for r in ok if start <= r.started_s + r.latency_ms / 1000 < start + window]
        span = min(window, elapsed_s - start)
        if span > 1:
            per_window.append({"from_s": start, "turns_per_s": round(len(done) / span, 2)})
    by_decision = {}
    for decision in sorted(decisions):
        rs = [r for r in ok if r.decision == decision]
        ttft = [r.ttft_ms for r in rs if r.ttft_ms is not None]
        by_decision[decision] = {"turns": len(rs), "ttft_p50_ms": _percentile(ttft, 0.5),
                                 "ttft_p95_ms": _percentile(ttft, 0.95),
                                 "latency_p50_ms": _percentile([r.latency_ms for r in rs], 0.5),
                                 "latency_p99_ms": _percentile([r.latency_ms for r in rs], 0.99)}
    services = sorted({k for s in memory for k in s if k != "t"})
    mem = {}
    for name in services:
        points = [(s["t"], s[name]) for s in memory if s.get(name) is not None and s["t"] >= cfg.warmup_s]
        if not points:
            continue
        mem[name] = {"start_mib": points[0][1], "end_mib": points[-1][1], "max_mib": max(p[1] for p in points),
                     "growth_mib": round(points[-1][1] - points[0][1], 1),
                     "slope_mib_per_min": _slope_per_min(points)}
    return {
        "sessions": cfg.sessions, "duration_s": round(elapsed_s, 1), "turns": len(results), "succeeded": len(ok),
        "failed": len(results) - len(ok), "failures": failures, "decisions": decisions,
        "turns_per_s": round(len(ok) / elapsed_s, 2) if elapsed_s else 0.0, "per_minute": per_window,
        "by_decision": by_decision, "memory": mem, "decode_kv": _kv_report(kv or [], elapsed_s),
        "sessions_ended": cfg.end_sessions,
        "failed_examples": [dataclasses.asdict(r) for r in results if not r.ok][:10],
    }


def format_report(rep: dict) -> str:
    lines = [f"soak: {rep['sessions']} sessions for {rep['duration_s']} s: {rep['turns']} turns, "
             f"{rep['succeeded']} succeeded, {rep['failed']} failed {rep['failures'] or ''}",
             f"  throughput: {rep['turns_per_s']} turns/s overall; per minute: "
             + ", ".join(f"{w['turns_per_s']}" for w in rep["per_minute"]),
             f"  decisions: {rep['decisions']}"]
    for decision, s in rep["by_decision"].items():
        lines.append(f"  {decision:<9} TTFT p50 {s['ttft_p50_ms']} ms, p95 {s['ttft_p95_ms']} ms; turn p50 "
                     f"{s['latency_p50_ms']} ms, p99 {s['latency_p99_ms']} ms ({s['turns']} turns)")
    for worker, k in rep.get("decode_kv", {}).items():
        lines.append(f"  {worker} KV usage per minute (mean/max): "
                     + ", ".join(f"{m['mean']:.0%}/{m['max']:.0%}" for m in k["per_minute"])
                     + f"; max {k['max_usage']:.0%}, most waiting {k['max_waiting']}"
                     + (f"; evictions {k['evictions']}" if k["evictions"] else ""))
    if rep["memory"]:
        lines.append("  memory (RSS of each service's process tree, after the warm-up):")
        for name, m in rep["memory"].items():
            lines.append(f"    {name:<12} {m['start_mib']:>8.1f} -> {m['end_mib']:>8.1f} MiB (max {m['max_mib']:.1f}, "
                         f"slope {m['slope_mib_per_min']} MiB/min)")
    return "\n".join(lines)


def write(rep: dict, results: list[TurnResult], memory: list[dict], out_dir: Path, kv: list[dict] | None = None,
          ) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "soak.json").write_text(json.dumps({**rep, "memory_samples": memory, "kv_samples": kv}, indent=2))
    with open(out_dir / "turns.jsonl", "w") as f:
        for r in results:
            f.write(json.dumps(dataclasses.asdict(r)) + "\n")


async def _main(cfg: SoakConfig) -> int:
    task = asyncio.current_task()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):  # stop the stack, then exit
        loop.add_signal_handler(sig, task.cancel)
    stack = None
    try:
        if cfg.gateway_url:
            base_url, processes = cfg.gateway_url, {}
        else:
            stack = Stack(cfg)
            await stack.start()
            base_url = stack.base_url
            processes = {c.name: c.pid for c in stack.children if c.pid}
            for i, member in enumerate(getattr(stack.etcd, "members", None) or [stack.etcd]):
                if member is not None and member.proc is not None:
                    processes[f"etcd-{i}"] = member.proc.pid
        soak = Soak(cfg, base_url, processes)
        rep = await soak.run()
        write(rep, soak.results, soak.memory, Path(cfg.out_dir), soak.kv)
        print(format_report(rep), flush=True)
        print(f"wrote {Path(cfg.out_dir) / 'soak.json'}", flush=True)
        return 0 if rep["failed"] == 0 else 1
    finally:
        if stack is not None:
            await stack.stop()


def main(argv: Sequence[str] | None = None) -> None:
    cfg = load(SoakConfig, argv, prog="kvshuttle soak")
    logging.basicConfig(level=cfg.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request otherwise
    raise SystemExit(asyncio.run(_main(cfg)))
