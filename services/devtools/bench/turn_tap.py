"""A tap between an unchanged client and the gateway of a local stack: the client gets the tap's base URL, the tap
forwards every request as it came and every answer as it goes (streams included), one turn at a time, and notes per
turn what the prefill worker did and what the registry recorded. The end-to-end tests run the clients people use
through it (tests/e2e/agents/test_clients.py), and ``kvshuttle bench-clients`` its client styles.

Before each turn it empties P's prefix cache, so that P's own counters say exactly how many prompt tokens came over
NIXL and how many P computed; after the answer (the gateway has recorded the turn by then) it reads those counters
and the session's record with its exact ids. ``check_pulls`` then holds every later turn to the promise: found, and
pulled exactly the whole blocks of the longest common prefix of its prompt with what the decode worker held.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import httpx
from kvshuttle.control_plane.continuation import common_prefix
from kvshuttle.services.common.http_server import HttpServer
from kvshuttle.v1 import registry_pb2, registry_pb2_grpc
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.routing import Route

HOP_HEADERS = {"host", "content-length", "transfer-encoding", "connection", "content-encoding"}


@dataclass
class TappedTurn:
    path: str
    status: int
    session_id: str
    source: str  # X-Session-Source: new, found, client
    decision: str
    reason: str
    pulled: int  # what the gateway says (X-KV-Pulled-Tokens)
    computed: int
    by_source: dict[str, float]  # P's own counters over the turn: external_kv_transfer (pulled), local_compute
    history: list[int] = field(default_factory=list)  # the session's ids as recorded after the turn

    @property
    def prompt_ids(self) -> list[int]:
        return self.history[:self.pulled + self.computed]


class TurnTap:
    def __init__(self, stack, upstream: str, tenant: str = "default"):
        """``stack``: the local stack (services/devtools/stack.py) whose gateway ``upstream`` is (or one more
        gateway on it); ``tenant``: the gateway's tenant for the requests (its API key's; "default" when open)."""
        self.stack, self.tenant = stack, tenant
        self.client = httpx.AsyncClient(base_url=upstream, timeout=600)
        self.lock = asyncio.Lock()
        self.turns: list[TappedTurn] = []
        self._finishing: set[asyncio.Task] = set()
        self.errors: list[BaseException] = []
        self.server = HttpServer(Starlette(routes=[
            Route("/{path:path}", self.forward, methods=["GET", "POST", "DELETE"])]), "127.0.0.1:0")
        self.base_url = f"http://{self.server.address}"

    async def __aenter__(self) -> TurnTap:
        self._channel = self.stack.channel(self.stack.registry_address)
        self.registry = registry_pb2_grpc.SessionRegistryStub(self._channel)
        await self.server.start()
        return self

    async def __aexit__(self, *exc) -> None:
        try:
            if exc[0] is None:
                await self.settled()
        finally:
            await self.server.stop()
            await self.client.aclose()
            await self._channel.close()

    async def settled(self, timeout_s: float = 300.0) -> list[TappedTurn]:
        """The turns, once the one in flight is noted: a client has its answer before the tap has noted the turn."""
        await asyncio.wait_for(self.lock.acquire(), timeout_s)
        self.lock.release()
        await asyncio.gather(*self._finishing, return_exceptions=True)
        if self.errors:
            raise RuntimeError(f"the tap could not note a turn: {self.errors[0]!r}") from self.errors[0]
        return self.turns

    async def forward(self, request: Request):
        body = await request.body()
        await self.lock.acquire()
        try:
            await self.stack.flush_prefill()
            before = await asyncio.to_thread(self.stack.prefill_prompt_tokens_by_source)
            url = request.url.path + (f"?{request.url.query}" if request.url.query else "")
            upstream = await self.client.send(self.client.build_request(
                request.method, url, content=body,
                headers=[(k, v) for k, v in request.headers.items() if k.lower() not in HOP_HEADERS]), stream=True)
        except BaseException:
            self.lock.release()
            raise

        # The answer is read by a task of its own, not by the client's response: a client may hang up as soon as it
        # has the last chunk (the server then cancels the response), and the gateway still ends and records the turn;
        # the turn is noted once the whole answer has been read, by a task __aexit__ waits for.
        chunks: asyncio.Queue[bytes | None] = asyncio.Queue()
        reading = asyncio.create_task(self._read(upstream, chunks))

        async def relay():
            try:
                while (chunk := await chunks.get()) is not None:
                    yield chunk
            finally:
                task = asyncio.create_task(self._finish(request.url.path, upstream, before, reading))
                self._finishing.add(task)
                task.add_done_callback(self._finishing.discard)

        headers = {k: v for k, v in upstream.headers.items() if k.lower() not in HOP_HEADERS}
        return StreamingResponse(relay(), status_code=upstream.status_code, headers=headers)

    @staticmethod
    async def _read(upstream: httpx.Response, chunks: asyncio.Queue[bytes | None]) -> None:
        try:
            async for chunk in upstream.aiter_raw():
                chunks.put_nowait(chunk)
        finally:
            chunks.put_nowait(None)

    async def _finish(self, path: str, upstream: httpx.Response, before: dict[str, float],
                      reading: asyncio.Task) -> None:
        try:
            try:
                await reading
            except httpx.HTTPError:
                pass
            await upstream.aclose()
            await self._note(path, upstream, before)
        except BaseException as e:
            self.errors.append(e)
            raise
        finally:
            self.lock.release()

    async def _note(self, path: str, resp: httpx.Response, before: dict[str, float]) -> None:
        h = resp.headers
        if "x-kv-decision" not in h:
            return  # not a turn (e.g. GET /v1/models)
        after = await asyncio.to_thread(self.stack.prefill_prompt_tokens_by_source)
        turn = TappedTurn(path, resp.status_code, h.get("x-session-id", ""), h.get("x-session-source", ""),
                          h["x-kv-decision"], h.get("x-kv-reason-code", ""), int(h.get("x-kv-pulled-tokens", 0)),
                          int(h.get("x-kv-computed-tokens", 0)),
                          {k: after.get(k, 0) - before.get(k, 0) for k in set(after) | set(before)})
        if turn.session_id:
            got = await self.registry.GetSession(registry_pb2.GetSessionRequest(
                session_id=turn.session_id, tenant=self.tenant, include_token_ids=True), timeout=10)
            turn.history = list(got.session.token_ids)
        self.turns.append(turn)


def expected_pull(prompt: list[int], held: list[int], block_size: int) -> int:
    """What a later turn must pull from a decode worker that holds the KV of ``held`` (all of it but the last token,
    as vLLM's handle covers): all of that when the prompt extends it, else the whole blocks of their longest common
    prefix (never the prompt's last token)."""
    covered = len(held) - 1
    usable = min(common_prefix(prompt, held), covered, len(prompt) - 1)
    return covered if usable == covered else usable // block_size * block_size


def check_pulls(turns: list[TappedTurn], block_size: int, held: dict[str, list[int]],
                firsts: set[int] = frozenset({0})) -> list[str]:
    """Each turn's problems, as text: every turn answered; the turns at ``firsts`` (each conversation's first)
    starting their session (a new one, or the one the client named), and every other one found in a session seen before (``held``: each session's last
    recorded ids, from earlier runs too; updated), pulling exactly ``expected_pull`` against that record (at least a
    block), as P's own counters show."""
    problems = []
    for i, t in enumerate(turns):
        where = f"turn {i} ({t.path}, session {t.session_id[:18]}, {t.source}, {t.decision}/{t.reason})"
        if t.status != 200:
            problems.append(f"{where}: HTTP {t.status}")
            continue
        if t.by_source.get("external_kv_transfer", 0) != t.pulled or t.by_source.get("local_compute", 0) != t.computed:
            problems.append(f"{where}: the gateway says {t.pulled} pulled / {t.computed} computed, P's counters "
                            f"{t.by_source}")
        if i in firsts:
            if t.source not in ("new", "client") or t.decision == "pull":
                problems.append(f"{where}: a conversation's first turn should start its session, not continue one")
        elif t.source not in ("found", "client", "response") or t.session_id not in held:
            problems.append(f"{where}: a later turn not found in a session seen before")
        else:
            want = expected_pull(t.prompt_ids, held[t.session_id], block_size)
            if t.decision != "pull" or t.pulled != want or want < block_size:
                problems.append(f"{where}: pulled {t.pulled}, the longest common prefix with D's "
                                f"{len(held[t.session_id])} ids gives {want} (prompt {len(t.prompt_ids)})")
        held[t.session_id] = t.history
    return problems
