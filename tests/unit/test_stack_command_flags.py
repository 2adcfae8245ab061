"""`kvshuttle bench`, `bench-policies` and `soak`: a setting that another makes a no-op is a usage error naming
both (services/common/config.py's require_effect); the valid combinations still load. No stack is started."""

from __future__ import annotations

import pytest
from kvshuttle.services.common.config import ConfigError, load
from kvshuttle.services.devtools.bench.multiturn import BenchConfig
from kvshuttle.services.devtools.bench.policy_sweep import PolicySweepConfig
from kvshuttle.services.devtools.bench.soak import SoakConfig
from kvshuttle.services.devtools.stack import STACK_ONLY, StackConfig

from tests.support.configs import parse_config

URL = ["--gateway-url", "http://127.0.0.1:8000"]


@pytest.mark.parametrize("cls", [BenchConfig, PolicySweepConfig, SoakConfig])
def test_stack_settings_have_no_effect_with_a_gateway_url(cls):
    with pytest.raises(ConfigError, match="--prefill-workers has no effect with --gateway-url"):
        parse_config(cls, *URL, "--prefill-workers", "2")
    with pytest.raises(ConfigError, match="--gpus has no effect with --gateway-url"):
        parse_config(cls, *URL, "--gpus", "0,1")
    assert parse_config(cls, "--prefill-workers", "2").prefill_workers == 2  # the stack it starts
    assert parse_config(cls, *URL).gateway_url == URL[1]


def test_the_stack_only_settings_are_stack_settings():
    assert set(STACK_ONLY) <= set(StackConfig.__dataclass_fields__)


def test_bench_settings_that_others_make_no_ops(tmp_path, capsys):
    conversations = tmp_path / "conversations.json"
    conversations.write_text("[]")
    for argv, words in [
        (["--ideal-address", "127.0.0.1:50070"], "--ideal-address has no effect without --gateway-url"),
        ([*URL, "--modes", "pull", "--ideal-address", "127.0.0.1:50070"], "--ideal-address has no effect without "
                                                                          "ideal in --modes"),
        (["--modes", "pull,recompute", "--ideal-cpus", "0"], "--ideal-cpus has no effect without ideal in --modes"),
        ([*URL, "--ideal-address", "127.0.0.1:50070", "--ideal-cpus", "0"], "--ideal-cpus has no effect with "
                                                                             "--gateway-url"),
        (["--smg-silence-s", "30"], "--smg-silence-s has no effect without smg in --modes"),
        (["--smg-extra-args=--x"], "--smg-extra-args has no effect without smg in --modes"),
        (["--conversation-file", str(conversations), "--system-tokens", "10"], "--system-tokens has no effect with "
                                                                               "--conversation-file"),
        ([*URL, "--dtype", "bfloat16"], "--dtype has no effect with --gateway-url"),
    ]:
        with pytest.raises(ConfigError, match=words):
            parse_config(BenchConfig, *argv)
    with pytest.raises(SystemExit) as exc:
        load(BenchConfig, ["--smg-silence-s", "30"])
    assert exc.value.code == 2 and "--smg-silence-s has no effect without smg in --modes" in capsys.readouterr().err
    smg = tmp_path / "smg"
    smg.write_text("")
    for argv in ([*URL, "--ideal-address", "127.0.0.1:50070", "--tool-call-parser", "hermes"],
                 ["--modes", "pull,ideal", "--ideal-cpus", "0"],
                 ["--modes", "pull,smg", "--smg-bin", str(smg), "--smg-silence-s", "30", "--smg-extra-args=--x"],
                 [*URL, "--modes", "pull,smg", "--smg-bin", str(smg), "--work-dir", str(tmp_path)],
                 ["--conversation-file", str(conversations), "--max-turns", "4", "--conversations", "2"],
                 ["--system-tokens", "10", "--seed", "3"]):
        parse_config(BenchConfig, *argv)


def test_policy_sweep_settings_that_others_make_no_ops():
    with pytest.raises(ConfigError, match="--scheduler-address has no effect without --gateway-url"):
        parse_config(PolicySweepConfig, "--scheduler-address", "127.0.0.1:50052")
    with pytest.raises(ConfigError, match="--cost-params has no effect with --gateway-url"):
        parse_config(PolicySweepConfig, *URL, "--cost-params", "explore_every=5")
    parse_config(PolicySweepConfig, *URL, "--scheduler-address", "127.0.0.1:50052")
    parse_config(PolicySweepConfig, "--cost-params", "explore_every=5")


def test_soak_settings_that_others_make_no_ops():
    with pytest.raises(ConfigError, match="--work-dir has no effect with --gateway-url"):
        parse_config(SoakConfig, *URL, "--work-dir", "var/elsewhere")
    with pytest.raises(ConfigError, match=r"--etcd-members \(set by KVSHUTTLE_SOAK_ETCD_MEMBERS\) has no effect"):
        parse_config(SoakConfig, *URL, environ={"KVSHUTTLE_SOAK_ETCD_MEMBERS": "3"})
    # the model directory and telemetry are shared env vars, set for every process: never refused
    parse_config(SoakConfig, *URL, "--sessions", "4", environ={"KVSHUTTLE_MODEL_DIR": "var/models/x",
                                                               "KVSHUTTLE_OTLP_ENDPOINT": "http://x:4317"})


def test_more_models_for_the_local_stack(tmp_path):
    """`kvshuttle up --models` (issue #37): each more model's variant, its options, where it is built, and the
    gateway's --models entry for it; a variant that is unknown, served twice or asked with --gpus is refused."""
    from kvshuttle.services.devtools.stack import Stack

    cfg = parse_config(StackConfig, "--models", "tiny-tools, agent?tool_call_parser=hermes&reasoning_parser=qwen3")
    assert cfg.more_models() == [("tiny-tools", ""), ("agent", "tool_call_parser=hermes&reasoning_parser=qwen3")]
    stack = Stack(parse_config(StackConfig, "--work-dir", str(tmp_path), "--max-model-len", "4096",
                               "--models", "agent?max_model_len=2048"))
    where = Stack.more_model_dir("agent")
    assert where.parts[-3:] == ("var", "models", "agent")
    assert stack._model_spec("tiny-tools", "", where) == f"tiny-tools={where}?max_model_len=4096"
    assert stack._model_spec("agent", "max_model_len=2048", where) == f"agent={where}?max_model_len=2048"
    from kvshuttle.services.gateway.model_specs import parse_models

    assert [s.name for s in parse_models(stack._model_spec("agent", "tool_call_parser=hermes", where))] == ["agent"]
    for argv, words in ((["--models", "huge"], "unknown variant 'huge'"),
                        (["--models", "tiny"], "'tiny' is served twice"),
                        (["--models", "agent,agent"], "'agent' is served twice"),
                        (["--models", "agent", "--gpus", "0,1"], "CPU workers only")):
        with pytest.raises(ConfigError, match=words):
            parse_config(StackConfig, *argv)
