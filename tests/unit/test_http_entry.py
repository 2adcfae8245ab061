"""The front ends' catch-all (edge/http_entry.py, apis/grpc_api.py): an unexpected error is a 500 in the API's own
error shape (gRPC: INTERNAL with a message), logged with its traceback; a stream that fails past its headers ends with
the stream's own error event, then cleanly. The front ends run on stand-in runners that fail on purpose."""

from __future__ import annotations

import json
import logging

import grpc
import httpx
import pytest
from kvshuttle.services.gateway.apis.anthropic.routes import add_anthropic_routes
from kvshuttle.services.gateway.apis.grpc_api import GatewayServicer
from kvshuttle.services.gateway.apis.http_app import create_app
from kvshuttle.services.gateway.apis.responses.routes import add_responses_routes
from kvshuttle.services.gateway.edge.auth import KeyRing
from kvshuttle.services.gateway.edge.http_guard import HttpGuard
from kvshuttle.services.gateway.turns import Delta
from kvshuttle.v1 import gateway_pb2

from tests.support.grpc_context import Aborted, Context
from tests.support.turn_fakes import AnsweringRunner

HI = [{"role": "user", "content": "hi"}]


class FailingRunner(AnsweringRunner):
    """Fails with a bug (not a TurnError): in prepare, or in decode after ``after`` deltas."""

    def __init__(self, after: int | None = None):
        super().__init__("hello there")
        self.after = after

    async def prepare(self, req):
        if self.after is None:
            raise RuntimeError("a bug in prepare")
        return await super().prepare(req)

    async def decode(self, turn):
        sent = 0
        async for event in super().decode(turn):
            if isinstance(event, Delta) and sent == self.after:
                raise RuntimeError("a bug in decode")
            sent += isinstance(event, Delta)
            yield event


def app_for(runner):
    app = create_app(runner, "tiny", 8)
    add_anthropic_routes(app)
    add_responses_routes(app)
    return HttpGuard(app, KeyRing(), 1 << 20)  # the real guard, open: every caller the default tenant


async def post(runner, path: str, body: dict) -> httpx.Response:
    transport = httpx.ASGITransport(app=app_for(runner), raise_app_exceptions=False)
    async with httpx.AsyncClient(transport=transport, base_url="http://gw") as client:
        return await client.post(path, json=body)


ROUTES = [("/v1/chat/completions", {"messages": HI}), ("/v1/completions", {"prompt": "hi"}),
          ("/v1/responses", {"input": "hi", "store": False}),
          ("/v1/messages", {"model": "tiny", "max_tokens": 4, "messages": HI})]


@pytest.mark.parametrize("path, body", ROUTES)
async def test_an_unexpected_error_is_a_json_500_in_the_apis_shape_and_logged(path, body, caplog):
    with caplog.at_level(logging.ERROR):
        resp = await post(FailingRunner(), path, body)
    assert resp.status_code == 500 and resp.headers["content-type"] == "application/json", resp.text
    if path == "/v1/messages":
        assert resp.json() == {"type": "error", "error": {"type": "api_error", "message": "internal error"}}
    else:
        assert resp.json()["error"] == {"message": "internal error", "type": "server_error", "code": 500}
    assert "a bug in prepare" in caplog.text  # the traceback is in the log, not in the answer


def events(text: str) -> list[str]:
    return [line.removeprefix("data: ") for line in text.splitlines() if line.startswith("data: ")]


@pytest.mark.parametrize("path, body", ROUTES)
async def test_a_stream_that_fails_past_its_headers_ends_with_an_error_event(path, body, caplog):
    with caplog.at_level(logging.ERROR):
        resp = await post(FailingRunner(after=1), path, {**body, "stream": True})
    assert resp.status_code == 200 and "a bug in decode" in caplog.text
    data = events(resp.text)
    if path.startswith("/v1/chat") or path == "/v1/completions":
        assert json.loads(data[-2]) == {"error": {"message": "internal error", "type": "server_error", "code": 500}}
        assert data[-1] == "[DONE]"
    elif path == "/v1/responses":
        last = json.loads(data[-1])
        assert last["type"] == "error" and last["code"] == "500" and last["message"] == "internal error", last
    else:
        assert json.loads(data[-1]) == {"type": "error", "error": {"type": "api_error", "message": "internal error"}}
    assert len(data) > 2  # what was sent before the failure is kept


@pytest.mark.parametrize("method", ["Complete", "CompleteStream"])
async def test_the_grpc_api_answers_an_unexpected_error_with_internal(method, caplog):
    servicer = GatewayServicer(FailingRunner(after=None if method == "Complete" else 0), "tiny", 8)
    request = gateway_pb2.CompleteRequest(prompt="hi")
    with caplog.at_level(logging.ERROR), pytest.raises(Aborted) as err:
        if method == "Complete":
            await servicer.Complete(request, Context())
        else:
            async for _ in servicer.CompleteStream(request, Context()):
                pass
    code, details = err.value.args
    assert code == grpc.StatusCode.INTERNAL and details.startswith("internal error"), err.value
    assert "a bug in" in caplog.text


async def test_a_responses_json_schema_format_is_taken():
    """text.format's ``schema`` (a field aliased in the model) is the format's, not an unsupported field."""
    runner = AnsweringRunner('{"q": "x"}')
    resp = await post(runner, "/v1/responses", {"input": "hi", "store": False, "text": {"format": {
        "type": "json_schema", "name": "x", "schema": {"type": "object", "properties": {"q": {"type": "string"}}}}}})
    assert resp.status_code == 200, resp.text
    assert runner.requests[0].constraint is not None
