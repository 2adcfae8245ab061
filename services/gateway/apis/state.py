"""What the HTTP front ends' route handlers share: ApiState, kept on ``app.state.api`` and reached through the
request (``api_state(request)``), so every handler is a module-level function."""

from __future__ import annotations

from dataclasses import dataclass

from fastapi import Request
from kvshuttle.services.gateway.turns import TurnRunner
from kvshuttle.services.gateway.turns.builder import TurnBuilder

DEFAULT_RESPONSE_TTL_S = 86_400  # the gateway's --response-ttl-s
DEFAULT_CHAIN_MAX_RESPONSES = 10_000  # --response-chain-max-responses
DEFAULT_CHAIN_MAX_BYTES = 3 << 20  # --response-chain-max-bytes (within gRPC's default 4 MiB answer)


@dataclass(frozen=True)
class ApiState:
    """The turn runner, the turn builder (the served model, its default answer limit and parsers), and the Responses
    API's stored-response settings (``response_ttl_s`` after a conversation's last stored response; ``chain_max_*``
    bound a conversation read back)."""

    runner: TurnRunner
    builder: TurnBuilder
    response_ttl_s: int = DEFAULT_RESPONSE_TTL_S
    chain_max_responses: int = DEFAULT_CHAIN_MAX_RESPONSES
    chain_max_bytes: int = DEFAULT_CHAIN_MAX_BYTES

    @property
    def served_model(self) -> str:
        return self.builder.served_model


def api_state(request: Request) -> ApiState:
    """The app's ApiState (create_app puts it on ``app.state.api``)."""
    return request.app.state.api
