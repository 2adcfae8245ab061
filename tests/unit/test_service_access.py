"""control_plane/service_access.py: service identities from certificate names, and which identity may call which
internal method (the rules services/common/caller_check.py applies; tests/integration/test_tls.py on real servers)."""

from __future__ import annotations

import pytest
from kvshuttle.control_plane.service_access import (
    GOVERNED_SERVICES,
    RULES,
    WORKER_FIELDS,
    Caller,
    caller_of,
    governed,
    refusal,
)
from kvshuttle.v1 import registry_pb2, scheduler_pb2

REG, SCHED = "/kvshuttle.v1.SessionRegistry/", "/kvshuttle.v1.TransferScheduler/"


def _methods():
    for module in (registry_pb2, scheduler_pb2):
        for service in module.DESCRIPTOR.services_by_name.values():
            for method in service.methods:
                yield f"/{service.full_name}/{method.name}", method


def test_every_method_of_the_internal_apis_has_its_callers_and_none_streams_its_requests():
    methods = dict(_methods())
    assert {m.rpartition("/")[0].strip("/") for m in methods} == set(GOVERNED_SERVICES)
    assert set(methods) == set(RULES), set(methods) ^ set(RULES)
    assert not [m for m, d in methods.items() if d.client_streaming], "caller_check refuses client-streaming calls"
    for method, path in WORKER_FIELDS.items():  # the field each names really is a string field of its request
        descriptor = methods[method].input_type
        for name in path[:-1]:
            descriptor = descriptor.fields_by_name[name].message_type
        assert descriptor.fields_by_name[path[-1]].type == descriptor.fields_by_name[path[-1]].TYPE_STRING


@pytest.mark.parametrize(("name", "caller"), [
    ("worker", Caller("worker")), ("worker:decode-0", Caller("worker", "decode-0")), (" gateway ", Caller("gateway")),
    ("admin", Caller("admin")), ("worker:", None), ("client", None), ("", None), ("Gateway", None),
    ("kvshuttle.internal", None), (":worker", None)])
def test_a_certificates_common_name_states_a_role_and_maybe_a_name(name, caller):
    assert caller_of(name) == caller


@pytest.mark.parametrize(("method", "allowed"), [
    ("RegisterWorker", {"worker"}), ("KeepAlive", {"worker"}), ("DeregisterWorker", {"worker"}),
    ("ListWorkers", {"gateway", "scheduler"}), ("WatchWorkers", {"gateway", "scheduler"}),
    ("GetSession", {"gateway", "scheduler"}), ("ClaimSession", {"gateway", "scheduler"}),
    ("DeleteSession", {"gateway", "scheduler"}), ("RecordTurn", {"gateway"}), ("FindSession", {"gateway"}),
    ("PutResponse", {"gateway"}), ("GetResponse", {"gateway"}), ("DeleteResponse", {"gateway"})])
def test_who_may_call_each_registry_method(method, allowed):
    for role in ("registry", "scheduler", "gateway", "worker", "admin"):
        why = refusal(REG + method, Caller(role))
        assert (why == "") == (role in allowed or role == "admin"), (method, role, why)
        if why:
            assert method in why and role in why and "or admin" in why


def test_who_may_call_each_scheduler_method():
    assert [r for r in ("gateway", "scheduler", "worker", "registry") if not refusal(SCHED + "PlanTurn", Caller(r))] \
        == ["gateway"]
    assert not refusal(SCHED + "ReportOutcome", Caller("gateway"))
    assert refusal(SCHED + "ReportOutcome", Caller("worker"))
    assert not refusal(SCHED + "GetStats", Caller("scheduler")) and not refusal(SCHED + "GetStats", Caller("admin"))
    assert "GetStats" in refusal(SCHED + "GetStats", Caller("worker"))


def test_a_caller_without_identity_is_refused_and_told_what_identity_is_needed():
    why = refusal(REG + "ListWorkers", None)
    assert "needs a kvshuttle service identity" in why and "Common Name" in why and "gateway" in why


def test_a_named_worker_certificate_acts_only_as_itself():
    me = Caller("worker", "p-1")
    assert refusal(REG + "RegisterWorker", me, "p-1") == ""
    assert "only act as worker 'p-1', not 'p-2'" in refusal(REG + "RegisterWorker", me, "p-2")
    assert refusal(REG + "KeepAlive", me, "")  # naming no worker is not naming itself
    assert refusal(REG + "RegisterWorker", Caller("worker"), "p-2") == ""  # a role certificate: any worker


def test_methods_outside_the_internal_apis_are_not_governed_and_unknown_ones_are_closed():
    for method in ("/grpc.health.v1.Health/Check", "/kvshuttle.v1.Gateway/ChatComplete",
                   "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo"):
        assert not governed(method) and refusal(method, None) == ""
    assert "admin only" in refusal(REG + "SomethingNew", Caller("gateway"))
    assert refusal(REG + "SomethingNew", Caller("admin")) == ""
