"""Finding spans in a list of span dicts (``kvshuttle.services.commands.trace_view.span_dicts``' shape) and checking the tree."""

from __future__ import annotations


def one(spans: list[dict], name: str, **attributes) -> dict:
    """The one span called ``name`` whose attributes include ``attributes`` (fails on none or several)."""
    found = [s for s in spans if s["name"] == name
             and all(s["attributes"].get(k) == v for k, v in attributes.items())]
    assert len(found) == 1, f"{len(found)} spans {name!r} with {attributes}: {[s['span_id'] for s in found]}"
    return found[0]


def in_trace(spans: list[dict], trace_id: str) -> list[dict]:
    return [s for s in spans if s["trace_id"] == trace_id]


def children(spans: list[dict], parent: dict) -> list[dict]:
    return [s for s in spans if s["parent_id"] == parent["span_id"] and s["trace_id"] == parent["trace_id"]]


def child(spans: list[dict], parent: dict, name: str) -> dict:
    """The one child of ``parent`` called ``name``."""
    found = [s for s in children(spans, parent) if s["name"] == name]
    assert len(found) == 1, (f"{parent['name']} has {len(found)} children {name!r}; its children: "
                             f"{[s['name'] for s in children(spans, parent)]}")
    return found[0]


def rpc_hop(spans: list[dict], parent: dict, service: str, method: str, server: str | None = None) -> dict:
    """The gRPC call from ``parent``: its CLIENT span (OpenTelemetry's rpc.* and server.* attributes; at ``server``,
    host:port, when given). Returns the SERVER span under it when the server traces, else the client span."""
    client = child(spans, parent, f"/{service}/{method}")
    attrs = client["attributes"]
    assert client["kind"] == "client" and attrs["rpc.system"] == "grpc", client
    assert attrs["rpc.service"] == service and attrs["rpc.method"] == method, attrs
    if server is not None:
        assert f"{attrs['server.address']}:{attrs['server.port']}" == server, attrs
    servers = children(spans, client)
    if not servers:
        return client
    assert [s["kind"] for s in servers] == ["server"], servers
    return servers[0]
