"""`kvshuttle bench-policies`: the cost model's pull-vs-recompute choices against fixed token thresholds.

It starts the local stack with the scheduler hosting two named policies besides its default, ``always-pull``
(threshold 1) and ``sweep-cost`` (the cost policy), and replays a sweep of conversations (short and long histories, small and large new
turns) in three lanes through the gateway, interleaved turn by turn (the order rotates):

- ``always-pull``: every turn that can pull, pulls (measured);
- ``recompute``: pulls disabled (measured);
- ``cost``: the cost policy decides (measured live, with its own sessions).

Because the first two lanes measure *both* options of every turn side by side, each fixed threshold T is evaluated
on the same turns without running it: a turn with at least T reusable tokens costs what the always-pull lane
measured, any other what the recompute lane measured. The cost policy is shown twice: live (its own lane) and by its
choices (each turn's choice priced with the same two measurements as the thresholds, which removes the noise of a
separate run). ``oracle`` takes the faster of the two measurements each turn: no policy can beat it.

``--link-mbit N`` emulates a slower P-D link, as between nodes: the workers' NIXL transfers go over TCP
(``UCX_TLS=tcp,self``) and the loopback interface is limited to N Mbit/s with a Linux ``htb`` qdisc (needs root and
``tc``; it slows every loopback connection, so the control plane's few small messages too, in every lane alike; the
qdisc is removed at the end). With shared memory (the default) a pull beats recomputing almost everywhere on a CPU,
so a low fixed threshold is already right; over a slow link the right choice depends on the history's length.

The scheduler's cost model is shared by its policies and learns from every lane's reported outcomes, so the cost
lane learns from the other lanes' turns too (they run on the same workers). ``--cost-only`` runs the cost lane alone
(no side-by-side prices then, only its live TTFT and decisions) to see it learn from its own turns.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import os
import shutil
import signal
import statistics
import subprocess
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx
from kvshuttle.services.common.config import load, require, require_effect, setting
from kvshuttle.services.common.tls import ClientTls, TlsClientConfig
from kvshuttle.services.devtools.bench import lanes as lanes_mod
from kvshuttle.services.devtools.bench.multiturn import NO_PREFIX_CACHING, drive
from kvshuttle.services.devtools.bench.samples import TurnSample
from kvshuttle.services.devtools.bench.workload import Conversation, Turn, agentic_conversations
from kvshuttle.services.devtools.stack import Stack, StackConfig

log = logging.getLogger("kvshuttle.bench.policies")
ALWAYS_PULL, RECOMPUTE, COST = "always-pull", "recompute", "cost"
ORACLE = "oracle"
# The scheduler policies the lanes name (the cost lane's has its own name: the scheduler's default may be "cost").
LANE_POLICIES = {ALWAYS_PULL: ALWAYS_PULL, COST: "sweep-cost"}
# (system prompt tokens, (smallest, largest) new user turn): short and long histories, small and large deltas.
SWEEP_CLASSES = ((0, (10, 50)), (60, (20, 100)), (60, (300, 1200)), (1500, (20, 100)), (1500, (300, 1200)))


@dataclasses.dataclass
class PolicySweepConfig(StackConfig, TlsClientConfig):
    """The policy sweep; the local stack's settings apply to the stack it starts."""

    ENV_PREFIX = "KVSHUTTLE_SWEEP_"
    per_class: int = setting(2, "Conversations per sweep class (5 classes: no system prompt and tiny turns, then "
                                "short/long system prompt x small/large new turns)")
    prefill_cache: str = setting("cold", "P's own prefix cache: cold (off: a turn pulls or recomputes its history) or "
                                         "warm (on: P still holds what it prefilled; each lane then gets its own "
                                         "system-prompt tag so the lanes do not share P's cache)",
                                 choices=("cold", "warm"))
    seed: int = setting(0, "Workload seed")
    max_history_tokens: int = setting(5000, "Grow each conversation up to about this many tokens")
    max_turns: int = setting(10, "At most this many turns per conversation")
    max_tokens: int = setting(32, "Tokens generated per turn")
    thresholds: str = setting("16,64,512", "Fixed pull thresholds (reusable tokens) to compare with")
    buckets: str = setting("1,256,1000,3000", "History-length bucket edges in tokens (turn 1 has none: left out)")
    gateway_url: str = setting("", "Drive this running stack instead of starting one; its scheduler must host the "
                                   "policies always-pull and cost (see sweep_policies()) and --scheduler-address "
                                   "gives its stats")
    scheduler_address: str = setting("", "With --gateway-url: the scheduler's gRPC address (for its stats; under "
                                         "mutual TLS give --tls-ca and an admin's --tls-client-cert/--tls-client-key)")
    cost_only: bool = setting(False, "Run only the cost lane (it then learns only from its own turns)")
    cost_params: str = setting("", "Parameters of the cost policy (key=value,...; see kvshuttle scheduler)")
    cost_model_params: str = setting("", "The scheduler's cost-model parameters (key=value,...)")
    link_mbit: int = setting(0, "Emulate a slow P-D link: NIXL over TCP and loopback limited to this many Mbit/s "
                                "(root and tc needed; 0: shared memory, no limit)")
    out_dir: str = setting("var/bench", "Results go to <out-dir>/policies-<timestamp>/")
    progress: bool = setting(True, "Show a progress bar")
    turn_timeout_s: float = setting(600.0, "Deadline of one turn")
    work_dir: str = setting("var/bench/stack", "Logs and worker caches of the stack")
    http_port: int = setting(0, "Gateway HTTP port of the started stack (0: any free port)")
    grpc_port: int = setting(0, "Gateway gRPC port of the started stack (0: any free port)")
    decoder_kv_blocks_ttl: int = setting(120, "Seconds a decode worker keeps a finished turn's blocks")

    @property
    def threshold_list(self) -> list[int]:
        return [int(x) for x in self.thresholds.split(",") if x.strip()]

    @property
    def bucket_edges(self) -> list[int]:
        return [int(x) for x in self.buckets.split(",") if x.strip()]

    def validate(self) -> None:
        super().validate()
        require(self.per_class >= 1 and self.max_turns >= 2 and self.max_tokens >= 1,
                "--per-class and --max-tokens must be >= 1, --max-turns >= 2")
        try:
            ok = all(t >= 1 for t in self.threshold_list) and self.bucket_edges == sorted(set(self.bucket_edges))
        except ValueError:
            ok = False
        require(ok and bool(self.bucket_edges), "--thresholds must be integers >= 1, --buckets increasing integers")
        require(self.link_mbit >= 0, "--link-mbit must be >= 0")
        # with --gateway-url the policies and the cost model are the running scheduler's
        self.require_stack_started(self.gateway_url, also=("work_dir", "startup_timeout_s", "cost_params",
                                                           "cost_model_params"))
        require_effect(self, "scheduler_address", bool(self.gateway_url),
                       "without --gateway-url (the started stack's own scheduler gives the stats)")
        for name in ("tls_ca", "tls_client_cert", "tls_client_key", "tls_server_name"):
            require_effect(self, name, bool(self.scheduler_address), "without --scheduler-address (it is for that "
                                                                     "scheduler's stats)")
        self.validate_tls_client()


