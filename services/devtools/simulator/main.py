"""`kvshuttle simulate`: a cluster of prefill and decode workers serving sessions, one run per deployment strategy
on the same workload (equal offered load), driving the real planner, policies, selector, cost model and decode-KV
capacity policy (``kvshuttle.control_plane``). No vLLM, no network: see ``docs/simulator.md``."""

from __future__ import annotations

import dataclasses
import multiprocessing
import random
import resource
import time
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

from kvshuttle.control_plane import kv_eviction as ev
from kvshuttle.control_plane.cost_model import PrefillPrior
from kvshuttle.services.common.config import load, require, require_effect, setting
from kvshuttle.services.devtools.bench.stats import write_json
from kvshuttle.services.devtools.simulator import report, strategies
from kvshuttle.services.devtools.simulator import validate as validation
from kvshuttle.services.devtools.simulator.cluster import DecodeWorker, PrefillWorker
from kvshuttle.services.devtools.simulator.engine import SimSettings, Simulation
from kvshuttle.services.devtools.simulator.hardware import PROFILES, Profile, profile
from kvshuttle.services.devtools.simulator.workload import (
    AgenticMix,
    SimSession,
    TraceError,
    agentic_sessions,
    load_mooncake,
    mooncake_lines,
)

# The agentic workload's settings (unused with --trace).
AGENTIC = ("sessions", "arrival_s", "agent_share", "agent_gap_s", "chat_gap_s", "max_history_tokens", "adapters",
           "adapter_share")


