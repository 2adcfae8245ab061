"""LoadMonitor over loopback: real gRPC GetLoads servers (vLLM's VllmEngine service), a real WorkerView fed events."""

from __future__ import annotations

import asyncio
import logging
import time

import pytest
from kvshuttle.services.common.worker_view import WorkerView
from kvshuttle.services.devtools.etcd_process import free_port
from kvshuttle.services.engine.client import EngineClient
from kvshuttle.services.scheduler.load_monitor import LoadMonitor
from kvshuttle.v1 import common_pb2

from tests.support.load_servers import Event, LoadServer, delete, put, worker
from tests.support.waits import until

INTERVAL, TIMEOUT = 0.05, 0.3


class Recorder:
    """A client factory that remembers each EngineClient it made and whether it was closed."""

    def __init__(self):
        self.made: list[tuple[str, EngineClient]] = []
        self.closed: list[str] = []

    def __call__(self, address: str, timeout_s: float) -> EngineClient:
        client = EngineClient(address, timeout_s=timeout_s)
        close = client.close

        async def recorded_close() -> None:
            self.closed.append(address)
            await close()

        client.close = recorded_close  # type: ignore[method-assign]
        self.made.append((address, client))
        return client


@pytest.fixture
async def servers():
    started: list[LoadServer] = []

    async def make(**numbers) -> LoadServer:
        s = LoadServer(**numbers)
        await s.start()
        started.append(s)
        return s

    yield make
    for s in started:
        await s.stop()


@pytest.fixture
async def monitor():
    view = WorkerView(registry=None)  # fed with apply(); never started
    view.apply(Event(type=Event.EVENT_TYPE_SNAPSHOT, workers=[]))
    recorder = Recorder()
    m = LoadMonitor(view, interval_s=INTERVAL, timeout_s=TIMEOUT, pending_grace_s=0.0, client_factory=recorder)
    m.view, m.recorder = view, recorder  # for the tests
    m.start()
    yield m
    await m.stop()
    assert len(recorder.closed) == len(recorder.made), "every channel is closed on stop"


async def test_loads_follow_the_engines_numbers(monitor, servers):
    busy = await servers(num_running_reqs=3, num_waiting_reqs=2, num_used_tokens=4000,
                         num_waiting_uncached_tokens=700, cache_hit_rate=0.25)
    idle = await servers()
    decode = await servers(num_running_reqs=1, num_used_tokens=9000)
    put(monitor.view, worker("p-busy", busy.address), worker("p-idle", idle.address),
        worker("d-0", decode.address, common_pb2.WORKER_ROLE_DECODE))
    loads = await until(lambda: (l := monitor.loads()).keys() == {"p-busy", "p-idle", "d-0"} and l, what="samples")

    b = loads["p-busy"]
    assert (b.running, b.waiting, b.used_tokens, b.capacity_tokens, b.waiting_uncached_tokens) == (3, 2, 4000,
                                                                                                   10_000, 700)
    assert b.cache_hit_rate == pytest.approx(0.25)
    assert b.reachable and b.pending == 0 and 0 <= b.age_s < 1.0 and b.queued == 5
    assert loads["p-idle"].queued == 0 and loads["d-0"].free_tokens == 1000
    assert monitor.healthy("p-busy") is True and monitor.healthy("nobody") is None

    busy.servicer.numbers["num_running_reqs"] = 0
    await until(lambda: monitor.loads()["p-busy"].running == 0, what="the new number")
    # Polled every interval, concurrently: a few interval later every server has answered several times.
    calls = [s.servicer.calls for s in (busy, idle, decode)]
    await until(lambda: all(s.servicer.calls > c for s, c in zip((busy, idle, decode), calls, strict=True)),
                timeout_s=INTERVAL * 4, what="a new poll of every server within a few intervals")


