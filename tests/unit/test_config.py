import dataclasses

import pytest

from services.config import ConfigError, TelemetryConfig, from_namespace, load, require, setting


@dataclasses.dataclass
class Demo(TelemetryConfig):
    ENV_PREFIX = "DEMO_"
    port: int = setting(80, "port")
    ratio: float = setting(0.5, "ratio")
    fast: bool = setting(False, "fast")
    shared: str = setting("a", "shared", env="SHARED_NAME")

    def validate(self):
        require(self.port > 0, "--port must be > 0")


def test_precedence_flag_over_env_over_default(monkeypatch):
    monkeypatch.setenv("DEMO_PORT", "81")
    monkeypatch.setenv("SHARED_NAME", "b")
    monkeypatch.setenv("DEMO_FAST", "yes")
    cfg = load(Demo, ["--ratio", "0.25"])
    assert (cfg.port, cfg.ratio, cfg.fast, cfg.shared) == (81, 0.25, True, "b")
    assert load(Demo, ["--port", "82", "--no-fast"]).port == 82
    assert load(Demo, ["--no-fast"]).fast is False


def test_bad_values_name_the_env_var():
    with pytest.raises(ConfigError, match="DEMO_PORT"):
        from_namespace(Demo, environ={"DEMO_PORT": "eighty"})
    with pytest.raises(ConfigError, match="port must be > 0"):
        from_namespace(Demo, environ={"DEMO_PORT": "-1"})
    with pytest.raises(ConfigError, match="KVSHUTTLE_TRACES_EXPORTER"):
        from_namespace(Demo, environ={"KVSHUTTLE_TRACES_EXPORTER": "jaeger"})


def test_bad_flag_exits_with_usage(capsys):
    with pytest.raises(SystemExit):
        load(Demo, ["--port", "x"])
    assert "--port" in capsys.readouterr().err


def test_scheduler_policy_parameters_are_checked_at_start():
    from services.config import ConfigError
    from services.scheduler.server import SchedulerConfig

    SchedulerConfig(policy="cost", policy_params="forgetting=0.9").validate()
    with pytest.raises(ConfigError, match="unknown parameter"):
        SchedulerConfig(policy="cost", policy_params="bandwidth=3").validate()
    with pytest.raises(ConfigError, match="pull-threshold-tokens must be >= 1"):
        SchedulerConfig(pull_threshold_tokens=0).validate()
