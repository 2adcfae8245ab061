"""The ``smg`` mode of ``kvshuttle bench``: SMG (PyPI ``smg``, the Shepherd Model Gateway) in front of the same
vLLM gRPC workers, replaying the same conversations, so kvshuttle's TTFT can be divided by SMG's turn by turn.

The bench starts ``smg launch --pd-disaggregation --prefill grpc://P --decode grpc://D`` (every P and D the stack
registered) once the stack is up, waits for its ``/readiness`` to count them all healthy, forces each tool call
once through it (vLLM compiles a grammar on a worker's first constrained request), and drives it like the gateway
modes: OpenAI chat over HTTP, streamed (SSE), with the same messages, tools and ``tool_choice``. SMG renders the chat
template and tokenizes the text itself; it needs no session id (none is sent). It asks P for one token with
``do_remote_decode``, hands P's ``kv_transfer_params`` to D and streams D's answer; it never pulls a history from D,
so each turn's history is whatever P still holds in its prefix cache (``--prefill-cache warm``) plus what P computes.

What SMG does differently, and how the lane deals with it:

- **D's blocks stay pinned.** D returns a handle for every turn (bi-directional NIXL), SMG never sends it back to P,
  so D holds each SMG turn's prompt + answer blocks until ``decoder_kv_blocks_ttl`` (the bench's default: 120 s).
  The recompute mode does the same; at the bench's sizes that stays far below D's KV cache (1 GiB on CPU: ~260k
  tokens of the tiny fp32 model). The bench prints D's token usage after the run.
- **logit_bias is dropped.** SMG 1.13 does not pass ``logit_bias`` on to vLLM's gRPC workers, so the bench's
  ``{``/``}`` bias (``--call-arguments empty``) does not reach them, and a random test model writes a forced call's
  arguments as whitespace until ``max_tokens`` (invalid JSON, which SMG then refuses to render on the next turn).
  With ``--call-arguments empty`` the lane echoes a forced call back with ``{}`` arguments, as every other mode's
  answer is: the conversation stays the same text in every mode. It counts the calls it rewrote. A forced call's
  *first* token is unaffected; its latency is (up to ``max_tokens`` generated).
- **A forced call is the arguments alone.** SMG constrains a named ``tool_choice`` to the arguments' JSON and
  streams them as ``tool_calls`` deltas; its first such chunk arrives with the first generated token, which is where
  the lane stops the clock (as for content).
- **It gives up on a silent prefill after 3 s** (``--worker-wedge-secs``, its default): longer than a cold prefill
  of a few thousand tokens on 2 CPU cores can take under load. The bench raises it (``--smg-silence-s``), as the
  kvshuttle gateway does not give up on a slow P either.
- **Usage.** ``usage.prompt_tokens_details.cached_tokens`` is P's prefix-cache hit (checked: it drops to 0 after P's
  cache is flushed), so the lane reports ``computed_tokens = prompt_tokens - cached_tokens`` and never a pull.
"""

from __future__ import annotations

import asyncio
import logging
import shlex
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx
from kvshuttle.services.common.processes import ChildProcess
from kvshuttle.services.devtools.bench.lanes import CALL_PARSER, GatewayLane, LaneError, message_digest
from kvshuttle.services.devtools.bench.samples import SMG, TurnSample
from kvshuttle.services.devtools.bench.workload import CALL_MIN_TOKENS, Turn
from kvshuttle.services.devtools.chat_stream import StreamError, stream_chat
from kvshuttle.services.devtools.etcd_process import free_port

log = logging.getLogger("kvshuttle.bench")

SMG_VERSION = "1.13.0"  # what scripts/bootstrap.sh installs
DEFAULT_SMG_BIN = ".smg/bin/smg"  # from the repository root, as the bench's other paths (var/...)
INSTALL_HINT = (f"run `make install` (scripts/bootstrap.sh installs smg=={SMG_VERSION} into its own venv, .smg/, "
                f"beside .venv: it does not fit into .venv)")
# SMG's name for the tool-call syntax the bench forces (the gateway's hermes: <tool_call>{json}</tool_call>).
SMG_TOOL_CALL_PARSERS = {"hermes": "qwen"}
EMPTY_ARGUMENTS = "{}"


