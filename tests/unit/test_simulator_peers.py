"""`kvshuttle simulate`'s peer deployments and the models they need, on scenarios small enough to work out by hand
(noise off): a prefill on a decode worker and what it does to the streams that worker decodes (Dynamo's conditional
disaggregation, the planner's LOCAL), a CPU tier of P's prefix cache (llm-d / LMCache), and the bytes each moves."""

from __future__ import annotations

import dataclasses
import math
import random

import pytest
from kvshuttle.control_plane.cost_model import PrefillPrior
from kvshuttle.control_plane.decision import Choice
from kvshuttle.services.common.config import ConfigError
from kvshuttle.services.devtools.simulator import report, strategies
from kvshuttle.services.devtools.simulator.cluster import (
    CpuTier,
    DecodePrefixCache,
    DecodeWorker,
    PrefillWorker,
    UnitChain,
)
from kvshuttle.services.devtools.simulator.engine import GIB, InFlight, Live, SimSettings, Simulation
from kvshuttle.services.devtools.simulator.hardware import profile
from kvshuttle.services.devtools.simulator.main import SimulateConfig
from kvshuttle.services.devtools.simulator.workload import SimSession, SimTurn

from tests.support.configs import parse_config

PROFILE = dataclasses.replace(profile("h200-32b-400g"), noise=0.0)
TPOT, KVB, UNIT = PROFILE.tpot_ms, PROFILE.kv_bytes_per_token, 256


def session(sid: str, start: float, first: int, turns: list[tuple[int, int, float]], out: int = 64) -> SimSession:
    """``turns``: (new tokens, output tokens, gap) of each later turn."""
    return SimSession(sid, "t0", start, [(10_000 + int(sid[1:]), first)],
                      [SimTurn(0, out, 0.0)] + [SimTurn(new, o, gap) for new, o, gap in turns])


def run(sessions, name, *, prefill_units=1000, prefill=1, decode=1, **settings):
    index: dict[int, set[str]] = {}
    ps = [PrefillWorker(f"p{i}", prefill_units, PROFILE.block_size, index) for i in range(prefill)]
    ds = [DecodeWorker(f"d{i}", PROFILE.decode_kv_tokens, PROFILE.block_size) for i in range(decode)]
    strategy = strategies.make(name, ps, ds, random.Random(0), candidates=4, unit=UNIT, prior=PrefillPrior(),
                               index=index)
    return Simulation(sessions, strategy, PROFILE, ps, ds, SimSettings(**settings)).run()


def row(res, sid_index: int, turn: int) -> int:
    cols = res.turns
    return next(i for i in range(len(cols)) if cols.session[i] == sid_index and cols.turn[i] == turn)


# -- a prefill on a decode worker ------------------------------------------------------------------------------------


def test_conditional_disagg_prefills_a_small_uncached_part_on_d_and_a_large_one_on_p():
    """Both sessions' first turns go through P (nothing cached on D: effective ISL = the prompt); D then caches each
    first prompt and answer. A second turn with 1,000 new tokens leaves ~1,064 uncached on D (< 4096, 12% of the
    prompt): D prefills it; one with 10,000 new tokens leaves 10,064 (>= 4096): P prefills it."""
    res = run([session("s0", 0.0, 8192, [(1000, 64, 1.0)]), session("s1", 0.5, 8192, [(10_000, 64, 1.0)])],
              "conditional_disagg")
    cols = res.turns
    small, large = row(res, 0, 1), row(res, 1, 1)
    assert [cols.local[row(res, s, 0)] for s in (0, 1)] == [0, 0]
    assert cols.local[small] == 1 and cols.prefill[small] == -1
    assert cols.d_cached[small] == 8192 and cols.computed[small] == 8192 + 64 + 1000 - 8192
    assert cols.local[large] == 0 and cols.prefill[large] == 0
    assert cols.codes == {strategies.REMOTE_PREFILL: 3, strategies.LOCAL_PREFILL: 1}
    # prefilled on D alone (nothing else decoding, k = 1 chunk): its compute plus the step its first token comes in
    computed = cols.computed[small]
    assert cols.ttft_ms[small] == pytest.approx(PROFILE.compute_ms(computed, 8192) + TPOT)
    # the large turn's hand-off sends D only what D's prefix cache lacks (vLLM's NixlConnector)
    assert cols.d_cached[large] == 8192
    sent = (8192 + 8192) + (8192 + 64 + 10_000 - 8192)  # the first turns' whole prompts, then the rest
    assert res.bytes_p_to_d == sent * KVB and res.bytes_d_to_p == 0