def sweep_policies(cost_params: str = "") -> str:
    """The scheduler's extra policies the sweep's lanes name (KVSHUTTLE_SCHEDULER_POLICIES)."""
    # the cost lane judges pull vs recompute (the lanes measure both): it does not continue turns on D
    return (f"{LANE_POLICIES[ALWAYS_PULL]}=threshold:pull_threshold_tokens=1; {LANE_POLICIES[COST]}=cost"
            ":continue_on_decode=never" + (f",{cost_params}" if cost_params else ""))


def sweep_workload(cfg: PolicySweepConfig) -> list[Conversation]:
    out = []
    for k, (system, turn_tokens) in enumerate(SWEEP_CLASSES):
        for conv in agentic_conversations(count=cfg.per_class, seed=cfg.seed * 100 + k,
                                          max_history_tokens=cfg.max_history_tokens, system_tokens=system,
                                          turn_tokens=turn_tokens, max_tokens=cfg.max_tokens,
                                          max_turns=cfg.max_turns):
            # Plain chats (tool results as user text): the sweep's stack runs no tool-call parser.
            out.append(dataclasses.replace(conv.plain(), id=f"sweep{k}-{conv.id}"))
    return out


def _bucket(value: int, edges: list[int]) -> str | None:
    if value < edges[0]:
        return None
    for lo, hi in zip(edges, edges[1:], strict=False):
        if lo <= value < hi:
            return f"{lo}-{hi}"
    return f"{edges[-1]}+"


def _summary(values: list[float]) -> dict[str, float | None]:
    return {"mean": statistics.fmean(values) if values else None,
            "p50": statistics.median(values) if values else None, "n": len(values)}