class SmgMissing(RuntimeError):
    """The smg executable is not where the bench looks for it."""


def smg_binary(path: str) -> Path:
    """The smg executable at ``path`` (relative: from the current directory, as the bench's other paths);
    SmgMissing names the install step."""
    binary = Path(path).absolute()
    if not binary.is_file():
        raise SmgMissing(f"the smg mode needs SMG, and {binary} does not exist: {INSTALL_HINT}")
    return binary


def grpc_url(address: str) -> str:
    """A worker's gRPC address as SMG takes it (``grpc://host:port``)."""
    return address if "://" in address else f"grpc://{address}"


def smg_command(binary: str | Path, *, prefill: Sequence[str], decode: Sequence[str], model_dir: str | Path,
                port: int, prometheus_port: int, host: str = "127.0.0.1", tool_call_parser: str = CALL_PARSER,
                silence_s: int = 60, log_level: str = "warn", extra_args: str = "") -> list[str]:
    """``smg launch`` in P/D mode in front of the ``prefill`` and ``decode`` workers' gRPC addresses.

    ``tool_call_parser`` is the gateway's name (hermes), translated to SMG's; ``silence_s`` is SMG's
    ``--worker-wedge-secs`` (how long a silent prefill or decode leg may take before SMG gives up on it)."""
    if not prefill or not decode:
        raise ValueError("SMG in P/D mode needs at least one prefill and one decode worker")
    if silence_s < 1:
        raise ValueError("silence_s must be >= 1")
    argv = [str(binary), "launch", "--pd-disaggregation"]
    for address in prefill:
        argv += ["--prefill", grpc_url(address)]
    for address in decode:
        argv += ["--decode", grpc_url(address)]
    argv += ["--model-path", str(model_dir), "--host", host, "--port", str(port),
             "--prometheus-host", host, "--prometheus-port", str(prometheus_port),
             "--worker-wedge-secs", str(silence_s), "--shutdown-grace-period-secs", "5",
             "--log-level", log_level]
    if tool_call_parser:
        try:
            argv += ["--tool-call-parser", SMG_TOOL_CALL_PARSERS[tool_call_parser]]
        except KeyError:
            raise ValueError(f"no SMG tool-call parser known for {tool_call_parser!r}") from None
    return argv + shlex.split(extra_args)


class SmgRouter:
    """One ``smg launch`` process for the run: started, checked ready, stopped."""

    def __init__(self, binary: Path, *, prefill: Sequence[str], decode: Sequence[str], model_dir: str | Path,
                 log_path: Path, tool_call_parser: str = CALL_PARSER, silence_s: int = 60, extra_args: str = ""):
        self.host = "127.0.0.1"
        self.port, self.prometheus_port = free_port(), free_port()
        self.workers = len(prefill) + len(decode)
        self.argv = smg_command(binary, prefill=prefill, decode=decode, model_dir=model_dir, port=self.port,
                                prometheus_port=self.prometheus_port, host=self.host,
                                tool_call_parser=tool_call_parser, silence_s=silence_s, extra_args=extra_args)
        self.child = ChildProcess("smg", self.argv, log_path, stop_grace_s=15.0)
        self.model = ""  # the model id SMG serves, read once it is ready

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    async def start(self, timeout_s: float) -> None:
        """Start SMG; return once ``/readiness`` counts every worker healthy and ``/v1/models`` names a model."""
        deadline = time.monotonic() + timeout_s
        await self.child.start()
        async with httpx.AsyncClient(base_url=self.base_url, timeout=5.0) as client:
            while True:
                if self.child.returncode is not None:
                    raise RuntimeError(f"smg exited with code {self.child.returncode}; its log ({self.child.log_path}) "
                                       f"ends with:\n{self.child.log_tail(30)}")
                try:
                    ready = (await client.get("/readiness")).json()
                    if ready.get("status") == "ready" and ready.get("healthy_workers", 0) >= self.workers:
                        models = (await client.get("/v1/models")).json().get("data") or []
                        if models:
                            self.model = models[0]["id"]
                            log.info("smg serving %s on %s (%d workers)", self.model, self.base_url, self.workers)
                            return
                except (httpx.HTTPError, ValueError):
                    pass
                if time.monotonic() > deadline:
                    raise TimeoutError(f"smg was not ready in time:\n{self.child.log_tail(30)}")
                await asyncio.sleep(0.3)

    async def stop(self) -> None:
        await self.child.stop()


