"""`kvshuttle bench`: multi-turn agentic conversations through the gateway, pull vs recompute vs ideal, in one run.

By default it starts the local stack (etcd, registry, scheduler, gateway, one P and one D) plus one colocated vLLM
worker for the ideal mode, replays the conversations in every mode, interleaved turn by turn (the mode order rotates
every turn) so machine noise hits all modes alike, and stops everything. ``--gateway-url`` drives a running stack
instead (``--ideal-address`` then names a colocated worker for the ideal mode).

The modes (see ``services/devtools/bench/lanes.py``): ``pull`` and ``recompute`` go through the gateway's OpenAI API (the
latter with pulls disabled per request); ``local`` too, naming a scheduler policy that continues every later turn on
D (DECISION_LOCAL: D serves it from its own prefix cache; see "Continuing on D" below); ``ideal`` runs the same
conversation on one worker with prefix caching; ``direct`` is a minimal P→D client without registry or scheduler, the
baseline for the control plane's own cost;
``smg`` (not in the default set) starts SMG (PyPI ``smg``, installed into ``.smg/`` by ``make install``) in front of
the same P and D workers and replays the same conversations through it (``services/devtools/bench/smg.py``): the
report then gives kvshuttle ÷ SMG (pull p50 ÷ smg p50) per history bucket.

The conversations are agentic (``services/devtools/bench/workload.py``): every request carries the session's tools,
every turn but the last ends with a tool call that ``tool_choice`` forces (the test models call no tools on their
own), and the next turn answers it with ``tool`` messages. So the stack runs the gateway with ``--tool-call-parser
hermes`` and, by default, the ``tiny-tools`` test model (the tiny model with a chat template that renders tools and
hermes calls); a model given with ``--model-dir`` needs such a template too (Qwen 2.5/3 have one).

P's own prefix cache: with ``--prefill-cache cold`` (default) the prefill workers run without prefix caching, as a
busy prefill fleet effectively does: a session's history is never in P's cache, so a turn either pulls it or
recomputes it. ``warm`` leaves vLLM's default (P keeps what it computed; pulls then fetch only what P lacks); every
mode's system prompt is then tagged with the mode's name (as ``bench-policies`` does), so no mode finds the turn that
another mode ran a moment before in P's cache; the modes' answers are then not compared.

Continuing on D (the ``local`` mode). The bench's own stack gets a named scheduler policy for it
(:func:`local_policy_spec`: the cost policy with ``continue_on_decode=always`` and a decode inter-token SLO of
:data:`LOCAL_ITL_SLO_MS`, so high that the scheduler never declines to continue on D for the SLO's sake: the mode
measures the local path itself, also where a production policy would not take it, and the report prices what it costs
D's other streams). With ``--gateway-url`` the user names such a policy (``--local-policy``). Either way a two-turn
check session first proves that the gateway knows the policy and continues a turn on D with it.

Each gateway mode (pull, recompute, local) runs as a tenant of its own: the bench's own gateway gets an API keys file
with a key per mode (:func:`bench_keys`; with ``--gateway-url``: ``--api-key``, and ``--local-api-key`` for the local
mode). A tenant has its own prefix-cache salt, on D as on P, so no mode's turn is served from the blocks another
mode's run of the same prompt (the modes send the same prompts) left in D's prefix cache a moment before: a turn
continued on D finds its own session's history there and nothing more, and what D reads back from P on a pull or a
recompute is that turn's own. The pull mode's default policy never continues on D (a cost default policy gets
``continue_on_decode=never``), so the pull mode still measures pulls. At concurrency 1, D's own vLLM counters are read
around each turn: how many prompt tokens D read back from P (P → D) and found in its own prefix cache.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import json
import logging
import os
import re
import secrets
import shutil
import signal
import time
import uuid
from collections.abc import Awaitable, Callable, Mapping, Sequence
from pathlib import Path

import httpx
from kvshuttle.services.common.config import load, require, require_effect, setting
from kvshuttle.services.devtools.bench import lanes as lanes_mod
from kvshuttle.services.devtools.bench import local_report
from kvshuttle.services.devtools.bench import smg as smg_mod
from kvshuttle.services.devtools.bench.overhead import DIRECT, control_plane_overhead, format_overhead
from kvshuttle.services.devtools.bench.report import build_report, format_table, write_outputs
from kvshuttle.services.devtools.bench.samples import IDEAL, LOCAL, PULL, RECOMPUTE, SMG, TurnSample, TurnStream
from kvshuttle.services.devtools.bench.workload import (
    CALL_MIN_TOKENS,
    SPREADS,
    Conversation,
    agentic_conversations,
    load_conversations,
)
from kvshuttle.services.devtools.stack import MODEL_VARIANTS, Stack, StackConfig, model_unbuildable

log = logging.getLogger("kvshuttle.bench")
ALL_MODES = (PULL, RECOMPUTE, LOCAL, IDEAL, DIRECT)  # the default set
KNOWN_MODES = (*ALL_MODES, SMG)
NO_PREFIX_CACHING = "--no-enable-prefix-caching"
LOCAL_POLICY = "bench-local"  # the local mode's policy on the bench's own stack (--local-policy renames it)
# The local policy's decode inter-token SLO (ms): a policy never continues a turn on D when the prefill would delay
# each of D's streams by more than this. So high that the local mode always continues on D where it can: it measures
# the local path itself; what that costs D's streams is measured too (the report's inter-token delays).
LOCAL_ITL_SLO_MS = 60000.0
GATEWAY_MODES = (PULL, RECOMPUTE, LOCAL)  # the modes that go through the gateway, each as a tenant of its own
_POLICY_NAME = re.compile(r"^[A-Za-z0-9_-]+$")


@dataclasses.dataclass
class BenchConfig(StackConfig):
    """The multi-turn benchmark; the local stack's settings apply when it starts the stack itself."""

    ENV_PREFIX = "KVSHUTTLE_BENCH_"
    gateway_url: str = setting("", "Drive this running gateway (e.g. http://10.0.0.5:8000) instead of starting the "
                                   "local stack")
    ideal_address: str = setting("", "With --gateway-url: gRPC address of a colocated vLLM worker (no KV connector) "
                                     "for the ideal mode; empty: no ideal mode")
    modes: str = setting(",".join(ALL_MODES), "Modes to measure, comma-separated: pull, recompute, local (later "
                                              "turns continued on D), ideal, direct, smg (SMG in front of the same "
                                              "workers; installed by make install)")
    local_policy: str = setting("", f"The local mode's scheduler policy (the requests' policy): one that continues "
                                    f"every later turn on D whenever it can. The bench's own stack: added to its "
                                    f"scheduler under this name (empty: {LOCAL_POLICY}) as the cost policy with "
                                    f"continue_on_decode=always and decode_itl_slo_ms={LOCAL_ITL_SLO_MS:g}; with "
                                    f"--gateway-url: required, a policy of that stack's scheduler")
    local_api_key: str = setting("", "With --gateway-url: the local mode's API key, of a tenant no other mode uses "
                                     "(its own prefix-cache salt, so it never hits the blocks the other modes leave "
                                     "on D); empty: the --api-key's tenant (the report counts the local turns whose "
                                     "cache hit on D exceeded their own history)")
    api_key: str = setting("", "With --gateway-url: the API key the gateway modes send (admin rights: the bench lists "
                           "the workers); empty: none (an open gateway). The bench's own stack makes a key per "
                           "gateway mode, each of a tenant of its own")
    new_buckets: str = setting(",".join(map(str, local_report.DEFAULT_NEW_BUCKETS)),
                               "The local mode's table by new tokens per turn (prompt - previous prompt and answer): "
                               "bucket edges in tokens")
    conversations: int = setting(4, "Agentic conversations to generate")
    concurrency: int = setting(1, "Conversations in flight at once (each runs its modes turn by turn)")
    seed: int = setting(0, "Workload seed")
    max_history_tokens: int = setting(6000, "Grow each conversation up to about this many tokens (GPU: 24000+)")
    system_tokens: int = setting(1000, "System prompt size, the tool definitions included (tokens, estimated)")
    turn_tokens_min: int = setting(150, "Smallest turn: the tool result, or the first turn's task, plus any user "
                                        "text (tokens, estimated)")
    turn_tokens_max: int = setting(600, "Largest turn (tokens, estimated)")
    turn_tokens_spread: str = setting("uniform", "How turn sizes spread between the smallest and the largest: uniform, "
                                                 "or log (log-uniform: as many turns of 100-1k tokens as of 1k-10k; "
                                                 "small and large new parts in one run, e.g. for the local mode's "
                                                 "table by new tokens)", choices=SPREADS)
    max_turns: int = setting(64, "At most this many turns per conversation")
    max_tokens: int = setting(32, f"Tokens generated per turn (conversation files: at most this); a forced tool "
                                  f"call may take up to {CALL_MIN_TOKENS} (it ends where the call ends)")
    call_arguments: str = setting("empty", "Arguments of the forced tool calls: empty (a logit bias on { and } closes "
                                           "them at once: the only call a random test model writes whose echo renders "
                                           "back exactly) or model (the model writes them: for real models)",
                                  choices=("empty", "model"))
    conversation_file: str = setting("", "Replay these conversations (OpenAI messages JSON, vLLM multi-turn format; "
                                         "tool calls and tool messages too) instead of generating them")
    buckets: str = setting("0,1000,2000,3000,4500,6000", "History-length bucket edges in tokens")
    headline_min_history: int = setting(3000, "The headline ratios cover turns with at least this much history")
    prefill_cache: str = setting("cold", "P's own prefix cache: cold (P runs without one: every turn pulls or "
                                         "recomputes the history) or warm (vLLM's default)", choices=("cold", "warm"))
    ideal_cpus: str = setting("", "CPUs for the ideal worker (default: the first prefill worker's)")
    out_dir: str = setting("var/bench", "Results go to <out-dir>/<timestamp>/")
    progress: bool = setting(True, "Show a progress bar")
    turn_timeout_s: float = setting(600.0, "Deadline of one turn")
    # Stack settings with other defaults for a benchmark run (a model whose chat template renders tools and tool
    # calls, and the parser that reads them).
    model_dir: str = setting("", "Model directory (default: var/models/<model variant>); built with make-model if "
                                 "missing (a chat template that renders tools and hermes tool calls, or see --tools)",
                             env="KVSHUTTLE_MODEL_DIR")
    model_variant: str = setting("tiny-tools", "Variant to build when the model is missing (tiny-tools: the tiny "
                                               "model with a chat template for tools; smollm2: a real instruct model, "
                                               "whose template renders no tools, so --tools auto replays plain chats)",
                                 choices=MODEL_VARIANTS)
    tools: str = setting("auto", "The conversations' tools and forced tool calls: on; off (plain chats: the tools in "
                                 "the system prompt, each tool result in the user's message, as the soak replays "
                                 "them); auto: off when the model's chat template cannot render tools and hermes "
                                 "calls (e.g. smollm2's), else on", choices=("auto", "on", "off"))
    tool_call_parser: str = setting("hermes", "The gateway's --tool-call-parser: the bench forces its tool calls in "
                                              "hermes syntax", choices=("hermes",))
    reasoning_parser: str = setting("", "The gateway's --reasoning-parser: none for the bench (its forced tool calls "
                                        "start at the answer's first token, as in the direct and ideal modes)")
    work_dir: str = setting("var/bench/stack", "Logs and worker caches of the stack the benchmark starts")
    http_port: int = setting(0, "Gateway HTTP port of the started stack (0: any free port)")
    grpc_port: int = setting(0, "Gateway gRPC port of the started stack (0: any free port)")
    decoder_kv_blocks_ttl: int = setting(120, "Seconds a decode worker keeps a finished turn's blocks (turns that "
                                              "are never pulled, e.g. the recompute and smg modes', hold D's memory "
                                              "that long)")
    smg_bin: str = setting(smg_mod.DEFAULT_SMG_BIN, f"The smg mode's executable (relative: from the current directory; "
                                                    f"make install puts smg=={smg_mod.SMG_VERSION} there)")
    smg_silence_s: int = setting(60, "The smg mode: SMG's --worker-wedge-secs, how long it waits on a silent prefill "
                                     "or decode leg before it gives up (its default, 3 s, is shorter than a cold long "
                                     "prefill on 2 CPU cores)")
    smg_extra_args: str = setting("", "The smg mode: more `smg launch` arguments (shell-quoted)")

    @property
    def mode_list(self) -> list[str]:
        return [m.strip() for m in self.modes.split(",") if m.strip()]

    @property
    def bucket_edges(self) -> list[int]:
        return [int(x) for x in self.buckets.split(",") if x.strip()]

    @property
    def new_bucket_edges(self) -> list[int]:
        return [int(x) for x in self.new_buckets.split(",") if x.strip()]

    @property
    def local_policy_name(self) -> str:
        return self.local_policy or LOCAL_POLICY

    def validate(self) -> None:
        super().validate()
        modes = self.mode_list
        require(bool(modes) and all(m in KNOWN_MODES for m in modes) and len(set(modes)) == len(modes),
                f"--modes must be distinct names among {', '.join(KNOWN_MODES)}")
        if SMG in modes:
            require(self.smg_silence_s >= 1, "--smg-silence-s must be >= 1")
            try:
                smg_mod.smg_binary(self.smg_bin)
            except smg_mod.SmgMissing as exc:
                require(False, f"--modes {SMG}: {exc}")
        require(self.conversations >= 1 and self.concurrency >= 1, "--conversations and --concurrency must be >= 1")
        require(0 < self.turn_tokens_min <= self.turn_tokens_max, "need 0 < --turn-tokens-min <= --turn-tokens-max")
        require(self.max_tokens >= 1 and self.max_turns >= 1, "--max-tokens and --max-turns must be >= 1")
        try:
            edges = self.bucket_edges
        except ValueError:
            edges = []
        require(bool(edges) and edges == sorted(set(edges)), "--buckets must be increasing integers, e.g. 0,1000,2000")
        try:
            new_edges = self.new_bucket_edges
        except ValueError:
            new_edges = []
        require(bool(new_edges) and new_edges == sorted(set(new_edges)) and new_edges[0] >= 0,
                "--new-buckets must be increasing integers, e.g. 0,256,1024,4096")
        require(not self.local_policy or bool(_POLICY_NAME.match(self.local_policy)),
                "--local-policy: a scheduler policy name (letters, digits, - and _)")
        require(not self.conversation_file or Path(self.conversation_file).is_file(),
                f"--conversation-file {self.conversation_file!r} does not exist")
        require(bool(self.gateway_url) or not self.reasoning_parser,
                "the bench forces tool calls from the answer's first token, as its direct and ideal modes do: run "
                "the stack without --reasoning-parser")
        self.validate_effects(modes)

    def validate_effects(self, modes: Sequence[str]) -> None:
        """Settings another one makes a no-op, when given: an error naming both flags."""
        # with --gateway-url the stack is not started (the tool-call parser, work dir and start-up timeout are also
        # the smg mode's; P's prefix cache also tags the lanes' prompts)
        self.require_stack_started(self.gateway_url, keep=("tool_call_parser",))
        require_effect(self, "ideal_address", bool(self.gateway_url),
                       "without --gateway-url (the bench starts its own ideal worker)")
        require_effect(self, "ideal_address", IDEAL in modes, f"without {IDEAL} in --modes")
        require_effect(self, "ideal_cpus", IDEAL in modes, f"without {IDEAL} in --modes")
        require_effect(self, "ideal_cpus", not self.gateway_url,
                       "with --gateway-url (the ideal worker is then --ideal-address's, not started here)")
        for name in ("smg_bin", "smg_silence_s", "smg_extra_args"):
            require_effect(self, name, SMG in modes, f"without {SMG} in --modes")
        for name in ("local_policy", "local_api_key", "new_buckets"):
            require_effect(self, name, LOCAL in modes, f"without {LOCAL} in --modes")
        for name in ("local_api_key", "api_key"):
            require_effect(self, name, bool(self.gateway_url),
                           "without --gateway-url (the bench's own stack gets keys the bench makes)")
        for name in ("seed", "max_history_tokens", "system_tokens", "turn_tokens_min", "turn_tokens_max",
                     "turn_tokens_spread"):
            require_effect(self, name, not self.conversation_file,
                           "with --conversation-file (it shapes generated conversations; the file's are replayed)")


