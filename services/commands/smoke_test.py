"""`kvshuttle smoke-test`: a short conversation through a running gateway, to check a deployment end to end.

Two turns (by default) of one session over the OpenAI-compatible HTTP API: each must answer 200 with text, the
second must extend the first (the gateway reports its KV decision: ``pull`` when the history came back from the
decode worker), then the session is ended so its KV is freed. Prints one line per turn and exits 0 when all is well,
1 with the reason otherwise (2: bad settings). The Helm chart's `helm test` pod runs it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import sys
import time
import uuid
from collections.abc import Sequence

import httpx
from kvshuttle.services.common.config import load, require, setting

# A user message long enough that the history spans several KV blocks (what a pull can move).
FILLER = " ".join(f"step {i}: read the log, note the error, try the fix, run the tests." for i in range(40))


@dataclasses.dataclass
class SmokeTestConfig:
    """A short conversation through a running gateway; exit 0 only when every turn answered as expected."""

    ENV_PREFIX = "KVSHUTTLE_SMOKE_TEST_"
    url: str = setting("http://127.0.0.1:8000", "The gateway's base URL (http:// or https://)")
    model: str = setting("", "Model name to send (default: the first of GET /v1/models)")
    api_key: str = setting("", "API key (Authorization: Bearer); prefer the env var", secret=True)
    turns: int = setting(2, "Turns in the conversation (>= 2: the second one can pull the first's KV)")
    max_tokens: int = setting(16, "Answer tokens per turn")
    require_pull: bool = setting(False, "Fail unless every turn after the first pulled its history (the "
                                        "scheduler's cost model may choose recompute on a fast, idle deployment)")
    timeout_s: float = setting(300.0, "Deadline of each request (the first turn on a cold worker can be slow)")
    insecure: bool = setting(False, "https: do not verify the gateway's certificate")

    def validate(self) -> None:
        require(self.url.startswith(("http://", "https://")), "--url must start with http:// or https://")
        require(self.turns >= 2, "--turns must be >= 2")
        require(self.max_tokens >= 1 and self.timeout_s > 0, "--max-tokens and --timeout-s must be positive")


class SmokeTestFailed(Exception):
    """A turn did not answer as expected; the message says which and why."""


def _error(resp: httpx.Response) -> str:
    try:
        return resp.json()["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return resp.text[:200]


async def _model(client: httpx.AsyncClient) -> str:
    resp = await client.get("/v1/models")
    if resp.status_code != 200:
        raise SmokeTestFailed(f"GET /v1/models: {resp.status_code} {_error(resp)}")
    models = resp.json().get("data") or []
    if not models:
        raise SmokeTestFailed("GET /v1/models lists no model")
    return models[0]["id"]


async def run(cfg: SmokeTestConfig, out=sys.stdout) -> list[dict]:
    """The conversation; returns one dict per turn (decision, tokens, time). Raises SmokeTestFailed."""
    headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
    session = f"smoke-test-{uuid.uuid4().hex[:12]}"
    results = []
    async with httpx.AsyncClient(base_url=cfg.url.rstrip("/"), headers=headers, timeout=cfg.timeout_s,
                                 verify=not cfg.insecure) as client:
        try:
            model = cfg.model or await _model(client)
        except httpx.HTTPError as exc:
            raise SmokeTestFailed(f"cannot reach the gateway at {cfg.url}: {exc!r}") from None
        messages: list[dict] = [{"role": "system", "content": "You are a terse assistant."}]
        try:
            for turn in range(1, cfg.turns + 1):
                messages.append({"role": "user", "content": f"Turn {turn}. {FILLER} What next?"})
                started = time.perf_counter()
                resp = await client.post("/v1/chat/completions", headers={"X-Session-ID": session}, json={
                    "model": model, "messages": messages, "max_tokens": cfg.max_tokens, "temperature": 0})
                seconds = time.perf_counter() - started
                if resp.status_code != 200:
                    raise SmokeTestFailed(f"turn {turn}: {resp.status_code} {_error(resp)}")
                body = resp.json()
                answer = body["choices"][0]["message"]
                if not answer.get("content"):
                    raise SmokeTestFailed(f"turn {turn}: an empty answer")
                kv = body.get("kvshuttle", {})
                result = {"turn": turn, "decision": kv.get("decision", "?"), "reason": kv.get("reason", ""),
                          "prompt_tokens": body["usage"]["prompt_tokens"], "pulled_tokens": kv.get("pulled_tokens", 0),
                          "seconds": seconds}
                results.append(result)
                print(f"turn {turn}: {result['decision']:<9} prompt {result['prompt_tokens']:>6} tokens, pulled "
                      f"{result['pulled_tokens']:>6}, {seconds * 1000:7.1f} ms  ({result['reason']})", file=out)
                if turn > 1 and cfg.require_pull and result["decision"] != "pull":
                    raise SmokeTestFailed(f"turn {turn} recomputed (--require-pull): {result['reason']}")
                messages.append({"role": "assistant", "content": answer["content"]})
        except httpx.HTTPError as exc:
            raise SmokeTestFailed(f"request failed: {exc!r}") from None
        finally:
            try:  # free the session's KV on the decode worker; a failure here fails nothing
                await client.post(f"/v1/sessions/{session}/end")
            except httpx.HTTPError:
                pass
    return results


def main(argv: Sequence[str] | None = None) -> int:
    cfg = load(SmokeTestConfig, argv, prog="kvshuttle smoke-test", description=SmokeTestConfig.__doc__)
    try:
        results = asyncio.run(run(cfg))
    except SmokeTestFailed as exc:
        print(f"smoke test FAILED: {exc}", flush=True)
        return 1
    pulled = sum(1 for r in results[1:] if r["decision"] == "pull")
    print(f"smoke test passed: {len(results)} turns, {pulled} of {len(results) - 1} later turns pulled their history",
          flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
