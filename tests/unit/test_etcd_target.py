"""The gRPC target the etcd store dials: IP lists round-robin, a single name through DNS (a chart's etcd Service)."""

from __future__ import annotations

import pytest
from kvshuttle.services.store.etcd_channel import grpc_target, resolved_endpoints


def test_addresses_are_dialled_round_robin_and_a_name_through_dns():
    assert grpc_target(["127.0.0.1:2379", "10.0.0.2:2379"]) == "ipv4:127.0.0.1:2379,10.0.0.2:2379"
    assert grpc_target(["localhost:2379"]) == "ipv4:127.0.0.1:2379"
    assert grpc_target(["kvshuttle-etcd:2379"]) == "dns:///kvshuttle-etcd:2379"
    with pytest.raises(ValueError, match="resolve them first"):
        grpc_target(["etcd-0.etcd:2379", "etcd-1.etcd:2379"])


async def test_several_names_are_resolved_to_addresses():
    assert await resolved_endpoints(["localhost:2379", "127.0.0.1:2380"]) == ["127.0.0.1:2379", "127.0.0.1:2380"]
    assert await resolved_endpoints(["kvshuttle-etcd:2379"]) == ["kvshuttle-etcd:2379"]  # one name: gRPC's DNS
