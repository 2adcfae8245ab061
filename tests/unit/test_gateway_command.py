"""`kvshuttle gateway --scheduler local`: the embedded scheduler's flags are checked with the gateway's own, and name
--scheduler-args when they are wrong; its defaults come from the gateway (registry, TLS) and a free loopback port."""

from __future__ import annotations

import pytest
from kvshuttle.services.commands.gateway import GatewayCommandConfig
from kvshuttle.services.common.config import ConfigError, from_namespace
from kvshuttle.services.common.tls import TlsConfig
from kvshuttle.services.scheduler.in_process import embedded_config


@pytest.fixture
def model_dir(tmp_path):
    (tmp_path / "tokenizer.json").write_text("{}")
    return str(tmp_path)


def gateway(model_dir: str, **env: str) -> GatewayCommandConfig:
    return from_namespace(GatewayCommandConfig, environ={"KVSHUTTLE_MODEL_DIR": model_dir, **env})


@pytest.mark.parametrize(("env", "message"), [
    ({"KVSHUTTLE_SCHEDULER_ADDRESS": "local", "KVSHUTTLE_GATEWAY_SCHEDULER_ARGS": "--bogus 1"},
     "--scheduler-args: unrecognized arguments: --bogus 1"),
    ({"KVSHUTTLE_SCHEDULER_ADDRESS": "local", "KVSHUTTLE_GATEWAY_SCHEDULER_ARGS": "--kv-high-water 2"},
     "--scheduler-args: --kv-high-water"),
    ({"KVSHUTTLE_SCHEDULER_ADDRESS": "local", "KVSHUTTLE_GATEWAY_SCHEDULER_ARGS": "--policy 'cost"},
     "--scheduler-args: No closing quotation"),
    ({"KVSHUTTLE_GATEWAY_SCHEDULER_ARGS": "--policy cost"}, "it needs --scheduler local"),
])
def test_wrong_embedded_scheduler_flags_fail_at_start_naming_the_flag(model_dir, env, message):
    with pytest.raises(ConfigError, match=message.replace("'", ".")):
        gateway(model_dir, **env)


def test_the_embedded_scheduler_defaults_to_the_gateways_registry_and_a_free_loopback_port(model_dir):
    cfg = gateway(model_dir, KVSHUTTLE_SCHEDULER_ADDRESS="local", KVSHUTTLE_REGISTRY_ADDRESS="10.0.0.5:50051",
                  KVSHUTTLE_GATEWAY_SCHEDULER_ARGS="--policy threshold --candidates 8")
    embedded = embedded_config(cfg.scheduler_args, registry=cfg.registry, tls=cfg, environ={})
    assert (embedded.listen, embedded.registry, embedded.policy, embedded.candidates) == (
        "127.0.0.1:0", "10.0.0.5:50051", "threshold", 8)
    given = embedded_config("--listen 127.0.0.1:7000 --registry r:1", registry="x:2", tls=TlsConfig(), environ={})
    assert (given.listen, given.registry) == ("127.0.0.1:7000", "r:1")
    from_env = embedded_config("", registry="x:2", tls=TlsConfig(),
                               environ={"KVSHUTTLE_SCHEDULER_LISTEN": "127.0.0.1:7001",
                                        "KVSHUTTLE_SCHEDULER_POLICY": "threshold"})
    assert (from_env.listen, from_env.policy) == ("127.0.0.1:7001", "threshold")