async def test_age_grows_while_the_worker_does_not_answer(monitor, servers):
    """A worker that stops answering keeps its last sample, and that sample's age grows from one read to the next
    (the planner sees how stale the numbers are); an answer makes it fresh again."""
    s = await servers(num_running_reqs=2)
    put(monitor.view, worker("p", s.address))
    await until(lambda: "p" in monitor.loads(), what="a sample")
    w = monitor._workers["p"]
    s.servicer.delay_s = 60.0  # from now on every poll times out (TIMEOUT)

    await until(lambda: w.failures >= 1, what="a poll that timed out")
    first = monitor.loads()["p"]
    # the next poll is sent after this one failed and fails TIMEOUT later: the reads are at least that far apart
    await until(lambda: w.failures >= 2, what="a second poll that timed out")
    second = monitor.loads()["p"]
    print(f"\nages while the worker does not answer: {first.age_s:.3f} s, then {second.age_s:.3f} s")
    assert first.age_s >= TIMEOUT, "the sample is at least as old as the poll that timed out"
    assert second.age_s >= first.age_s + TIMEOUT / 2, (first.age_s, second.age_s)
    assert second.running == first.running == 2, "the last known numbers are kept"

    s.servicer.delay_s = 0.0  # it answers again: a new sample, young again
    fresh = await until(lambda: (l := monitor.loads()["p"]).age_s < TIMEOUT and l.reachable and l,
                        what="a fresh sample")
    assert fresh.age_s < second.age_s


async def test_pending_counts_until_the_next_sample(monitor, servers):
    s = await servers(num_running_reqs=1)
    put(monitor.view, worker("p", s.address))
    await until(lambda: "p" in monitor.loads(), what="a sample")
    s.servicer.delay_s = 0.15  # each poll takes a while: notes can land while one is in flight

    monitor.note_assigned("p", 300)
    monitor.note_assigned("p", 200)
    load = monitor.loads()["p"]
    assert (load.pending, load.pending_tokens, load.queued) == (2, 500, 3)
    # The next poll sent after the notes resets them.
    await until(lambda: monitor.loads()["p"].pending == 0, timeout_s=2.0, what="pending reset")
    assert monitor.loads()["p"].running == 1

    # A note made while a poll is in flight is not covered by that poll's sample.
    s.servicer.delay_s = 0.0
    await monitor.stop()  # stop the background poller; drive polls by hand
    put(monitor.view, worker("p", s.address))
    s.servicer.delay_s = 0.2
    calls = s.servicer.calls
    poll = asyncio.create_task(monitor.poll_now())
    # the server has the poll (so it was sent before the note below) and is still answering it
    await until(lambda: s.servicer.calls > calls, what="a poll in flight")
    assert not poll.done()
    monitor.note_assigned("p", 64)
    await poll
    load = monitor.loads()["p"]
    assert (load.pending, load.pending_tokens) == (1, 64), "noted after the poll was sent: still pending"
    s.servicer.delay_s = 0.0
    await monitor.poll_now()
    assert monitor.loads()["p"].pending == 0


async def test_pending_survives_samples_taken_within_the_grace(servers):
    s = await servers(num_running_reqs=1)
    view = WorkerView(registry=None)
    view.apply(Event(type=Event.EVENT_TYPE_SNAPSHOT, workers=[worker("p", s.address)]))
    m = LoadMonitor(view, interval_s=INTERVAL, timeout_s=TIMEOUT, pending_grace_s=0.3)
    try:
        await m.poll_now()
        m.note_assigned("p", 100)
        await m.poll_now()  # sent right after the note: the engine cannot have stepped with the turn yet
        assert m.loads()["p"].pending == 1
        await asyncio.sleep(0.3)  # the grace passes (the time is what is tested)
        await m.poll_now()
        assert m.loads()["p"].pending == 0
    finally:
        await m.stop()