class SmgLane(GatewayLane):
    """A conversation through SMG: the gateway lane's requests less kvshuttle's own field (``disable_pull``) and
    session header, with the model named (SMG requires it)."""

    def __init__(self, client: httpx.AsyncClient, model: str, conversation: str, system: str | None,
                 tools: list[dict[str, Any]] | None = None, call_bias: dict[int, float] | None = None):
        super().__init__(client, SMG, conversation, system, "", model, disable_pull=True, tools=tools,
                         call_bias=call_bias)
        self.rewritten_calls = 0  # forced calls whose arguments came back other than {} (echoed as {})
        self.forced_calls = 0

    def request(self, turn: Turn) -> dict[str, Any]:
        body = super().request(turn)
        body.pop("disable_pull", None)
        return body

    def echo(self, message: dict[str, Any], turn: Turn) -> dict[str, Any]:
        """The answer as the lane sends it back: with the bench's empty-arguments calls (``call_bias`` set), a forced
        call's arguments are ``{}`` whatever SMG returned (it drops the bias that closes them)."""
        calls = message.get("tool_calls") or []
        if not turn.call or not self.call_bias or not calls:
            return message
        self.forced_calls += 1
        if all(c["function"]["arguments"] == EMPTY_ARGUMENTS for c in calls):
            return message
        self.rewritten_calls += 1
        return {**message, "tool_calls": [{**c, "function": {**c["function"], "arguments": EMPTY_ARGUMENTS}}
                                          for c in calls]}

    async def turn(self, turn: Turn) -> TurnSample:
        h = self.history
        h.add_inputs(turn)
        try:
            got = await stream_chat(self.client, None, self.request(turn), kvshuttle=False)
        except StreamError as exc:
            raise LaneError(f"smg: {exc}") from None
        usage = got.usage
        prompt, output = usage["prompt_tokens"], usage["completion_tokens"]
        cached = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
        history = h.previous_tokens if h.turn > 1 else 0
        message = self.echo(got.message, turn)
        h.add_answer(message, turn, got.finish_reason, prompt, output)
        self.last_timings, self.last_kv = {}, {}
        return TurnSample(
            mode=SMG, conversation=self.conversation, turn=h.turn, prompt_tokens=prompt, history_tokens=history,
            new_tokens=prompt - history, ttft_ms=got.ttft_ms, latency_ms=got.latency_ms, output_tokens=output,
            decision="recompute", pulled_tokens=0, computed_tokens=prompt - cached,
            output_digest=message_digest(message))

    async def close(self) -> None:
        pass  # SMG keeps no session


async def warm_up_smg(client: httpx.AsyncClient, model: str, calls: list[tuple[list[dict[str, Any]], str]],
                      call_bias: dict[int, float]) -> None:
    """One unmeasured turn through SMG, and each forced call once: the grammars SMG asks for (the arguments' JSON,
    not the gateway's hermes call) compile on the workers' first use."""
    requests: list[dict[str, Any]] = [{"messages": [{"role": "user", "content": "Warm up."}], "max_tokens": 2}]
    for tools, name in calls:
        body: dict[str, Any] = {"messages": [{"role": "user", "content": "Warm up: call the tool."}], "tools": tools,
                                "max_tokens": CALL_MIN_TOKENS,
                                "tool_choice": {"type": "function", "function": {"name": name}}}
        if call_bias:
            body["logit_bias"] = {str(k): v for k, v in call_bias.items()}
        requests.append(body)
    for body in requests:
        try:
            await stream_chat(client, None, {**body, "model": model, "temperature": 0}, kvshuttle=False)
        except StreamError as exc:
            raise LaneError(f"warming up SMG: {exc}") from None