def price_turns(samples: list[TurnSample], thresholds: list[int]) -> list[dict[str, Any]]:
    """Each later turn with its measured TTFT per lane and the TTFT each policy's choice costs.

    A threshold's (or the cost policy's) choice is priced with the always-pull and recompute lanes' measurements of
    the same turn; turns where the always-pull lane could not pull are priced as recomputes for every policy.
    """
    by_turn: dict[tuple[str, int], dict[str, TurnSample]] = {}
    for s in samples:
        by_turn.setdefault((s.conversation, s.turn), {})[s.mode] = s
    rows = []
    for (conv, turn), lanes in sorted(by_turn.items()):
        pull, recompute, cost = lanes.get(ALWAYS_PULL), lanes.get(RECOMPUTE), lanes.get(COST)
        if turn < 2 or pull is None or recompute is None:
            continue
        reusable = pull.pulled_tokens if pull.decision == "pull" else 0
        row: dict[str, Any] = {"conversation": conv, "turn": turn, "history_tokens": pull.history_tokens,
                               "new_tokens": pull.new_tokens, "reusable_tokens": reusable,
                               ALWAYS_PULL: pull.ttft_ms, RECOMPUTE: recompute.ttft_ms,
                               ORACLE: min(pull.ttft_ms, recompute.ttft_ms) if reusable else recompute.ttft_ms}
        for t in thresholds:
            row[f"threshold-{t}"] = pull.ttft_ms if reusable >= t and reusable else recompute.ttft_ms
        if cost is not None:
            row["cost-live"] = cost.ttft_ms
            row["cost-decision"] = cost.decision
            row["cost-choices"] = pull.ttft_ms if cost.decision == "pull" and reusable else recompute.ttft_ms
            row["cost-picked-faster"] = (row["cost-choices"] == row[ORACLE]) if reusable else None
        rows.append(row)
    return rows


def policy_columns(thresholds: list[int], with_cost: bool) -> list[str]:
    cols = [f"threshold-{t}" for t in thresholds] + [ALWAYS_PULL, RECOMPUTE]
    return (["cost-choices", "cost-live"] if with_cost else []) + cols + [ORACLE]


def sweep_report(rows: list[dict[str, Any]], thresholds: list[int], buckets: list[int]) -> dict[str, Any]:
    """TTFT per policy by history bucket, by new-turn size, and overall."""
    with_cost = any("cost-choices" in r for r in rows)
    cols = policy_columns(thresholds, with_cost)

    def group(selected: list[dict[str, Any]]) -> dict[str, Any]:
        out: dict[str, Any] = {"turns": len(selected)}
        for col in cols:
            out[col] = _summary([r[col] for r in selected if col in r])
        judged = [r["cost-picked-faster"] for r in selected if r.get("cost-picked-faster") is not None]
        out["cost_picked_faster"] = sum(judged) / len(judged) if judged else None
        out["cost_pulls"] = sum(1 for r in selected if r.get("cost-decision") == "pull")
        return out

    by_history: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        key = _bucket(r["history_tokens"], buckets)
        if key is not None:
            by_history.setdefault(key, []).append(r)
    by_delta = {"new <= 150": [r for r in rows if r["new_tokens"] <= 150],
                "new > 150": [r for r in rows if r["new_tokens"] > 150]}
    return {"columns": cols, "overall": group(rows),
            "by_history": {k: group(v) for k, v in sorted(by_history.items(), key=lambda kv: int(kv[0].split("-")[0]
                                                                                                   .rstrip("+")))},
            "by_new_tokens": {k: group(v) for k, v in by_delta.items() if v}}