@dataclasses.dataclass
class SimulateConfig:
    """A simulated P/D cluster: deployment strategies compared on one workload."""

    ENV_PREFIX = "KVSHUTTLE_SIMULATE_"
    strategies: str = setting(",".join(strategies.NAMES), f"Strategies to run (comma-separated): "
                                                          f"{', '.join(strategies.NAMES)}; also "
                                                          f"{', '.join(strategies.EXTRA)} (kvshuttle without its "
                                                          f"third choice: it never continues a turn on D)")
    profile: str = setting("h200-32b-400g", "Hardware profile of every worker", choices=tuple(PROFILES))
    prefill_workers: int = setting(8, "Prefill workers")
    decode_workers: int = setting(8, "Decode workers")
    candidates: int = setting(8, "Workers of each kind the planner scores per turn (a sample, plus the session's "
                                 "last prefill worker)")
    trace: str = setting("", "A Mooncake-format JSONL trace to replay ('': the agentic arrival process below)")
    trace_block: int = setting(512, "Tokens per hash id in --trace")
    write_trace: str = setting("", "Also write the workload as a Mooncake-format JSONL trace here")
    sessions: int = setting(250, "Agentic workload: sessions")
    arrival_s: float = setting(600.0, "Agentic workload: sessions start within this many seconds (Poisson)")
    agent_share: float = setting(0.7, "Agentic workload: share of agent sessions (the rest: chat)")
    agent_gap_s: float = setting(3.0, "Agentic workload: an agent's mean pause between turns (tool time)")
    chat_gap_s: float = setting(45.0, "Agentic workload: a chat user's mean pause between turns")
    max_history_tokens: int = setting(131_072, "Agentic workload: the model's context (sessions end before it)")
    adapters: int = setting(0, "Agentic workload: LoRA adapters of the model (docs/models.md); sessions under one "
                               "choose it Zipf(1.1); its KV is its own (no cache hit or pull across adapters)")
    adapter_share: float = setting(0.0, "Agentic workload: share of sessions that run under an adapter")
    seed: int = setting(0, "Workload and simulation seed")
    ttl_s: float = setting(480.0, "Decode workers keep an unread handle this long (decoder_kv_blocks_ttl)")
    tick_s: float = setting(5.0, "Expiry and freeing rounds every this many simulated seconds")
    unit_tokens: int = setting(256, "Prefix-cache accounting unit (tokens; a multiple of the block size)")
    prefill_cache_tokens: int = setting(0, "Override the profile's prefill prefix-cache capacity (tokens; 0: keep)")
    decode_kv_tokens: int = setting(0, "Override the profile's decode KV capacity (tokens; 0: keep)")
    link_gbit_s: float = setting(0.0, "Override the profile's P-D link (Gbit/s of goodput; 0: keep)")
    pull_threshold_tokens: int = setting(16, "The threshold and cache_aware_pull strategies' fewest reusable "
                                             "tokens worth a pull")
    idle_limit_s: float = setting(240.0, "kvshuttle: free a handle idle this long (0: never)")
    high_water: float = setting(0.8, "kvshuttle: free under pressure past this share of D's KV")
    low_water: float = setting(0.6, "kvshuttle: ... down to this share")
    slo_ms: float = setting(2000.0, "TTFT SLO for goodput (turns/s answered within it)")
    max_num_batched_tokens: int = setting(8192, "A prefill on a decode worker (conditional_disagg, LOCAL) runs in "
                                                "chunks of this many tokens per decode step (vLLM's "
                                                "max_num_batched_tokens: 8192 on H100/H200)")
    cd_eff_isl_threshold: int = setting(4096, "conditional_disagg: prefill on the decode worker when the prompt less "
                                              "its cached prefix there is below this many tokens (Dynamo's "
                                              "eff_isl_threshold; its guide's example 4096, its code's default 2048)")
    cd_eff_isl_ratio: float = setting(0.6, "conditional_disagg: ... and below this share of the prompt (Dynamo's "
                                           "eff_isl_ratio_threshold; its guide's example 0.6, its default 0.7)")
    cpu_tier_gib: float = setting(100.0, "cache_aware_offload: each prefill node's CPU tier of the prefix cache (GiB; "
                                         "llm-d's guide: 100 GB)")
    cpu_restore_gb_s: float = setting(50.0, "cache_aware_offload: CPU tier to GPU restore rate (GB/s; vLLM's "
                                            "offloading connector: ~50 GB/s over PCIe Gen5 on H100)")
    peer_cpu_pull: bool = setting(False, "cache_aware_offload: also pull the prompt's next units from another "
                                         "prefill node's CPU tier over the network (llm-d's peer-to-peer NIXL pull)")
    validate_samples: str = setting("", "Instead of a run: fit the cpu-tiny profile to half the conversations of a `kvshuttle "
                                "bench` samples.jsonl (pull and recompute modes), replay that run and any more given "
                                "(comma-separated: e.g. a higher --concurrency) on as many workers and conversations "
                                "in flight as they had, and compare the simulated turns with the measured ones "
                                "(--prefill-cache-tokens: P's prefix cache there; 0: the bench's default, cold)")
    validate_profile: str = setting("cpu-tiny", "--validate-samples: the profile whose KV size and capacities the fit "
                                                "keeps (its costs are fitted)", choices=tuple(PROFILES))
    validate_warm_up: int = setting(1, "--validate-samples: leave out the run's first conversations (the engines' "
                                       "warm-up)")
    validate_host_cores: float = setting(0.0, "--validate-samples: the measured runs' workers shared one host of this "
                                              "many cores (the bench's local stack: the machine's); 0: each worker "
                                              "had its own hardware")
    jobs: int = setting(2, "Strategies simulated in parallel (processes)")
    out: str = setting("var/bench/simulate.json", "Where the JSON report goes ('': not written)")

    def validate(self) -> None:
        names = self.strategy_list()
        require(bool(names) and all(n in strategies.CHOICES for n in names),
                f"--strategies: choose from {', '.join(strategies.CHOICES)}, got {self.strategies!r}")
        require(self.prefill_workers >= 1 and self.decode_workers >= 1, "need at least one prefill and one decode "
                                                                       "worker")
        require(self.candidates >= 1, "--candidates must be >= 1")
        require(self.sessions >= 1 and self.arrival_s >= 0, "--sessions must be >= 1 and --arrival-s >= 0")
        require(0 <= self.agent_share <= 1, "--agent-share must be within 0..1")
        require(self.adapters >= 0 and 0 <= self.adapter_share <= 1,
                "--adapters must be >= 0 and --adapter-share within 0..1")
        require_effect(self, "adapter_share", self.adapters > 0, "without --adapters")
        require(self.agent_gap_s > 0 and self.chat_gap_s > 0, "--agent-gap-s and --chat-gap-s must be > 0")
        require(self.ttl_s > 0 and self.tick_s > 0 and self.slo_ms > 0, "--ttl-s, --tick-s and --slo-ms must be > 0")
        require(self.validate_warm_up >= 0, "--validate-warm-up must be >= 0")
        require(self.validate_host_cores >= 0, "--validate-host-cores must be >= 0")
        require(self.trace_block >= 1 and self.jobs >= 1 and self.pull_threshold_tokens >= 1,
                "--trace-block, --jobs and --pull-threshold-tokens must be >= 1")
        require(min(self.prefill_cache_tokens, self.decode_kv_tokens, self.link_gbit_s, self.idle_limit_s) >= 0,
                "capacity, link and idle-limit overrides must be >= 0")
        require(self.max_history_tokens >= 1000, "--max-history-tokens must be >= 1000")
        require(self.max_num_batched_tokens >= 1 and self.cd_eff_isl_threshold >= 0,
                "--max-num-batched-tokens must be >= 1 and --cd-eff-isl-threshold >= 0")
        require(0 <= self.cd_eff_isl_ratio <= 1, "--cd-eff-isl-ratio must be within 0..1")
        require(self.cpu_tier_gib >= 0 and self.cpu_restore_gb_s > 0,
                "--cpu-tier-gib must be >= 0 and --cpu-restore-gb-s > 0")
        try:
            self.limits()
        except ValueError as exc:
            require(False, f"--high-water/--low-water: {exc}")
        prof = self.hardware()
        require(self.unit_tokens >= prof.block_size and self.unit_tokens % prof.block_size == 0,
                f"--unit-tokens must be a multiple of the profile's block size ({prof.block_size})")
        if self.trace:
            require(Path(self.trace).is_file(), f"--trace {self.trace!r}: no such file")
        for path in filter(None, self.validate_samples.split(",")):
            require(Path(path).is_file(), f"--validate-samples {path!r}: no such file")
        self.validate_effects(names)

    def validate_effects(self, names: Sequence[str]) -> None:
        """Settings another one makes a no-op, when given: an error naming both flags."""
        for name in ("validate_profile", "validate_warm_up", "validate_host_cores"):
            require_effect(self, name, bool(self.validate_samples), "without --validate-samples")
        for name in ("trace", "write_trace"):
            require_effect(self, name, not self.validate_samples,
                           "with --validate-samples (it replaces the run: no workload is built)")
        require_effect(self, "trace_block", bool(self.trace), "without --trace")
        for name in AGENTIC:
            require_effect(self, name, not self.trace, "with --trace (the trace's sessions are replayed instead of "
                                                       "the agentic workload)")
        require_effect(self, "pull_threshold_tokens", "threshold" in names or "cache_aware_pull" in names,
                       "without threshold or cache_aware_pull in --strategies (it is their pull rule)")
        for name in ("idle_limit_s", "high_water", "low_water"):
            require_effect(self, name, "kvshuttle" in names or "kvshuttle_pull" in names,
                           "without kvshuttle in --strategies (only it frees held decode KV)")
        require_effect(self, "max_num_batched_tokens", "conditional_disagg" in names or "kvshuttle" in names,
                       "without conditional_disagg or kvshuttle in --strategies (only they prefill on a decode "
                       "worker)")
        for name in ("cd_eff_isl_threshold", "cd_eff_isl_ratio"):
            require_effect(self, name, "conditional_disagg" in names,
                           "without conditional_disagg in --strategies (it is its bypass rule)")
        for name in ("cpu_tier_gib", "cpu_restore_gb_s", "peer_cpu_pull"):
            require_effect(self, name, "cache_aware_offload" in names,
                           "without cache_aware_offload in --strategies (only its prefill nodes have a CPU tier)")

    def strategy_list(self) -> list[str]:
        return [s.strip() for s in self.strategies.split(",") if s.strip()]

    def limits(self) -> ev.KvLimits:
        return ev.KvLimits(high_water=self.high_water, low_water=self.low_water, held_budget=0.0,
                           idle_limit_s=self.idle_limit_s)

    def hardware(self) -> Profile:
        return profile(self.profile, prefill_cache_tokens=self.prefill_cache_tokens,
                       decode_kv_tokens=self.decode_kv_tokens, link_gbit_s=self.link_gbit_s)

    def mix(self) -> AgenticMix:
        return AgenticMix(sessions=self.sessions, arrival_s=self.arrival_s, agent_share=self.agent_share,
                          agent_gap_s=self.agent_gap_s, chat_gap_s=self.chat_gap_s,
                          max_history_tokens=self.max_history_tokens, adapters=self.adapters,
                          adapter_share=self.adapter_share, seed=self.seed)


