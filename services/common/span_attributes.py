"""Every ``kvshuttle.*`` attribute the services put on their trace spans, with what it means (pure data).

The services set these names as literals (services/gateway/turns/, services/scheduler/planning.py,
services/registry/servicer.py); tests/unit/test_tracing_docs.py checks that every literal used there is listed here
and that nothing listed here is unused. The documentation's span-attribute reference is generated from this
catalogue (docs/hooks/reference.py), and docs/tracing.md says which span carries which attribute.
"""

from __future__ import annotations

SPAN_ATTRIBUTES: dict[str, str] = {
    "kvshuttle.session": "the session id hashed: first 16 hex digits of its SHA-256 (\"\" without a session). Never "
                         "the id itself",
    "kvshuttle.tenant": "the caller's tenant (from its API key; `default` on an open gateway)",
    "kvshuttle.base_model": "a LoRA adapter's turn (`gen_ai.request.model` names the adapter): the base model it "
                            "adapts",
    "kvshuttle.turn_index": "the session's turn number as the registry counts it (1: no record; starts again after a "
                            "record expired or was deleted); only with a session id",
    "kvshuttle.decision": "`pull`, `recompute` or `local` (continued on the decode worker holding the session's KV): "
                          "what happened (a pull that failed and was recomputed says `recompute`); on `prefill`, "
                          "what that prefill call tried",
    "kvshuttle.reason": "why, in words (the `X-KV-Reason` header)",
    "kvshuttle.reason_code": "why, as a reason code (`control_plane/reasons.py`; the metrics' `reason` label)",
    "kvshuttle.policy": "the scheduler policy that decided",
    "kvshuttle.prompt_tokens": "prompt tokens, history included",
    "kvshuttle.continued_ids": "the prompt continues the session's recorded token ids exactly (all of them, or those "
                               "up to a text boundary)",
    "kvshuttle.session_source": "how the session was known: `client` (the request named it), `response` (the "
                                "Responses API's previous_response_id), `prompt_cache_key` (the session the request's "
                                "`prompt_cache_key` names, its record continued), `found` (a request without a session "
                                "id whose prompt text extends a recorded session's, whole or up to a text boundary), "
                                "`new` (none found: a new session id) or \"\" (no session)",
    "kvshuttle.found": "FindSession found a session whose recorded text the prompt extends",
    "kvshuttle.reusable_tokens": "tokens the plan pulls (0 for a recompute)",
    "kvshuttle.pullable_tokens": "tokens a refused pull would have moved (what the safety rules allow, before the "
                                 "policy)",
    "kvshuttle.pulled_tokens": "tokens P pulled from D over NIXL",
    "kvshuttle.computed_tokens": "tokens P computed (prompt minus P's `cached_tokens`: pulled or its own prefix cache); "
                                 "a turn continued on D: tokens D computed",
    "kvshuttle.cached_tokens": "prompt tokens P did not compute (pulled from D, or in P's own prefix cache)",
    "kvshuttle.pulled_kv_bytes": "**an estimate** of the KV moved by the pull: pulled tokens × KV bytes per token from "
                                 "the model's `config.json` (2 × layers × KV heads × head dim × dtype size: 4096 for "
                                 "the tiny test model). Assumes the KV cache is in the model's dtype (not "
                                 "`--kv-cache-dtype fp8`); absent when the config does not say (e.g. MLA models)",
    "kvshuttle.retried_as_recompute": "the planned pull failed at P and the turn was recomputed",
    "kvshuttle.predicted_ttft_ms": "the scheduler's prediction: its predicted wait at P + the predicted prefill of the "
                                   "chosen option (cost model; absent when nothing was predicted)",
    "kvshuttle.predicted_pull_ms": "the cost model's predicted prefill time with a pull, on the chosen P",
    "kvshuttle.predicted_recompute_ms": "the cost model's predicted prefill time with a recompute, on the chosen P",
    "kvshuttle.predicted_wait_ms": "the predicted wait at the chosen P (the requests ahead of this turn)",
    "kvshuttle.predicted_local_ms": "the cost model's predicted time to first token of the turn continued on the "
                                    "decode worker holding the session's KV (0: not an option)",
    "kvshuttle.predicted_itl_delay_ms": "the cost model's predicted extra delay per token for each stream that decode "
                                        "worker is decoding, were the turn continued there",
    "kvshuttle.decode_streams": "the streams the session's decode worker was decoding as the turn was planned",
    "kvshuttle.decode_cached_tokens": "a turn continued on D: prompt tokens D's prefix cache held (D's own "
                                      "`cached_tokens`)",
    "kvshuttle.prefill_ms": "measured: P's prefill call (what the prediction is about); a turn continued on D: D's "
                            "request to its first token",
    "kvshuttle.ttft_ms": "measured: from the gateway's start of the turn to the answer's first token",
    "kvshuttle.prefill_worker": "the prefill worker's id (on the turn: the final one, after any failed worker)",
    "kvshuttle.decode_worker": "the decode worker's id (on the turn: the final one, after any failed worker)",
    "kvshuttle.worker_choice": "why these workers (the scheduler's explanation, as in `PlanFigures.worker_choice`)",
    "kvshuttle.kv_room_freed": "held KV handles freed on the chosen decode worker to make room for this turn",
    "kvshuttle.disable_pull": "the request forced a recompute (`disable_pull`)",
    "kvshuttle.max_tokens_source": "where the answer's limit (`gen_ai.request.max_tokens`) came from: `request`, the "
                                   "gateway's `default` (`--default-max-tokens`), or the `context` left after the "
                                   "prompt",
    "kvshuttle.history_kept_tokens": "the session's recorded ids the prompt starts with: all of them, or those up to "
                                     "a text boundary (the history re-rendered differently past it)",
    "kvshuttle.history_match_tokens": "the prompt's leading ids equal to the session's recorded ids, as the gateway "
                                      "compared them (`PlanTurnRequest.history_match_tokens`)",
    "kvshuttle.safety_identifier": "the request's `safety_identifier`, as the client sent it (changes no decision)",
    "kvshuttle.prompt_cache_key": "the request's `prompt_cache_key` (hashed): the session hint it gave",
    "kvshuttle.worker": "the worker a `prefill` or `decode` span (or a `worker_failed` event) is about",
    "kvshuttle.generated_tokens": "answer tokens a decode worker streamed (on `decode`, and on a `worker_failed` "
                                  "event: the tokens sent before the worker failed)",
    "kvshuttle.released": "the session's unused KV handle was freed (after a recompute, and for "
                          "`POST /v1/sessions/{id}/end`)",
    "kvshuttle.covered_tokens": "the tokens D's KV handle covers (what the registry recorded)",
}
