"""The gateway's event loop (issue #36): uvloop unless ``--event-loop asyncio`` (uvloop measured cheaper per streamed
token, docs/performance.md); services without the setting keep asyncio's own."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import signal

import pytest
from kvshuttle.services.common.config import ConfigError, load
from kvshuttle.services.common.grpc_server import service_main
from kvshuttle.services.gateway.server import GatewayConfig
from kvshuttle.services.registry.server import RegistryConfig


def loop_module(config_cls: type, argv: list[str]) -> str:
    """The module of the loop ``service_main`` runs the service in (the service stops itself with SIGTERM)."""
    seen: list[str] = []

    class Service:
        async def start(self) -> None:
            seen.append(type(asyncio.get_running_loop()).__module__)
            os.kill(os.getpid(), signal.SIGTERM)

        async def stop(self) -> None:
            pass

    service_main(config_cls, argv, "test", "test", lambda cfg: Service())
    return seen[0]


def test_the_gateway_runs_on_uvloop_unless_told_asyncio(monkeypatch, tmp_path):
    monkeypatch.delenv("KVSHUTTLE_GATEWAY_EVENT_LOOP", raising=False)
    (tmp_path / "tokenizer.json").write_text("{}")  # what the config checks; the stand-in service loads nothing
    model = ["--model-dir", str(tmp_path)]
    assert loop_module(GatewayConfig, model).startswith("uvloop")
    assert loop_module(GatewayConfig, [*model, "--event-loop", "asyncio"]).startswith("asyncio")
    monkeypatch.setenv("KVSHUTTLE_GATEWAY_EVENT_LOOP", "asyncio")
    assert loop_module(GatewayConfig, model).startswith("asyncio")


def test_a_service_without_the_setting_keeps_asyncio():
    assert not any(f.name == "event_loop" for f in dataclasses.fields(RegistryConfig))
    assert loop_module(RegistryConfig, []).startswith("asyncio")


def test_an_unknown_event_loop_is_a_config_error():
    with pytest.raises((ConfigError, SystemExit)):
        load(GatewayConfig, ["--model-dir", "x", "--event-loop", "tokio"], prog="test")