def workload(cfg: SimulateConfig) -> list[SimSession]:
    if cfg.trace:
        try:
            return load_mooncake(cfg.trace, cfg.trace_block)
        except TraceError as exc:
            raise SystemExit(f"kvshuttle simulate: {exc}") from None
    return agentic_sessions(cfg.mix())


def simulate(cfg: SimulateConfig, sessions: Sequence[SimSession], name: str) -> dict[str, Any]:
    """One strategy over the workload; returns its summary (figures, and the simulator's own wall time)."""
    started = time.monotonic()
    prof = cfg.hardware()
    index: dict[int, set[str]] = {}
    unit = cfg.unit_tokens
    prefill = [PrefillWorker(f"p{i}", max(1, prof.prefill_cache_tokens // unit), prof.block_size, index)
               for i in range(cfg.prefill_workers)]
    decode = [DecodeWorker(f"d{i}", prof.decode_kv_tokens, prof.block_size) for i in range(cfg.decode_workers)]
    strategy = strategies.make(name, prefill, decode, random.Random(cfg.seed), candidates=cfg.candidates, unit=unit,
                               prior=PrefillPrior(), index=index, pull_threshold_tokens=cfg.pull_threshold_tokens,
                               eff_isl_threshold=cfg.cd_eff_isl_threshold,
                               eff_isl_ratio_threshold=cfg.cd_eff_isl_ratio)
    settings = SimSettings(ttl_s=cfg.ttl_s, tick_s=cfg.tick_s, unit_tokens=unit, limits=cfg.limits(), seed=cfg.seed,
                           max_num_batched_tokens=cfg.max_num_batched_tokens, cpu_tier_gib=cfg.cpu_tier_gib,
                           cpu_restore_gb_s=cfg.cpu_restore_gb_s, peer_cpu_pull=cfg.peer_cpu_pull)
    result = Simulation(sessions, strategy, prof, prefill, decode, settings).run()
    out = report.summarize(result, cfg.slo_ms)
    out["wall_s"] = round(time.monotonic() - started, 1)
    out["max_rss_mib"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
    return out


_SHARED: tuple[SimulateConfig, list[SimSession]] | None = None  # the parent's workload, inherited by forked jobs


def _job(name: str) -> dict[str, Any]:
    assert _SHARED is not None
    return simulate(_SHARED[0], _SHARED[1], name)


def run(cfg: SimulateConfig) -> dict[str, Any]:
    global _SHARED
    sessions = workload(cfg)
    if cfg.write_trace:
        path = Path(cfg.write_trace)
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("w", encoding="utf-8") as f:
            for line in mooncake_lines(sessions):
                f.write(line + "\n")
    names = cfg.strategy_list()
    _SHARED = (cfg, sessions)
    if cfg.jobs > 1 and len(names) > 1:
        with ProcessPoolExecutor(min(cfg.jobs, len(names)), mp_context=multiprocessing.get_context("fork")) as pool:
            rows = list(pool.map(_job, names))
    else:
        rows = [_job(n) for n in names]
    prof = cfg.hardware()
    turns = sum(len(s.turns) for s in sessions)
    return {"config": {k: v for k, v in dataclasses.asdict(cfg).items()}, "profile": dataclasses.asdict(prof),
            "workload": {"sessions": len(sessions), "turns": turns,
                         "prompt_tokens_first": sum(s.first_tokens for s in sessions)},
            "results": rows}


def format_report(rep: dict[str, Any]) -> str:
    cfg, prof, work = rep["config"], rep["profile"], rep["workload"]
    head = (f"kvshuttle simulate: {cfg['prefill_workers']} prefill + {cfg['decode_workers']} decode workers "
            f"({prof['name']}: {prof['source']}), {work['sessions']:,} sessions, {work['turns']:,} turns "
            f"({'trace ' + cfg['trace'] if cfg['trace'] else 'agentic arrivals'}), equal offered load")
    peak = ", ".join(f"{r['strategy']} {r['peak_live_sessions']:,}" for r in rep["results"])
    walls = ", ".join(f"{r['strategy']} {r['wall_s']} s ({r['max_rss_mib']} MiB)" for r in rep["results"])
    return f"{head}\n\n{report.table(rep['results'])}\n\npeak live sessions: {peak}\nsimulator wall time: {walls}"


def main(argv: Sequence[str] | None = None) -> None:
    cfg = load(SimulateConfig, argv, prog="kvshuttle simulate")
    started = time.monotonic()
    if cfg.validate_samples:
        try:
            rep = validation.validate(cfg.validate_samples, base=cfg.validate_profile,
                                      prefill_cache_tokens=cfg.prefill_cache_tokens, warm_up=cfg.validate_warm_up,
                                      host_cores=cfg.validate_host_cores)
        except validation.ValidationError as exc:
            raise SystemExit(f"kvshuttle simulate --validate-samples: {exc}") from None
        print(validation.format_validation(rep), flush=True)
        if cfg.out:
            print(f"wrote {write_json(cfg.out, rep)}", flush=True)
        return
    rep = run(cfg)
    rep["elapsed_s"] = round(time.monotonic() - started, 1)
    print(format_report(rep), flush=True)
    if cfg.out:
        print(f"wrote {write_json(cfg.out, rep)} ({rep['elapsed_s']} s)", flush=True)
