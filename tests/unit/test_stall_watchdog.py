"""The decode stream's stall watchdog (services/gateway/turns/decode.py): a decode stream silent for
``decode_stall_timeout_s`` fails the turn with DEADLINE_EXCEEDED as ``asyncio.wait_for`` per token did, time the
consumer spends between tokens never counts, a cancellation from elsewhere stays a cancellation, and a stream costs
one timer per timeout period, not one per token; chunks the express lane takes while the stream waits keep it quiet."""

from __future__ import annotations

import asyncio
import types

import grpc
import pytest
from kvshuttle.services.engine.client import EngineError
from kvshuttle.services.gateway.turns.decode import StallWatchdog, stream_tokens
from opentelemetry import trace


class Engine:
    """``generate`` yields ``n`` items ``gap_s`` apart, then sleeps for an hour (after ``hang_after`` items)."""

    def __init__(self, n: int, gap_s: float = 0.0, hang_after: int | None = None):
        self.n, self.gap_s, self.hang_after, self.closed = n, gap_s, hang_after, False

    async def generate(self, request_id, prompt, *, stream=True, **kwargs):
        try:
            for i in range(self.n):
                if i == self.hang_after:
                    await asyncio.sleep(3600)
                await asyncio.sleep(self.gap_s)
                yield i
        finally:
            self.closed = True


def rt(stall_s: float):
    return types.SimpleNamespace(decode_stall_timeout_s=stall_s)


async def collect(engine, stall_s, pause_s=0.0):
    got = []
    async for item in stream_tokens(rt(stall_s), engine, "r", [1], trace.INVALID_SPAN):
        got.append(item)
        if pause_s:
            await asyncio.sleep(pause_s)
    return got


async def test_a_silent_decode_stream_fails_with_deadline_exceeded():
    engine = Engine(5, hang_after=2)
    got = []
    loop = asyncio.get_running_loop()
    started = loop.time()
    with pytest.raises(EngineError) as err:
        async for item in stream_tokens(rt(0.1), engine, "r", [1], trace.INVALID_SPAN):
            got.append(item)
    assert got == [0, 1] and 0.09 <= loop.time() - started < 1.0
    assert err.value.code == grpc.StatusCode.DEADLINE_EXCEEDED and err.value.message == "no token for 0.1 s"
    assert engine.closed and asyncio.current_task().cancelling() == 0  # the watchdog's cancellation is undone
    await asyncio.sleep(0.15)  # no timer left behind to cancel this task later
    assert asyncio.current_task().cancelling() == 0


async def test_tokens_slower_in_total_but_each_in_time_are_not_a_stall():
    assert await collect(Engine(8, gap_s=0.03), stall_s=0.1) == list(range(8))  # 0.24 s in all


async def test_the_time_the_consumer_takes_between_tokens_does_not_count():
    assert await collect(Engine(3), stall_s=0.05, pause_s=0.12) == [0, 1, 2]


async def test_a_cancellation_from_elsewhere_stays_a_cancellation():
    task = asyncio.create_task(collect(Engine(5, hang_after=1), stall_s=30))
    await asyncio.sleep(0.05)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


async def test_an_outside_cancellation_at_the_same_time_as_the_stall_wins():
    dog = StallWatchdog(30)
    outcome = []

    async def waiter():
        dog.waiting()
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            outcome.append(dog.stalled())
            raise
        finally:
            dog.done()

    task = asyncio.create_task(waiter())
    await asyncio.sleep(0)
    dog._since -= 60  # the wait has lasted past the timeout: the timer's check cancels the task...
    dog._check()
    task.cancel()  # ...and so does someone else, before the task runs again
    with pytest.raises(asyncio.CancelledError):
        await task
    dog.close()
    assert outcome == [False] and task.cancelled()


async def test_one_timer_per_stream_not_one_per_token(monkeypatch):
    loop = asyncio.get_running_loop()
    timers = []
    real_call_at = loop.call_at
    monkeypatch.setattr(loop, "call_at", lambda when, cb, *a, **kw: timers.append(when) or real_call_at(when, cb, *a, **kw))
    assert await collect(Engine(200), stall_s=10.0) == list(range(200))
    assert len(timers) == 1


async def test_the_timer_re_arms_at_the_current_wait_s_deadline():
    dog = StallWatchdog(0.1)
    for _ in range(6):  # 0.3 s of waits, each 0.05 s: the timer moves on, never fires
        dog.waiting()
        await asyncio.sleep(0.05)
        dog.done()
    assert not dog.stalled() and asyncio.current_task().cancelling() == 0
    dog.close()
    assert dog._handle is None


class ExpressEngine:
    """``generate`` yields item 0, then (while its reader waits) hands items 1..n to ``express.take`` from loop
    callbacks ``gap_s`` apart, as the connection's reads would; then it goes silent."""

    def __init__(self, n: int, gap_s: float):
        self.n, self.gap_s, self.closed = n, gap_s, False

    async def generate(self, request_id, prompt, *, stream=True, express=None, **kwargs):
        loop = asyncio.get_running_loop()
        try:
            yield 0
            for i in range(1, self.n + 1):
                loop.call_later(i * self.gap_s, lambda i=i: express.ready() and express.take(i))
            await asyncio.sleep(3600)
        finally:
            self.closed = True


class Sink:
    def __init__(self):
        self.taken: list[int] = []

    def ready(self) -> bool:
        return True

    def take(self, chunk) -> None:
        self.taken.append(chunk)


async def test_chunks_taken_by_express_keep_the_stall_watchdog_quiet_until_they_stop():
    engine, sink = ExpressEngine(6, gap_s=0.05), Sink()
    loop = asyncio.get_running_loop()
    got = []
    started = loop.time()
    with pytest.raises(EngineError) as err:
        async for item in stream_tokens(types.SimpleNamespace(decode_stall_timeout_s=0.12), engine, "r", [1],
                                        trace.INVALID_SPAN, express=sink):
            got.append(item)
    # 0.3 s of express chunks against a 0.12 s stall timeout: the timeout runs from the last of them
    assert got == [0] and sink.taken == [1, 2, 3, 4, 5, 6]
    assert err.value.code == grpc.StatusCode.DEADLINE_EXCEEDED and 0.4 <= loop.time() - started < 1.5
    assert engine.closed