async def test_old_notes_are_dropped():
    now = [1000.0]
    view = WorkerView(registry=None)
    view.apply(Event(type=Event.EVENT_TYPE_SNAPSHOT, workers=[]))
    m = LoadMonitor(view, clock=lambda: now[0])
    m.note_assigned("gone", 10)
    m.note_assigned("p-hung", 10)
    put(view, worker("p-hung", "127.0.0.1:1"))
    m._sync()
    assert m.loads()["gone"].pending == 1 and m.loads()["p-hung"].pending == 1
    now[0] += 11  # the view never listed "gone": its notes go after a while
    m._sync()
    assert "gone" not in m.loads() and m.loads()["p-hung"].pending == 1
    now[0] += 20  # no sample in 30 s: the notes are dropped too
    m._sync()
    assert m.loads().get("p-hung") is None or m.loads()["p-hung"].pending == 0
    await m.stop()


async def test_pending_for_a_worker_the_monitor_has_not_seen_yet(monitor):
    monitor.note_assigned("new-p", 50)
    load = monitor.loads()["new-p"]
    assert (load.pending, load.pending_tokens, load.reachable) == (1, 50, True)


async def test_a_reported_prefill_stops_counting_as_pending(monitor):
    monitor.note_assigned("p", 50)
    monitor.note_assigned("p", 70)
    monitor.note_finished("p")  # the oldest turn is done
    load = monitor.loads()["p"]
    assert (load.pending, load.pending_tokens) == (1, 70)
    monitor.note_finished("p")
    monitor.note_finished("p")  # more reports than notes (e.g. after a restart): nothing to clear
    monitor.note_finished("never-noted")
    assert "p" not in monitor.loads() or monitor.loads()["p"].pending == 0


async def test_unreachable_after_failed_polls_then_recovery(monitor, servers, caplog):
    s = await servers(num_running_reqs=4, num_used_tokens=1234)
    put(monitor.view, worker("p", s.address))
    await until(lambda: "p" in monitor.loads(), what="a sample")

    caplog.set_level(logging.DEBUG, logger="kvshuttle.services.scheduler.load_monitor")
    await s.stop()
    load = await until(lambda: (l := monitor.loads()["p"]) and not l.reachable and l, what="unreachable")
    assert (load.running, load.used_tokens) == (4, 1234), "the last known numbers are kept"
    assert monitor.healthy("p") is False
    await until(lambda: monitor._workers["p"].failures >= 6, what="more failed polls")
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and "failed (2 in a row)" in warnings[0].getMessage(), "one warning, then quiet"

    s.servicer.numbers["num_running_reqs"] = 0
    await s.start()  # same port: the channel reconnects (capped backoff)
    load = await until(lambda: (l := monitor.loads()["p"]).reachable and l, timeout_s=6.0, what="recovery")
    assert load.running == 0 and monitor.healthy("p") is True


async def test_a_hung_worker_times_out_without_delaying_the_others(monitor, servers):
    hung, fine = await servers(), await servers(num_running_reqs=1)
    hung.servicer.delay_s = 60.0
    t0 = time.monotonic()
    put(monitor.view, worker("p-hung", hung.address), worker("p-fine", fine.address))
    await until(lambda: "p-fine" in monitor.loads(), timeout_s=1.0, what="the fine worker's sample")
    calls = fine.servicer.calls
    load = await until(lambda: monitor.loads().get("p-hung"), timeout_s=TIMEOUT * 5, what="the hung one listed")
    assert not load.reachable and load.running == 0  # never answered: zeros
    assert monitor.healthy("p-hung") is False
    # The fine worker kept being polled at the interval while the hung one's polls waited for their timeout.
    assert fine.servicer.calls >= calls + 3
    elapsed = time.monotonic() - t0
    assert hung.servicer.calls <= elapsed / TIMEOUT + 1, "one poll in flight per worker at a time"