def local_policy_spec(name: str = LOCAL_POLICY) -> str:
    """The local mode's scheduler policy, in the scheduler's --policies syntax: the cost policy continuing every turn
    that could pull on D, whatever its predicted price to D's streams (up to :data:`LOCAL_ITL_SLO_MS` per token)."""
    return f"{name}=cost:continue_on_decode=always,decode_itl_slo_ms={LOCAL_ITL_SLO_MS:g}"


def scheduler_env(modes: Sequence[str], local_policy: str, environ: Mapping[str, str]) -> dict[str, str]:
    """The bench's own scheduler's settings on top of ``environ`` (which it inherits): the local mode's policy added
    to the named policies; and the default policy, when it is the cost policy (the scheduler's default) with no
    word on continuing on D, kept from continuing turns on D, so that the pull mode measures pulls."""
    env: dict[str, str] = {}
    if LOCAL in modes:
        spec, given = local_policy_spec(local_policy), environ.get("KVSHUTTLE_SCHEDULER_POLICIES", "").strip()
        env["KVSHUTTLE_SCHEDULER_POLICIES"] = f"{given.rstrip(';')}; {spec}" if given else spec
    params = environ.get("KVSHUTTLE_SCHEDULER_POLICY_PARAMS", "").strip()
    if (environ.get("KVSHUTTLE_SCHEDULER_POLICY") or "cost") == "cost" and "continue_on_decode" not in params:
        env["KVSHUTTLE_SCHEDULER_POLICY_PARAMS"] = f"{params},continue_on_decode=never" if params else \
            "continue_on_decode=never"
    return env