def format_sweep(report: dict[str, Any]) -> str:
    cols = report["columns"]
    width = max(12, *(len(c) + 1 for c in cols))
    lines = []

    def table(title: str, groups: dict[str, dict[str, Any]]) -> None:
        lines.append(f"{title} — mean TTFT ms (lower is better; * = best fixed threshold)")
        lines.append(f"{'bucket':<14}{'turns':>6}" + "".join(f"{c:>{width}}" for c in cols) + f"{'cost right':>12}")
        for name, g in groups.items():
            fixed = [g[c]["mean"] for c in cols if c.startswith("threshold-") and g[c]["mean"] is not None]
            best = min(fixed) if fixed else None
            cells = []
            for c in cols:
                v = g[c]["mean"]
                mark = "*" if v is not None and c.startswith("threshold-") and v == best else ""
                cells.append(f"{(f'{v:.1f}' if v is not None else '-') + mark:>{width}}")
            right = g["cost_picked_faster"]
            lines.append(f"{name:<14}{g['turns']:>6}" + "".join(cells)
                         + f"{(f'{right:.0%}' if right is not None else '-'):>12}")
        lines.append("")

    table("By history length (tokens)", report["by_history"])
    table("By new-turn size (tokens)", report["by_new_tokens"])
    table("All later turns", {"all": report["overall"]})
    lines.append("cost-choices: the cost policy's live decisions priced with the always-pull/recompute measurements of "
                 "the same turn (as the thresholds are); cost-live: its own lane's measured TTFT; cost right: share "
                 "of turns with a choice where it picked the faster measured option.")
    return "\n".join(lines)


async def _scheduler_stats(address: str, tls: ClientTls | None) -> dict[str, Any]:
    from google.protobuf import json_format
    from kvshuttle.services.common.grpc_server import client_channel
    from kvshuttle.v1 import scheduler_pb2, scheduler_pb2_grpc

    async with client_channel(address, tls) as channel:
        resp = await scheduler_pb2_grpc.TransferSchedulerStub(channel).GetStats(scheduler_pb2.GetStatsRequest(),
                                                                                 timeout=5)
    return json_format.MessageToDict(resp, preserving_proto_field_name=True)


class _RecordingLane:
    """A gateway lane that keeps the gateway's kvshuttle report (decision, reason, predictions) of every turn."""

    def __init__(self, lane: lanes_mod.GatewayLane, reports: list[dict[str, Any]]):
        self.lane, self.reports = lane, reports

    async def turn(self, turn: Turn) -> TurnSample:
        sample = await self.lane.turn(turn)
        kv = {k: v for k, v in self.lane.last_kv.items() if k != "timings_ms"}
        self.reports.append({"mode": sample.mode, "conversation": sample.conversation, "turn": sample.turn,
                             "prefill_ms": self.lane.last_timings.get("prefill_ms"), **kv})
        return sample

    async def close(self) -> None:
        await self.lane.close()


class SlowLink:
    """Loopback limited to ``mbit`` Mbit/s (htb qdisc) and NIXL over TCP, for the duration of a ``with`` block."""

    def __init__(self, mbit: int):
        self.mbit = mbit
        self._ucx = os.environ.get("UCX_TLS")

    def _tc(self, *args: str) -> subprocess.CompletedProcess:
        return subprocess.run(["tc", *args], capture_output=True, text=True, check=False)

    def __enter__(self) -> SlowLink:
        if shutil.which("tc") is None:
            raise SystemExit("--link-mbit needs tc (Debian: iproute2)")
        for args in (("qdisc", "add", "dev", "lo", "root", "handle", "1:", "htb", "default", "10", "r2q", "1000"),
                     ("class", "add", "dev", "lo", "parent", "1:", "classid", "1:10", "htb", "rate",
                      f"{self.mbit}mbit", "ceil", f"{self.mbit}mbit", "burst", "64k")):
            done = self._tc(*args)
            if done.returncode != 0:
                self._tc("qdisc", "del", "dev", "lo", "root")
                raise SystemExit(f"--link-mbit: `tc {' '.join(args)}` failed (root needed; is a qdisc already on "
                                 f"lo?): {done.stderr.strip()}")
        os.environ["UCX_TLS"] = "tcp,self"  # the workers inherit it: NIXL moves KV over TCP, through the limit
        log.info("loopback limited to %d Mbit/s, NIXL over TCP", self.mbit)
        return self

    def __exit__(self, *exc: object) -> None:
        self._tc("qdisc", "del", "dev", "lo", "root")
        if self._ucx is None:
            os.environ.pop("UCX_TLS", None)
        else:
            os.environ["UCX_TLS"] = self._ucx


async def run_sweep(cfg: PolicySweepConfig) -> int:
    with SlowLink(cfg.link_mbit) if cfg.link_mbit else contextlib.nullcontext():
        return await _run_sweep(cfg)