async def test_a_worker_that_is_starting_is_not_listed_until_it_fails_enough(servers):
    view = WorkerView(registry=None)
    port = free_port()  # nothing listens yet
    view.apply(Event(type=Event.EVENT_TYPE_SNAPSHOT, workers=[worker("p", f"127.0.0.1:{port}")]))
    m = LoadMonitor(view, interval_s=INTERVAL, timeout_s=TIMEOUT, unreachable_after=3)
    try:
        assert m.loads() == {} and m.healthy("p") is None
        await m.poll_now()
        assert m.loads() == {} and m.healthy("p") is False
        await m.poll_now()
        await m.poll_now()
        assert m.loads()["p"].reachable is False
    finally:
        await m.stop()


async def test_clients_are_closed_when_workers_leave_or_move(monitor, servers):
    a, b, moved = await servers(), await servers(), await servers(num_running_reqs=7)
    wa, wb = worker("p-a", a.address), worker("p-b", b.address)
    put(monitor.view, wa, wb)
    await until(lambda: monitor.loads().keys() == {"p-a", "p-b"}, what="both sampled")
    assert sorted(addr for addr, _ in monitor.recorder.made) == sorted([a.address, b.address])

    delete(monitor.view, wa)
    await until(lambda: a.address in monitor.recorder.closed, what="p-a's channel closed")
    assert "p-a" not in monitor.loads() and monitor.healthy("p-a") is None
    assert b.address not in monitor.recorder.closed

    put(monitor.view, worker("p-b", moved.address))  # re-registered at another address
    await until(lambda: monitor.loads().get("p-b") and monitor.loads()["p-b"].running == 7, what="the new address")
    assert b.address in monitor.recorder.closed
    calls, polls = a.servicer.calls, moved.servicer.calls
    await until(lambda: moved.servicer.calls >= polls + 3, what="three more polling rounds")
    assert a.servicer.calls == calls, "a worker that left is not polled any more"


async def test_the_task_survives_a_broken_client(monitor, servers):
    class Broken:
        async def get_loads(self):
            raise RuntimeError("boom")

        async def close(self):
            raise RuntimeError("close boom")

    monitor._client_factory = lambda address, timeout: Broken()
    w = worker("p-broken", "127.0.0.1:1")
    put(monitor.view, w)
    await until(lambda: monitor.healthy("p-broken") is False, what="failed polls")
    delete(monitor.view, w)
    await until(lambda: "p-broken" not in monitor._workers, what="dropped")
    # still at work: a worker that joins now is polled
    monitor._client_factory = monitor.recorder
    fine = await servers(num_running_reqs=3)
    put(monitor.view, worker("p-fine", fine.address))
    await until(lambda: (l := monitor.loads().get("p-fine")) and l.running == 3, what="the new worker's sample")
    assert monitor._task is not None and not monitor._task.done()


async def test_one_empty_sample_of_a_busy_worker_does_not_make_it_idle(servers):
    """A busy engine between two requests can report an empty queue once: the monitor keeps the larger queue of its
    last two samples, so the busy worker stays busy for that sample and shows idle from the next one on."""
    from kvshuttle.control_plane.load import WorkerLoad, smoothed

    view = WorkerView(registry=None)
    view.apply(Event(type=Event.EVENT_TYPE_SNAPSHOT, workers=[]))
    m = LoadMonitor(view, interval_s=INTERVAL, timeout_s=TIMEOUT, pending_grace_s=0.0, client_factory=Recorder())
    busy = await servers(num_running_reqs=4, num_waiting_reqs=1)
    put(view, worker("p-busy", busy.address))
    try:
        await m.poll_now()  # polled by hand: one sample per call
        assert m.loads()["p-busy"].queued == 5
        busy.servicer.numbers.update(num_running_reqs=0, num_waiting_reqs=0, num_used_tokens=7)
        await m.poll_now()
        once = m.loads()["p-busy"]
        assert once.queued == 5 and once.used_tokens == 7, "one empty sample: still busy; the rest is the latest"
        await m.poll_now()
        assert m.loads()["p-busy"].queued == 0, "idle once two samples in a row say so"
    finally:
        await m.stop()
    assert smoothed(WorkerLoad(running=2), None).queued == 2