def test_the_bypass_rule_is_dynamos_strict_thresholds():
    ps = [PrefillWorker("p0", 100, 64, {})]
    d = DecodeWorker("d0", 100_000, 64, prefix=DecodePrefixCache())
    d.prefix.release([], list(range(32)))  # D caches units 0..31 (8,192 tokens)
    cd = strategies.ConditionalDisagg(ps, [d], random.Random(0), 4, UNIT)

    def routed(n: int, first_unit: int = 0) -> bool:
        return cd.route(("t", "s"), range(n), None, "", list(range(first_unit, first_unit + (n - 1) // UNIT))).local

    assert routed(8192 + 4095) and not routed(8192 + 4096)  # effective ISL below 4096, not at it
    assert routed(4000)  # a short prompt D holds all but its last 160 tokens of
    assert not routed(1000, first_unit=500)  # short but nothing of it on D: the ratio is 1 (a first turn: to P)
    cd.eff_isl_ratio_threshold = 0.3
    assert routed(8192 + 3000) and not routed(8192 + 4000)  # 3000/11192 = 27% < 30%; 4000/12192 = 33%


def _stream_and_local_prefill(with_b: bool):
    """A decodes 3,000 tokens on the only D; B's second turn (1,000 new tokens, D holds its first) is prefilled on
    that D while A decodes."""
    a = session("s0", 0.0, 2048, [], out=3000)
    b = session("s1", 1.0, 8192, [(1000, 64, 1.0)])
    return run([a, b] if with_b else [a], "conditional_disagg")


def test_a_prefill_on_d_delays_every_stream_it_decodes_by_the_step_time():
    alone, shared = _stream_and_local_prefill(False), _stream_and_local_prefill(True)
    b2 = row(shared, 1, 1)
    assert shared.turns.local[b2] == 1
    step = PROFILE.compute_ms(shared.turns.computed[b2], shared.turns.d_cached[b2])  # k = 1 chunk
    assert shared.decode_prefill_s * 1000 == pytest.approx(step)
    # A's answer ends exactly one prefill step later (A's decode steps stretched by it)
    assert (shared.ended - alone.ended) * 1000 == pytest.approx(step)
    # D's inter-token record: one step of tpot + the prefill's compute, served to the one stream decoding (A)
    steps = shared.itl["d0"]
    assert steps[round(TPOT + step, 2)] == pytest.approx(1.0)
    assert set(alone.itl["d0"]) == {round(TPOT, 2)}
    # over all steps: A's 2,999 gaps and B's 63 + 63, p99 still tpot; the slow one is the maximum
    assert report.weighted_percentile(steps, 99) == pytest.approx(TPOT)
    assert report.weighted_percentile(steps, 100) == pytest.approx(round(TPOT + step, 2))
    # A's longest gap between two tokens is that step; B's answers (decoded before and after) never saw one
    assert sorted(shared.stream_worst_ms) == pytest.approx([TPOT, TPOT, TPOT + step])
    assert list(alone.stream_worst_ms) == [TPOT]


def test_chunked_prefill_spreads_the_delay_over_ceil_new_over_c_steps():
    """C = 512: B's ~1,064 uncached tokens take 3 chunks; each of A's 3 stretched steps is tpot + T/3, A ends T
    later in all, and B's first token comes k·tpot + T after its prefill starts."""
    a = session("s0", 0.0, 2048, [], out=3000)
    b = session("s1", 1.0, 8192, [(1000, 64, 1.0)])
    res = run([a, b], "conditional_disagg", max_num_batched_tokens=512)
    alone = _stream_and_local_prefill(False)
    b2 = row(res, 1, 1)
    new = res.turns.computed[b2]
    k = math.ceil(new / 512)
    assert k == 3
    t = PROFILE.compute_ms(new, res.turns.d_cached[b2])
    assert res.itl["d0"][round(TPOT + t / k, 2)] == pytest.approx(k)
    assert (res.ended - alone.ended) * 1000 == pytest.approx(t)
    assert res.turns.ttft_ms[b2] == pytest.approx(k * TPOT + t)


def test_a_routed_local_choice_is_served_exactly_as_conditional_disaggs_prefill_on_d():
    """The hook for the planner's third choice: a Routed with Choice.LOCAL (and no local flag) takes the same
    engine path as conditional_disagg's bypass, turn for turn."""
    if strategies.LOCAL is None:
        pytest.skip("this control plane has no Choice.LOCAL yet")

    class AsLocal(strategies.ConditionalDisagg):
        name = "as_local"

        def route(self, *args):
            r = super().route(*args)
            if r.local:
                r.choice, r.local = strategies.LOCAL, False
            return r

    sessions = lambda: [session("s0", 0.0, 2048, [], out=3000), session("s1", 1.0, 8192, [(1000, 64, 1.0)]),  # noqa
                        session("s2", 1.5, 4096, [(500, 32, 0.5), (9000, 16, 0.5)])]
    reference = run(sessions(), "conditional_disagg")
    index: dict[int, set[str]] = {}
    ps = [PrefillWorker("p0", 1000, PROFILE.block_size, index)]
    ds = [DecodeWorker("d0", PROFILE.decode_kv_tokens, PROFILE.block_size)]
    hooked = Simulation(sessions(), AsLocal(ps, ds, random.Random(0), 4, UNIT), PROFILE, ps, ds, SimSettings()).run()
    for column in ("ttft_ms", "computed", "d_cached", "local", "prefill"):
        assert list(getattr(hooked.turns, column)) == list(getattr(reference.turns, column)), column
    assert sum(reference.turns.local) == 2
    assert hooked.itl == reference.itl and hooked.ended == reference.ended


def test_kvshuttle_serves_the_planners_local_plan_on_d_from_the_handle_it_holds():
    """The real planner with continue_on_decode=always: the second turn continues on the decode worker holding the
    session's handle (prompt + answer less its last token, 2,111 tokens: 2,048 in whole 64-token blocks), which
    computes the rest of the prompt inside its batch; the turn's new handle replaces the old one."""
    index: dict[int, set[str]] = {}
    ps = [PrefillWorker("p0", 1000, PROFILE.block_size, index)]
    ds = [DecodeWorker("d0", PROFILE.decode_kv_tokens, PROFILE.block_size)]
    strategy = strategies.make("kvshuttle", ps, ds, random.Random(0), candidates=4, unit=UNIT,
                               prior=PrefillPrior(), index=index)
    for policy in strategy.planner.policies.values():
        policy.continue_on_decode = "always"
    res = Simulation([session("s0", 0.0, 2048, [(512, 64, 1.0)])], strategy, PROFILE, ps, ds, SimSettings()).run()
    cols = res.turns
    assert list(cols.local) == [0, 1] and cols.codes.get("local_always") == 1
    n = 2048 + 64 + 512
    assert cols.d_cached[1] == 2048 and cols.computed[1] == n - 2048 and cols.pulled[1] == 0
    assert cols.ttft_ms[1] == pytest.approx(PROFILE.compute_ms(n - 2048, 2048) + TPOT)
    assert res.bytes_d_to_p == 0 and res.bytes_p_to_d == 2048 * KVB  # only the first turn's hand-off
    assert list(ds[0].held) == [("t0", "s0/1")]  # the new handle only: the old one became the turn's KV
    assert ds[0].held_tokens == math.ceil((n + 64 - 1) / 64) * 64
    assert ds[0].peak_tokens == 2688  # the turn's prompt + answer: the handle it took over is not counted twice


def test_without_prefills_on_d_every_decode_step_is_the_profiles():
    res = run([session("s0", 0.0, 2048, [(512, 100, 1.0)], out=50)], "cache_aware")
    assert res.itl["d0"] == {round(TPOT, 2): 49 + 99}
    summary = report.summarize(res, 2000.0)
    assert summary["itl_p50_ms"] == summary["itl_p99_ms"] == pytest.approx(TPOT)
    assert summary["local_share"] == 0.0


# -- a CPU tier of P's prefix cache ----------------------------------------------------------------------------------


def _evicted_then_back(name: str):
    """P's GPU cache holds 40 units. X's first prompt (32 units), then Y's (32 units) evicts X's 24 oldest; X's
    second turn comes back for them."""
    x = session("s0", 0.0, 8192, [(512, 64, 10.0)])
    y = session("s1", 1.0, 8192, [])
    return run([x, y], name, prefill_units=40)


def test_a_cpu_tier_hit_is_restored_instead_of_recomputed():
    res = _evicted_then_back("cache_aware_offload")
    cols = res.turns
    x2 = row(res, 0, 1)
    n = 8192 + 64 + 512
    assert cols.restored[x2] == 24 * UNIT and cols.cached[x2] == 8 * UNIT  # 24 units from the CPU tier, 8 on the GPU
    assert cols.computed[x2] == n - 32 * UNIT
    assert res.bytes_restored == 24 * UNIT * KVB and res.bytes_d_to_p == 0
    restore_ms = 24 * UNIT * KVB / 50e9 * 1000  # the default 50 GB/s
    computed = cols.computed[x2]
    sent = n - cols.d_cached[x2]  # D caches X's first turn: the hand-off sends the rest
    assert cols.d_cached[x2] == 32 * UNIT
    assert cols.ttft_ms[x2] == pytest.approx(PROFILE.compute_ms(computed, n - computed) + restore_ms
                                             + PROFILE.handoff_ms(sent) + TPOT)
    # without the tier the same P recomputes the evicted units
    plain = _evicted_then_back("cache_aware")
    assert plain.turns.computed[row(plain, 0, 1)] == n and sum(plain.turns.restored) == 0  # the prefix starts evicted
    summary = report.summarize(res, 2000.0)
    assert summary["kv_mb_restored_per_turn"] == pytest.approx(round(res.bytes_restored / len(cols) / 1e6, 1))


def test_the_cpu_tier_is_an_lru_of_what_the_gpu_evicted_and_sized_in_gib():
    index: dict[int, set[str]] = {}
    p = PrefillWorker("p0", 2, 64, {}, cpu=CpuTier("p0", 2, index))
    p.insert([1, 2, 3, 4])  # the GPU keeps 3, 4; 1 and 2 go to the tier
    assert list(p.cpu.units) == [1, 2] and index == {1: {"p0"}, 2: {"p0"}}
    p.insert([5])  # 3 evicted: the tier drops its oldest (1)
    assert list(p.cpu.units) == [2, 3] and 1 not in index
    assert p.cpu.take(2) and not p.cpu.take(2) and 2 not in index
    p.insert([3])  # computed again on the GPU: leaves the tier
    assert 3 not in p.cpu
    units = int(100 * GIB / KVB) // UNIT  # the default 100 GiB per node: 409,600 tokens of Qwen2.5-32B KV
    assert units * UNIT == 409_600


def test_peer_cpu_pull_loads_another_nodes_tier_over_the_network():
    """Two P: X's first turn and its eviction happen on one; with peer pulls a P that lacks X's units pulls them
    from that node's CPU tier (P->P bytes at the link rate) instead of computing them."""
    index: dict[int, set[str]] = {}
    ps = [PrefillWorker(f"p{i}", 40, PROFILE.block_size, index) for i in range(2)]
    ds = [DecodeWorker("d0", PROFILE.decode_kv_tokens, PROFILE.block_size)]
    strategy = strategies.make("cache_aware_offload", ps, ds, random.Random(0), candidates=4, unit=UNIT,
                               prior=PrefillPrior(), index=index)
    sim = Simulation([session("s0", 0.0, 4096, [])], strategy, PROFILE, ps, ds, SimSettings(peer_cpu_pull=True))
    sim.run()
    holder = next(p for p in ps if p.cache)
    other = next(p for p in ps if p is not holder)
    holder.insert(list(range(10**6, 10**6 + 40)))  # evicts all 16 of the session's units to holder's tier
    assert len(holder.cpu.units) == 16
    chain = UnitChain(UNIT)
    chain.extend(10_000, 4096)
    chain.extend(7, 300)
    flight = InFlight(Live(sim.sessions[0], chain, [], 0.0), 0.0, chain.tokens, 4096, chain.keys[: chain.tokens // UNIT],
                      strategies.Routed(other, ds[0], Choice.RECOMPUTE, ""), 1)
    covered = sim._from_cpu_tiers(other, flight, 0)
    assert covered == 16 * UNIT and flight.peer == 16 * UNIT and flight.restored == 0
    assert sim.result.bytes_p_to_p == 16 * UNIT * KVB


# -- bytes moved ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["kvshuttle", "kvshuttle_pull", "threshold", "cache_aware_pull", "cache_aware",
                                  "recompute", "conditional_disagg", "cache_aware_offload"])
def test_bytes_d_to_p_are_the_pulled_tokens_kv_and_none_without_pulls(name):
    res = run([session("s0", 0.0, 4096, [(600, 64, 1.0), (300, 64, 1.0)]),
               session("s1", 0.3, 6000, [(900, 64, 1.0)])], name, decode=2)
    pulled = sum(res.turns.pulled)
    assert res.bytes_d_to_p == pulled * KVB
    if name in ("cache_aware", "recompute", "conditional_disagg", "cache_aware_offload"):
        assert pulled == 0
    elif name not in ("cache_aware_pull", "kvshuttle"):  # cache_aware_pull's P caches every prompt here: nothing
        assert pulled > 0  # left to pull; kvshuttle continues these turns on the idle D instead
    summary = report.summarize(res, 2000.0)
    assert summary["kv_mb_d_to_p_per_turn"] == pytest.approx(round(res.bytes_d_to_p / len(res.turns) / 1e6, 1))
    assert summary["kv_mb_p_to_d_per_turn"] == pytest.approx(round(res.bytes_p_to_d / len(res.turns) / 1e6, 1))


# -- configuration ----------------------------------------------------------------------------------------------------


def test_the_new_strategies_and_settings_are_accepted_and_checked():
    cfg = parse_config(SimulateConfig, "--strategies", "conditional_disagg,cache_aware_offload,kvshuttle_pull",
                       "--cd-eff-isl-threshold", "2048", "--cd-eff-isl-ratio", "0.7", "--cpu-tier-gib", "150",
                       "--max-num-batched-tokens", "2048", "--peer-cpu-pull")
    assert cfg.peer_cpu_pull and cfg.cd_eff_isl_threshold == 2048
    assert set(strategies.NAMES) >= {"conditional_disagg", "cache_aware_offload"}
    assert "kvshuttle_pull" not in SimulateConfig().strategy_list()
    for argv, words in ((["--strategies", "cache_aware", "--cd-eff-isl-threshold", "2048"], "--cd-eff-isl-threshold"),
                        (["--strategies", "kvshuttle", "--cpu-tier-gib", "10"], "--cpu-tier-gib"),
                        (["--strategies", "cache_aware", "--max-num-batched-tokens", "512"], "--max-num-batched"),
                        (["--strategies", "conditional_disagg", "--cd-eff-isl-ratio", "1.5"], "--cd-eff-isl-ratio")):
        with pytest.raises(ConfigError, match=words):
            parse_config(SimulateConfig, *argv)