async def _run_sweep(cfg: PolicySweepConfig) -> int:
    conversations = await asyncio.to_thread(sweep_workload, cfg)
    lanes = [COST] if cfg.cost_only else [ALWAYS_PULL, RECOMPUTE, COST]
    run_id = uuid.uuid4().hex[:6]
    out_dir = Path(cfg.out_dir) / time.strftime("policies-%Y%m%d-%H%M%S")
    if cfg.prefill_cache == "cold" and NO_PREFIX_CACHING not in cfg.prefill_extra_args:
        cfg.prefill_extra_args = f"{cfg.prefill_extra_args} {NO_PREFIX_CACHING}".strip()
    scheduler_env = {"KVSHUTTLE_SCHEDULER_POLICIES": sweep_policies(cfg.cost_params),
                     "KVSHUTTLE_SCHEDULER_COST_MODEL_PARAMS": cfg.cost_model_params}
    started = time.time()
    stack = None if cfg.gateway_url else Stack(cfg, scheduler_env=scheduler_env)
    stats: dict[str, Any] = {}
    reports: list[dict[str, Any]] = []
    try:
        if stack is not None:
            await stack.start()
        base_url = stack.base_url if stack is not None else cfg.gateway_url.rstrip("/")
        async with httpx.AsyncClient(base_url=base_url, timeout=cfg.turn_timeout_s) as client:
            def make_lanes(conv: Conversation) -> dict:
                made = {}
                for lane in lanes:
                    policy = LANE_POLICIES.get(lane, "")
                    system = conv.system
                    if cfg.prefill_cache == "warm":  # distinct first tokens: no lane hits another's cache on P
                        system = f"[{lane} lane] {system or ''}"
                    made[lane] = _RecordingLane(lanes_mod.GatewayLane(
                        client, lane, conv.id, system, run_id, disable_pull=lane == RECOMPUTE, policy=policy), reports)
                return made

            print(f"kvshuttle bench-policies: {len(conversations)} conversations, "
                  f"{sum(len(c.turns) for c in conversations)} turns each in {', '.join(lanes)}", flush=True)
            outcome = await drive(conversations, make_lanes, lanes, concurrency=1, progress=cfg.progress,
                                  turn_timeout_s=cfg.turn_timeout_s)
        scheduler = stack.scheduler_address if stack is not None else cfg.scheduler_address
        if scheduler:
            stats = await _scheduler_stats(scheduler, stack.client_tls() if stack is not None else cfg.client_tls())
    finally:
        if stack is not None:
            await stack.stop()

    rows = price_turns(outcome.samples, cfg.threshold_list)
    report = sweep_report(rows, cfg.threshold_list, cfg.bucket_edges) if rows else {}
    report["meta"] = {"wall_s": round(time.time() - started, 1), "lanes": lanes, "conversations": len(conversations),
                      "seed": cfg.seed, "max_history_tokens": cfg.max_history_tokens, "max_tokens": cfg.max_tokens,
                      "prefill_cache": cfg.prefill_cache, "link_mbit": cfg.link_mbit,
                      "failures": outcome.failures, "machine": {"cpus": os.cpu_count()}}
    report["scheduler_stats"] = stats
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "sweep.json").write_text(json.dumps(report, indent=2))
    with (out_dir / "samples.jsonl").open("w") as f:
        for s in outcome.samples:
            f.write(json.dumps(s.to_dict()) + "\n")
    with (out_dir / "decisions.jsonl").open("w") as f:  # each turn's decision, reason and predictions
        for r in reports:
            f.write(json.dumps(r) + "\n")
    print()
    if rows:
        print(format_sweep(report))
    else:
        cost = [s for s in outcome.samples if s.turn > 1]
        pulls = sum(1 for s in cost if s.decision == "pull")
        print(f"cost lane alone: {pulls}/{len(cost)} later turns pulled, mean TTFT "
              f"{statistics.fmean(s.ttft_ms for s in cost):.1f} ms" if cost else "no later turns")
    for p in stats.get("policies", []):
        print(f"policy {p['name']}: regret {float(p.get('regret', 0)):.0%} of {p.get('judged_turns', 0)} judged turns")
    print(f"\nresults: {out_dir}")
    if outcome.failures:
        print(f"{len(outcome.failures)} conversation(s) failed:\n  " + "\n  ".join(outcome.failures))
        return 1
    return 0


def main(argv: Sequence[str] | None = None) -> None:
    cfg = load(PolicySweepConfig, argv, prog="kvshuttle bench-policies")
    logging.basicConfig(level=cfg.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request otherwise

    async def run() -> int:
        task = asyncio.current_task()
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, task.cancel)
        return await run_sweep(cfg)

    raise SystemExit(asyncio.run(run()))
