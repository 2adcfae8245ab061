"""What a simulated worker's work costs: fitted cost curves per hardware profile (the simulator's ground truth).

The planner never sees these: it learns its own model from the turns the simulator reports, as it does from real
ones. A profile gives, per worker:

- prefill compute: ``fixed + a·c + b·c·(p + c/2)`` ms for ``c`` computed tokens after ``p`` tokens already in KV
  (attention of each new token over everything before it);
- a pull of ``n`` tokens (D to P): ``transfer_fixed + n · bytes_per_token / link rate``; the hand-off of the prompt's
  KV from P to D: ``handoff_fixed`` plus the same rate;
- decoding: ``tpot_ms`` per output token (the first token after the prompt's KV reaches D: one step);
- KV capacity: the prefill worker's prefix cache and the decode worker's KV cache, in tokens;
- ``noise``: each measured time is the curve times a log-normal factor of this sigma.

Sources of the GPU profiles (docs/simulator.md has the derivation):

- NVIDIA H200 SXM datasheet: 989 TFLOPS dense BF16, 4.8 TB/s HBM3e, 141 GB.
- Qwen2.5-32B-Instruct ``config.json``: 64 layers, 40 query heads, 8 KV heads, head dim 128, 32.8 B parameters,
  so BF16 KV is 2·64·8·128·2 = 262,144 bytes per token and a prefill token costs 2·32.8 G FLOPs plus 4·64·40·128
  FLOPs per token of attention context.
- 400 Gbit/s: one ConnectX-7 NIC per GPU; 3.2 Tbit/s: the 8 NICs of a node, as one P pulling from a D in the same
  rail-optimised fabric can stripe over.

Assumed, not measured: 45% model FLOPs utilisation in prefill, 80% of line rate for a transfer, 2 ms per transfer
(NIXL handshake and notification), 15 ms per prefill call, 22 ms per decode step at serving batch sizes.
"""

from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass(frozen=True)
class Profile:
    name: str
    fixed_ms: float
    ms_per_ktoken: float
    ms_per_ktoken_kcontext: float
    transfer_fixed_ms: float
    kv_bytes_per_token: int
    link_gbit_s: float
    tpot_ms: float
    prefill_cache_tokens: int
    decode_kv_tokens: int
    block_size: int
    noise: float = 0.05
    handoff_fixed_ms: float = -1.0  # P to D's fixed cost per turn (-1: as a pull's, transfer_fixed_ms)
    # A prefill on D's own curve (-1: as P's). A turn continued on D makes one request where a disaggregated turn
    # makes two and a hand-off, inside D's batch; `--validate-samples` fits it to the real stack's local turns.
    local_fixed_ms: float = -1.0
    local_ms_per_ktoken: float = -1.0
    local_ms_per_ktoken_kcontext: float = -1.0
    source: str = ""

    def compute_ms(self, computed: int, prior: int) -> float:
        """Prefill of ``computed`` tokens after ``prior`` tokens already in KV (pulled or cached)."""
        if computed <= 0:
            return self.fixed_ms
        k = computed / 1000
        return self.fixed_ms + self.ms_per_ktoken * k + self.ms_per_ktoken_kcontext * k * (prior + computed / 2) / 1000

    def local_compute_ms(self, computed: int, prior: int) -> float:
        """A prefill on D: its own curve where one was fitted, else P's."""
        if self.local_fixed_ms < 0:
            return self.compute_ms(computed, prior)
        k = max(computed, 0) / 1000
        return (self.local_fixed_ms + self.local_ms_per_ktoken * k
                + self.local_ms_per_ktoken_kcontext * k * (prior + max(computed, 0) / 2) / 1000)

    @property
    def ms_per_ktransferred(self) -> float:
        return self.kv_bytes_per_token * 1000 * 8 / (self.link_gbit_s * 1e9) * 1000

    def transfer_ms(self, tokens: int) -> float:
        """A pull of ``tokens`` from D."""
        return self.transfer_fixed_ms + self.ms_per_ktransferred * tokens / 1000 if tokens > 0 else 0.0

    def handoff_ms(self, tokens: int) -> float:
        """The prompt's KV from P to D."""
        fixed = self.transfer_fixed_ms if self.handoff_fixed_ms < 0 else self.handoff_fixed_ms
        return fixed + self.ms_per_ktransferred * tokens / 1000


def _h200(link_gbit_s: float, name: str) -> Profile:
    flops = 989e12 * 0.45  # dense BF16 at the assumed utilisation
    per_token = 2 * 32.8e9
    attention = 4 * 64 * 40 * 128  # per (new token, context token)
    return Profile(
        name=name, fixed_ms=15.0, ms_per_ktoken=per_token * 1000 / flops * 1000,
        ms_per_ktoken_kcontext=attention * 1e6 / flops * 1000, transfer_fixed_ms=2.0,
        kv_bytes_per_token=262_144, link_gbit_s=link_gbit_s * 0.8, tpot_ms=22.0,
        # 141 GB less 66 GB of weights and ~10 GB of activations and graphs, at 256 KiB per token
        prefill_cache_tokens=250_000, decode_kv_tokens=250_000, block_size=64,
        source="Qwen2.5-32B, BF16, one H200 per worker (derived from published figures; see the module docstring)")


PROFILES: dict[str, Profile] = {
    "h200-32b-400g": _h200(400, "h200-32b-400g"),
    "h200-32b-3200g": _h200(3200, "h200-32b-3200g"),
    # This machine: the tiny fp32 test model on vLLM-CPU, one core per worker, NIXL over loopback TCP, 1 GiB of KV per
    # worker; fitted by `kvshuttle simulate --validate-samples` to a `kvshuttle bench` run (2026-12-02, 128 turns of 8
    # conversations; docs/simulator.md): a pull costs a fixed 44.7 ms and nothing measurable per token at these sizes.
    "cpu-tiny": Profile(
        name="cpu-tiny", fixed_ms=12.8, ms_per_ktoken=106.3, ms_per_ktoken_kcontext=42.5, transfer_fixed_ms=44.7,
        handoff_fixed_ms=0.0, kv_bytes_per_token=4096, link_gbit_s=1000.0, tpot_ms=9.5, prefill_cache_tokens=262_144,
        decode_kv_tokens=262_144, block_size=16, noise=0.1,
        source="tiny fp32 model on vLLM-CPU, this machine (fitted to a kvshuttle bench run)"),
}


def profile(name: str, **overrides) -> Profile:
    if name not in PROFILES:
        raise ValueError(f"unknown hardware profile {name!r}; choose one of {', '.join(PROFILES)}")
    return replace(PROFILES[name], **{k: v for k, v in overrides.items() if v})
