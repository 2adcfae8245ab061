"""Which models a worker serves: its base model (Worker.model) and the LoRA adapters it has loaded, each asked for by
its own name. KV is a model's and an adapter's own: vLLM computes it under the adapter and keys its block hashes by
it, so a turn for one never reuses KV (or ids) recorded for another (docs/models.md)."""

from __future__ import annotations

from collections.abc import Sequence

from kvshuttle.v1 import common_pb2


def serves(worker: common_pb2.Worker, model: str) -> bool:
    """Whether ``worker`` answers requests for ``model``: its base model, or one of its adapters by name."""
    return worker.model == model or any(a.name == model for a in worker.adapters)


def adapter(worker: common_pb2.Worker, model: str) -> common_pb2.LoraAdapter | None:
    """The adapter ``model`` names on ``worker`` (None: the base model, or not served there)."""
    return next((a for a in worker.adapters if a.name == model), None)


def adapter_turn(model: str | None, workers: Sequence[common_pb2.Worker]) -> str | None:
    """The adapter a turn for ``model`` runs under, given the workers planned for it (all serve ``model``): ``model``
    when it is not their base model, else None."""
    return model if model and any(w.model != model for w in workers) else None


def served_names(worker: common_pb2.Worker) -> list[str]:
    """Every name ``worker`` answers to: its base model first, then its adapters."""
    return [worker.model, *(a.name for a in worker.adapters)] if worker.model else [a.name for a in worker.adapters]


# A Generate call for an adapter names it in call metadata (vLLM's GenerateRequest has no LoRA field); kvshuttle's
# vLLM plugin (workers/vllm_call_options.py) runs the request under the adapter of that name the worker has loaded
# and answers ADAPTER_APPLIED_KEY: "1" in the call's initial metadata (a worker that does not is refused, so a turn
# for an adapter never runs on the base model).
ADAPTER_METADATA_KEY = "kvshuttle-lora"
ADAPTER_APPLIED_KEY = "kvshuttle-lora-applied"
