"""What the HTTP front ends' route handlers share: ApiState, kept on ``app.state.api`` and reached through the
request (``api_state(request)``), so every handler is a module-level function."""

from __future__ import annotations

from dataclasses import dataclass

from fastapi import Request
from kvshuttle.services.gateway.edge.auth import Principal
from kvshuttle.services.gateway.edge.http_metrics import ARRIVED
from kvshuttle.services.gateway.turns import TurnContext, TurnRequest, TurnRunner
from kvshuttle.services.gateway.turns.catalog import ModelCatalog, ServedModel

DEFAULT_RESPONSE_TTL_S = 86_400  # the gateway's --response-ttl-s
DEFAULT_CHAIN_MAX_RESPONSES = 10_000  # --response-chain-max-responses
DEFAULT_CHAIN_MAX_BYTES = 3 << 20  # --response-chain-max-bytes (within gRPC's default 4 MiB answer)


@dataclass(frozen=True)
class ApiState:
    """The served models (each with its turn runner and turn builder: tokenizer, parsers, default answer limit), and
    the Responses API's stored-response settings (``response_ttl_s`` after a conversation's last stored response;
    ``chain_max_*`` bound a conversation read back)."""

    models: ModelCatalog
    response_ttl_s: int = DEFAULT_RESPONSE_TTL_S
    chain_max_responses: int = DEFAULT_CHAIN_MAX_RESPONSES
    chain_max_bytes: int = DEFAULT_CHAIN_MAX_BYTES

    def model(self, name: str | None, who: Principal, *, required: bool = False) -> ServedModel:
        """The served model a request names, among those the caller's key may use (404 model_not_found when not
        served or not the caller's; none named: the default)."""
        return self.models.get(name, required=required, allowed=who.models)

    @property
    def runner(self) -> TurnRunner:
        """The default model's runner: what is not a turn (stored responses, ending sessions) goes through it (the
        registry is every model's)."""
        return self.models.default.runner


def api_state(request: Request) -> ApiState:
    """The app's ApiState (create_app puts it on ``app.state.api``)."""
    return request.app.state.api


async def prepare_turn(request: Request, req: TurnRequest) -> TurnContext:
    """The turn prepared by the runner, its ``request_ms`` timing set: from the request's arrival at the gateway's
    ASGI front to the turn's start (the part of a client's time to first token before the turn's own timings)."""
    turn = await api_state(request).models.runner_of(req).prepare(req)
    arrived = request.scope.get(ARRIVED)
    if arrived is not None:
        turn.timings["request_ms"] = round((turn.started - arrived) * 1000, 3)
    return turn
