"""The scheduler's view of the registered workers (services/common/worker_view.py): workers by role and model,
the lists built once per change of the view (a plan's cost does not grow with other models' workers) and rebuilt
after every watch event."""

from __future__ import annotations

from kvshuttle.services.common.worker_view import Event, WorkerView
from kvshuttle.v1 import common_pb2

P, D = common_pb2.WORKER_ROLE_PREFILL, common_pb2.WORKER_ROLE_DECODE


def w(worker_id: str, role: int, model: str) -> common_pb2.Worker:
    return common_pb2.Worker(worker_id=worker_id, role=role, model=model)


def ids(workers) -> list[str]:
    return sorted(x.worker_id for x in workers)


async def test_workers_by_role_and_model_follow_every_event():
    view = WorkerView(registry=None)
    view.apply(Event(type=Event.EVENT_TYPE_SNAPSHOT, workers=[w("p1", P, "big"), w("d1", D, "big"),
                                                               w("p2", P, "small")]))
    assert view.ready.is_set()
    assert ids(view.by_role(P)) == ["p1", "p2"] and ids(view.by_role(P, "big")) == ["p1"]
    assert view.by_role(P, "big") is view.by_role(P, "big")  # built once until the view changes
    assert view.by_role(D, "small") == [] and view.by_role(P, "none-such") == []
    view.apply(Event(type=Event.EVENT_TYPE_PUT, workers=[w("d2", D, "small"), w("p1", P, "small")]))  # p1 moved
    assert ids(view.by_role(D, "small")) == ["d2"] and ids(view.by_role(P, "small")) == ["p1", "p2"]
    assert view.by_role(P, "big") == []
    view.apply(Event(type=Event.EVENT_TYPE_DELETE, workers=[w("p2", P, "small")]))
    assert ids(view.by_role(P, "small")) == ["p1"] and ids(view.by_role(P)) == ["p1"]
    view.apply(Event(type=Event.EVENT_TYPE_SNAPSHOT, workers=[w("d9", D, "big")]))
    assert view.by_role(P) == [] and ids(view.by_role(D, "big")) == ["d9"]


async def test_a_turn_for_an_adapter_plans_on_the_workers_that_loaded_it():
    view = WorkerView(registry=None)
    with_sql = w("p1", P, "big")
    with_sql.adapters.add(name="big-sql", id=1)
    view.apply(Event(type=Event.EVENT_TYPE_SNAPSHOT, workers=[with_sql, w("p2", P, "big")]))
    assert ids(view.by_role(P, "big-sql")) == ["p1"] and ids(view.by_role(P, "big")) == ["p1", "p2"]
    unloaded = w("p1", P, "big")  # the agent registered again without the adapter
    view.apply(Event(type=Event.EVENT_TYPE_PUT, workers=[unloaded]))
    assert view.by_role(P, "big-sql") == []


def test_the_gateways_adapters_follow_the_workers_registrations():
    """services/gateway/turns/adapters.py: adapter -> the base models of the live workers that registered it,
    rebuilt when the view changes (an adapter loaded or unloaded while a worker runs: it registers again)."""
    from kvshuttle.services.gateway.turns.adapters import RegisteredAdapters

    def lora(worker: common_pb2.Worker, *names: str) -> common_pb2.Worker:
        worker.adapters.extend(common_pb2.LoraAdapter(name=n, id=i + 1, path=f"/a/{n}") for i, n in enumerate(names))
        return worker

    view = WorkerView(registry=None)
    adapters = RegisteredAdapters(view)
    assert adapters.adapters() == {}
    view.apply(Event(type=Event.EVENT_TYPE_SNAPSHOT, workers=[lora(w("p1", P, "big"), "sql"),
                                                               lora(w("d1", D, "big"), "sql", "chat")]))
    assert adapters.adapters() == {"sql": {"big"}, "chat": {"big"}}
    assert adapters.adapters() is adapters.adapters()  # built once per change
    view.apply(Event(type=Event.EVENT_TYPE_PUT, workers=[lora(w("d1", D, "big")), lora(w("p9", P, "small"), "sql")]))
    assert adapters.adapters() == {"sql": {"big", "small"}}
    view.apply(Event(type=Event.EVENT_TYPE_DELETE, workers=[w("p1", P, "big"), w("p9", P, "small")]))
    assert adapters.adapters() == {}