def bench_keys(path: Path, modes: Sequence[str]) -> dict[str, str]:
    """An API keys file for the bench's own gateway, written to ``path``: a key per gateway mode of ``modes``, each of
    a tenant of its own (``bench-<mode>``: its own prefix-cache salt), with admin rights (the bench lists the workers
    with one). Returns the keys by mode (none, and no file, without a gateway mode)."""
    from kvshuttle.services.gateway.edge.auth import entry

    keys = {m: f"kvs-bench-{m}-{secrets.token_hex(16)}" for m in modes if m in GATEWAY_MODES}
    if keys:
        path.parent.mkdir(parents=True, exist_ok=True)
        with os.fdopen(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w") as f:
            json.dump({"keys": [entry(k, f"bench-{m}", admin=True, name=f"bench {m} mode") for m, k in keys.items()]},
                      f)
        path.chmod(0o600)  # also when the file was there
    return keys


def _auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"} if key else {}


async def check_local_policy(client: httpx.AsyncClient, policy: str, run_id: str) -> dict:
    """Two short turns in a session of their own, the second naming ``policy``: refuse a policy the gateway does not
    know, or one that does not continue that turn on D (SystemExit, naming why). Returns that turn's kvshuttle
    figures. It also warms up D's local path before the measured turns."""
    session = f"bench-{run_id}-local-check"
    messages: list[dict] = [{"role": "user", "content": "Check that a later turn continues on D. " * 40}]
    body = {"max_tokens": 2, "temperature": 0}
    first = await client.post("/v1/chat/completions", headers={"X-Session-ID": session},
                              json={**body, "messages": messages})
    first.raise_for_status()
    messages += [first.json()["choices"][0]["message"], {"role": "user", "content": "And now? " * 30}]
    second = await client.post("/v1/chat/completions", headers={"X-Session-ID": session},
                               json={**body, "messages": messages, "policy": policy})
    await client.delete(f"/v1/sessions/{session}")
    if second.status_code != 200:
        raise SystemExit(f"kvshuttle bench: --local-policy {policy}: the gateway refused a turn naming it "
                         f"({second.status_code}: {second.text[:300]})")
    kv = second.json()["kvshuttle"]
    if kv["decision"] != LOCAL:
        raise SystemExit(f"kvshuttle bench: the local mode's policy {policy} did not continue a later turn on D: "
                         f"decision {kv['decision']} ({kv['reason_code']}: {kv['reason']}). It needs a policy that "
                         f"continues on D whenever it can, e.g. '{local_policy_spec(policy)}' in the scheduler's "
                         f"--policies")
    return kv


def workload(cfg: BenchConfig) -> list[Conversation]:
    if cfg.conversation_file:
        return load_conversations(cfg.conversation_file, max_tokens=cfg.max_tokens, max_turns=cfg.max_turns,
                                  limit=cfg.conversations)
    return agentic_conversations(count=cfg.conversations, seed=cfg.seed, max_history_tokens=cfg.max_history_tokens,
                                 system_tokens=cfg.system_tokens,
                                 turn_tokens=(cfg.turn_tokens_min, cfg.turn_tokens_max), max_tokens=cfg.max_tokens,
                                 max_turns=cfg.max_turns, spread=cfg.turn_tokens_spread)


def plain_if_needed(conversations: list[Conversation], tokenizer, tools: str) -> list[Conversation]:
    """The conversations as replayed under ``--tools``: with ``off``, or ``auto`` and a chat template that cannot
    render them, as plain chats (Conversation.plain)."""
    with_tools = next((c.tools for c in conversations if c.tools), None)
    if not with_tools or tools == "on":
        return conversations
    if tools == "auto":
        try:
            lanes_mod.check_template(tokenizer, with_tools)
            return conversations
        except ValueError as exc:
            log.info("replaying plain chats (--tools auto): %s", exc)
    return [c.plain() for c in conversations]


@dataclasses.dataclass
class Outcome:
    samples: list[TurnSample]
    timings: dict[tuple[str, int], dict[str, float]]  # the gateway's timers of each pull turn
    failures: list[str]
    streams: list[TurnStream] = dataclasses.field(default_factory=list)  # when each turn's tokens arrived


Counters = Callable[[], Awaitable[dict[str, float]]]


def decode_delta(sample: TurnSample, before: dict[str, float], after: dict[str, float]) -> None:
    """D's counters around one turn (nothing else running): what D read from P over NIXL and took from its own
    prefix cache (a turn continued on D keeps the cache hit its answer reported)."""
    read = after.get("external_kv_transfer", 0.0) - before.get("external_kv_transfer", 0.0)
    hit = after.get("local_cache_hit", 0.0) - before.get("local_cache_hit", 0.0)
    sample.decode_read_tokens = round(read)
    if sample.decode_cached_tokens < 0:
        sample.decode_cached_tokens = round(hit)


async def drive(conversations: list[Conversation], make_lanes, modes: list[str], *, concurrency: int,
                progress: bool, turn_timeout_s: float, decode_counters: Counters | None = None) -> Outcome:
    """Replay every conversation in every mode: turn k in all modes (order rotating), then turn k+1.
    ``decode_counters`` (only with one turn in flight at a time): D's vLLM prompt-token counters, read around every
    turn but the ideal worker's (decode_delta)."""
    from tqdm import tqdm

    if decode_counters is not None and concurrency != 1:
        raise ValueError("D's counters tell one turn's tokens only when no other turn runs: concurrency 1")
    out = Outcome([], {}, [])
    bar = tqdm(total=sum(len(c.turns) for c in conversations) * len(modes), unit="turn", disable=not progress,
               desc="bench", dynamic_ncols=True)
    gate = asyncio.Semaphore(concurrency)

    async def replay(index: int, conv: Conversation) -> None:
        async with gate:
            lanes = make_lanes(conv)
            try:
                for t, turn in enumerate(conv.turns):
                    shift = (t + index) % len(modes)
                    for mode in modes[shift:] + modes[:shift]:
                        counted = decode_counters is not None and mode != IDEAL
                        before = await decode_counters() if counted else {}
                        sample = await asyncio.wait_for(lanes[mode].turn(turn), turn_timeout_s)
                        if counted:
                            decode_delta(sample, before, await decode_counters())
                        stream = getattr(lanes[mode], "last_stream", None)
                        if stream is not None:
                            out.streams.append(stream)
                            lanes[mode].last_stream = None
                        out.samples.append(sample)
                        if mode == PULL:
                            out.timings[(conv.id, sample.turn)] = lanes[mode].last_timings
                        bar.update(1)
                        bar.set_postfix_str(f"{mode} {sample.prompt_tokens} tok {sample.ttft_ms:.0f} ms", refresh=False)
            except Exception as exc:  # one conversation's failure is reported, the others go on
                log.error("conversation %s failed: %s: %s", conv.id, type(exc).__name__, exc)
                out.failures.append(f"{conv.id}: {type(exc).__name__}: {exc}")
            finally:
                for lane in lanes.values():
                    try:
                        await lane.close()
                    except Exception as exc:  # cleanup only
                        log.debug("closing a lane: %s", exc)

    try:
        await asyncio.gather(*(replay(i, c) for i, c in enumerate(conversations)))
    finally:
        bar.close()
    return out


async def _workers(client: httpx.AsyncClient) -> tuple[list[dict], list[dict]]:
    """The prefill and the decode workers the gateway lists (at least one of each)."""
    resp = await client.get("/v1/workers")
    resp.raise_for_status()
    workers = resp.json().get("workers", [])
    prefill = [w for w in workers if w.get("role") == "WORKER_ROLE_PREFILL"]
    decode = [w for w in workers if w.get("role") == "WORKER_ROLE_DECODE"]
    if not prefill or not decode:
        raise RuntimeError(f"the gateway lists no prefill or no decode worker: {workers}")
    return prefill, decode


def lane_system(system: str | None, mode: str, prefill_cache: str) -> str | None:
    """A conversation's system prompt in one mode: with P's cache warm, tagged with the mode's name, so that no mode
    finds in P's cache the turn another mode ran a moment before (the modes run each turn one after the other)."""
    if prefill_cache != "warm":
        return system
    return f"[{mode} lane] {system or ''}"


def _token_usage(loads: dict) -> tuple[float, float]:
    """(used, total) KV tokens of a worker from its GetLoads answer, summed over its ranks."""
    used = total = 0.0
    for rank in loads.get("loads") or []:
        used += float(rank.get("num_used_tokens") or 0)
        total += float(rank.get("max_total_num_tokens") or 0)
    return used, total


async def run_bench(cfg: BenchConfig) -> int:
    from kvshuttle.services.devtools.bench.ideal_worker import IdealWorker
    from kvshuttle.services.engine.client import EngineClient
    from kvshuttle.services.gateway.tokens.tokenizer import GatewayTokenizer

    modes = cfg.mode_list
    conversations = await asyncio.to_thread(workload, cfg)  # reads files
    run_id = uuid.uuid4().hex[:6]
    out_dir = Path(cfg.out_dir) / time.strftime("%Y%m%d-%H%M%S")
    started = time.time()
    if cfg.prefill_cache == "cold" and NO_PREFIX_CACHING not in cfg.prefill_extra_args:
        cfg.prefill_extra_args = f"{cfg.prefill_extra_args} {NO_PREFIX_CACHING}".strip()
    # A tenant per gateway mode (see the module docstring); with --gateway-url, the user's keys.
    if cfg.gateway_url:
        keys = {m: (cfg.local_api_key or cfg.api_key) if m == LOCAL else cfg.api_key for m in modes
                if m in GATEWAY_MODES}
        admin_key = cfg.api_key
    else:
        keys_file = Path(cfg.work_dir).resolve() / "bench-keys.json"
        keys = bench_keys(keys_file, modes)
        admin_key = next(iter(keys.values()), "")
    stack = None
    if not cfg.gateway_url:
        stack = Stack(cfg, scheduler_env=scheduler_env(modes, cfg.local_policy_name, os.environ),
                      gateway_env={"KVSHUTTLE_GATEWAY_API_KEYS_FILE": str(keys_file)} if keys else None,
                      api_key=admin_key)
    ideal = None
    smg: smg_mod.SmgRouter | None = None
    smg_client: httpx.AsyncClient | None = None
    smg_lanes: list[smg_mod.SmgLane] = []
    d_usage: tuple[float, float] | None = None
    engines: list[EngineClient] = []
    counters_before: dict[str, float] = {}
    decode_before: dict[str, float] = {}
    decode_counters: dict[str, float] = {}
    own_clients: list[httpx.AsyncClient] = []  # the gateway modes' clients with keys of their own
    local_check: dict = {}
    try:
        jobs = []
        if LOCAL in modes and stack is None and not cfg.local_policy:
            raise SystemExit("--modes includes local with --gateway-url: give --local-policy, the name of a policy of "
                             "that stack's scheduler that continues on D whenever it can (its --policies, e.g. "
                             f"'{local_policy_spec('on-d')}'), or leave local out of --modes")
        if stack is not None:
            await stack.ensure_model()
        model_dir = stack.model_dir if stack is not None else Path(cfg.model_dir)
        tokenizer = await asyncio.to_thread(GatewayTokenizer, model_dir)
        conversations = plain_if_needed(conversations, tokenizer, cfg.tools)
        tools = next((c.tools for c in conversations if c.tools), None)
        if tools:
            try:
                lanes_mod.check_template(tokenizer, tools)
            except ValueError as exc:
                raise SystemExit(f"kvshuttle bench: {exc}") from None
        call_bias = lanes_mod.forced_call_bias(tokenizer) if cfg.call_arguments == "empty" else {}
        if stack is not None:
            jobs.append(stack.start())
        if IDEAL in modes and not cfg.ideal_address:
            if stack is None:
                raise SystemExit("--modes includes ideal with --gateway-url: give --ideal-address too")
            ideal = IdealWorker(cfg, Path(cfg.work_dir).resolve() / "workers" / "ideal")
            jobs.append(ideal.start(cfg.startup_timeout_s))
        await asyncio.gather(*jobs)
        base_url = stack.base_url if stack is not None else cfg.gateway_url.rstrip("/")
        async with httpx.AsyncClient(base_url=base_url, timeout=cfg.turn_timeout_s, headers=_auth(admin_key),
                                     limits=httpx.Limits(max_connections=4 * cfg.concurrency + 4)) as client:
            p_infos, d_infos = await _workers(client)
            clients = {}  # per gateway mode
            for mode, key in keys.items():
                if key == admin_key:
                    clients[mode] = client
                else:
                    clients[mode] = httpx.AsyncClient(base_url=base_url, timeout=cfg.turn_timeout_s, headers=_auth(key),
                                                      limits=httpx.Limits(max_connections=2 * cfg.concurrency + 2))
                    own_clients.append(clients[mode])
            if LOCAL in modes:
                if cfg.gateway_url and not cfg.local_api_key:
                    log.warning("the local mode shares its tenant with the other gateway modes (no --local-api-key): "
                                "D's prefix cache may serve its turns from another mode's run of the same prompt "
                                "(the report counts the turns whose hit exceeded their own history)")
                local_check = await check_local_policy(clients[LOCAL], cfg.local_policy_name, run_id)
                log.info("the local mode's policy %s continued a check turn on D (%s)", cfg.local_policy_name,
                         local_check.get("reason_code"))
            p_engine, d_engine = EngineClient(p_infos[0]["grpcAddress"]), EngineClient(d_infos[0]["grpcAddress"])
            ideal_engine = EngineClient(ideal.address if ideal else cfg.ideal_address) if IDEAL in modes else None
            engines = [e for e in (p_engine, d_engine, ideal_engine) if e is not None]
            block_size = (await d_engine.server_info()).block_size
            if SMG in modes:  # in front of every P and D the gateway lists
                smg = smg_mod.SmgRouter(smg_mod.smg_binary(cfg.smg_bin),
                                        prefill=[w["grpcAddress"] for w in p_infos],
                                        decode=[w["grpcAddress"] for w in d_infos], model_dir=model_dir,
                                        log_path=Path(cfg.work_dir).resolve() / "logs" / "smg.log",
                                        tool_call_parser=cfg.tool_call_parser, silence_s=cfg.smg_silence_s,
                                        extra_args=cfg.smg_extra_args)
                await smg.start(cfg.startup_timeout_s)
                smg_client = httpx.AsyncClient(base_url=smg.base_url, timeout=cfg.turn_timeout_s,
                                               limits=httpx.Limits(max_connections=4 * cfg.concurrency + 4))

            def make_lanes(conv: Conversation) -> dict:
                made = {}
                for mode in modes:
                    system = lane_system(conv.system, mode, cfg.prefill_cache)
                    if mode in (PULL, RECOMPUTE):
                        made[mode] = lanes_mod.GatewayLane(clients[mode], mode, conv.id, system, run_id,
                                                           tools=conv.tools, call_bias=call_bias)
                    elif mode == LOCAL:
                        made[mode] = lanes_mod.GatewayLane(clients[mode], mode, conv.id, system, run_id,
                                                           disable_pull=False, policy=cfg.local_policy_name,
                                                           tools=conv.tools, call_bias=call_bias)
                    elif mode == IDEAL:
                        made[mode] = lanes_mod.IdealLane(ideal_engine, tokenizer, conv.id, system, conv.tools,
                                                         call_bias)
                    elif mode == SMG:
                        made[mode] = smg_mod.SmgLane(smg_client, smg.model, conv.id, system, conv.tools, call_bias)
                        smg_lanes.append(made[mode])
                    else:
                        made[mode] = lanes_mod.DirectLane(p_engine, d_engine, block_size, tokenizer, conv.id,
                                                          system, conv.tools, call_bias,
                                                          decode_worker=d_infos[0].get("workerId", ""))
                return made

            calls = lanes_mod.forced_calls(conversations)
            if calls:
                t = time.perf_counter()
                await lanes_mod.warm_up_forced_calls(calls, call_bias, client=client, engine=ideal_engine,
                                                     tokenizer=tokenizer)
                log.info("forced tool calls (%d grammars) warmed up on D%s in %.1f s", len(calls),
                         " and the ideal worker" if ideal_engine else "", time.perf_counter() - t)
            if smg_client is not None:
                t = time.perf_counter()
                await smg_mod.warm_up_smg(smg_client, smg.model, calls, call_bias)
                log.info("smg warmed up (%d forced calls) in %.1f s", len(calls), time.perf_counter() - t)
            read_decode: Counters | None = None  # D's own counters (its Prometheus files; the stack's workers)
            if stack is not None:
                counters_before = await asyncio.to_thread(stack.prefill_prompt_tokens_by_source)
                decode_ids = [w["workerId"] for w in d_infos if w.get("workerId")]
                read_decode = functools.partial(asyncio.to_thread, stack.prefill_prompt_tokens_by_source, decode_ids)
                decode_before = await read_decode()
            print(f"kvshuttle bench: {len(conversations)} conversations, "
                  f"{sum(len(c.turns) for c in conversations)} turns in all "
                  f"({sum(1 for c in conversations for t in c.turns if t.call)} forced tool calls), each in "
                  f"{', '.join(modes)}; concurrency {cfg.concurrency}; gateway {base_url}"
                  + (f"; smg {smg.base_url}" if smg else ""), flush=True)
            outcome = await drive(conversations, make_lanes, modes, concurrency=cfg.concurrency,
                                  progress=cfg.progress, turn_timeout_s=cfg.turn_timeout_s,
                                  decode_counters=read_decode if cfg.concurrency == 1 else None)
            counters = {}
            if stack is not None and read_decode is not None:  # the stack's worker counters, over the run
                after = await asyncio.to_thread(stack.prefill_prompt_tokens_by_source)
                counters = {k: after.get(k, 0.0) - counters_before.get(k, 0.0) for k in after}
                after = await read_decode()
                decode_counters = {k: after.get(k, 0.0) - decode_before.get(k, 0.0) for k in after}
            try:  # what the unpulled turns (recompute, smg) left pinned on D
                d_usage = _token_usage(await d_engine.get_loads())
            except Exception as exc:  # informational only
                log.debug("D's loads: %s", exc)
    finally:
        for own in own_clients:
            await own.aclose()
        if smg_client is not None:
            await smg_client.aclose()
        if smg is not None:
            await smg.stop()
        for engine in engines:
            await engine.close()
        if ideal is not None:
            await ideal.stop()
        if stack is not None:
            await stack.stop()

    meta = {
        "title": f"kvshuttle bench, P cache {cfg.prefill_cache}",
        "run_id": run_id, "started": time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(started)),
        "wall_s": round(time.time() - started, 1), "modes": modes, "conversations": len(conversations),
        "concurrency": cfg.concurrency, "seed": cfg.seed, "workload": cfg.conversation_file or "agentic",
        "tools": any(c.tools for c in conversations),
        "max_history_tokens": cfg.max_history_tokens, "max_tokens": cfg.max_tokens,
        "prefill_cache": cfg.prefill_cache, "model": str(cfg.model_dir), "dtype": cfg.dtype,
        "tool_calls": sum(1 for c in conversations for t in c.turns if t.call), "call_arguments": cfg.call_arguments,
        "machine": {"cpus": os.cpu_count(), "platform": os.uname().sysname + " " + os.uname().machine},
        "headline_min_history": cfg.headline_min_history, "failures": outcome.failures,
        "lane_prompts": "tagged" if cfg.prefill_cache == "warm" else "same",
    }
    if smg is not None:
        meta["smg"] = {"version": smg_mod.SMG_VERSION, "command": smg.argv,
                       "forced_calls": sum(lane.forced_calls for lane in smg_lanes),
                       "rewritten_calls": sum(lane.rewritten_calls for lane in smg_lanes)}
    if d_usage is not None:
        meta["decode_kv_tokens_after_run"] = {"used": d_usage[0], "total": d_usage[1]}
    meta["decode_read_measured"] = stack is not None and cfg.concurrency == 1
    if LOCAL in modes:
        meta.update({"local_policy": cfg.local_policy_name,
                     "local_policy_spec": "" if cfg.gateway_url else local_policy_spec(cfg.local_policy_name),
                     "local_tenant": "own" if not cfg.gateway_url or cfg.local_api_key else
                     "shared with the other gateway modes",
                     "local_check": {k: local_check.get(k) for k in ("decision", "reason_code", "computed_tokens")}})
    report = build_report(outcome.samples, buckets=cfg.bucket_edges, meta=meta, new_buckets=cfg.new_bucket_edges,
                          streams=outcome.streams)
    if PULL in modes and DIRECT in modes:
        report["control_plane_overhead"] = control_plane_overhead(outcome.samples, outcome.timings)
    pulled_reported = sum(s.pulled_tokens for s in outcome.samples if s.mode in (PULL, DIRECT))
    report["prefill_worker_counters"] = {"delta_by_source": counters, "pulled_tokens_reported": pulled_reported}
    if decode_counters:
        report["decode_worker_counters"] = {"delta_by_source": decode_counters}
    paths = write_outputs(report, outcome.samples, out_dir, streams=outcome.streams)

    print()
    print(format_table(report))
    if "control_plane_overhead" in report:
        print()
        print(format_overhead(report["control_plane_overhead"]))
    if counters:
        local_turns = sum(1 for s in outcome.samples if s.mode == LOCAL and s.decision == LOCAL)
        print(f"\nP's own counters over the run: {counters.get('external_kv_transfer', 0):.0f} tokens pulled over "
              f"NIXL (lanes reported {pulled_reported}), {counters.get('local_compute', 0):.0f} computed, "
              f"{counters.get('local_cache_hit', 0):.0f} from P's prefix cache"
              + (f" (beyond the lanes' pulls: the one-block reads that free each local turn's previous handle on D, "
                 f"{local_turns} local turns)" if local_turns else ""))
    if decode_counters:
        print(f"D's own counters over the run: {decode_counters.get('external_kv_transfer', 0):.0f} prompt tokens "
              f"read from P over NIXL, {decode_counters.get('local_cache_hit', 0):.0f} from D's prefix cache, "
              f"{decode_counters.get('local_compute', 0):.0f} computed on D")
    if d_usage is not None and d_usage[1]:
        print(f"D's KV cache after the measured turns: {d_usage[0]:.0f} of {d_usage[1]:.0f} tokens in use "
              f"({100 * d_usage[0] / d_usage[1]:.1f}%; unpulled turns stay pinned for --decoder-kv-blocks-ttl "
              f"{cfg.decoder_kv_blocks_ttl} s)")
    print(f"\nresults: {', '.join(str(p) for p in paths.values())}")
    if outcome.failures:
        print(f"{len(outcome.failures)} conversation(s) failed:\n  " + "\n  ".join(outcome.failures))
        return 1
    return 0


def main(argv: Sequence[str] | None = None) -> None:
    cfg = load(BenchConfig, argv, prog="kvshuttle bench")
    logging.basicConfig(level=cfg.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if not cfg.gateway_url and shutil.which("etcd") is None and not os.environ.get("KVSHUTTLE_ETCD_BIN"):
        raise SystemExit("etcd is not installed: run `make install` (installs Debian's etcd-server)")
    unbuildable = model_unbuildable(cfg)
    if unbuildable:
        raise SystemExit(f"kvshuttle bench: {unbuildable}")

    async def run() -> int:
        task = asyncio.current_task()
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, task.cancel)  # stop the stack, then exit
        return await run_bench(cfg)

    raise SystemExit(asyncio.run(run()))
