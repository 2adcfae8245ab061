import dataclasses

import pytest
from kvshuttle.services.common.config import ConfigError, TelemetryConfig, from_namespace, load, require, setting


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
    from kvshuttle.services.common.config import ConfigError
    from kvshuttle.services.scheduler.server import SchedulerConfig

    cfg = SchedulerConfig(policy="cost", policy_params="explore_every=5", cost_model_params="window=20",
                          policies="t64=threshold:pull_threshold_tokens=64; always-pull=threshold:pull_threshold_tokens=1")
    cfg.validate()
    planner = cfg.make_planner()
    assert list(planner.policies) == ["cost", "t64", "always-pull"] and planner.default == "cost"
    assert planner.policy("t64").safety.pull_threshold_tokens == 64 and planner.model.prior.window == 20
    for bad, words in [({"policy": "cost", "policy_params": "bandwidth=3"}, "unknown parameter"),
                       ({"policies": "t=threshold; t=cost"}, "used twice"),
                       ({"policies": "oops"}, "name=kind"),
                       ({"cost_model_params": "window=1"}, "window"),
                       ({"load_poll_interval_s": -1}, "load-poll-interval-s")]:
        with pytest.raises(ConfigError, match=words):
            SchedulerConfig(**bad).validate()
    with pytest.raises(ConfigError, match="pull-threshold-tokens must be >= 1"):
        SchedulerConfig(pull_threshold_tokens=0).validate()


def test_stack_etcd_members_is_one_or_three():
    from kvshuttle.services.devtools.stack import StackConfig

    assert from_namespace(StackConfig, environ={"KVSHUTTLE_STACK_ETCD_MEMBERS": "3"}).etcd_members == 3
    assert load(StackConfig, []).etcd_members == 1
    with pytest.raises(ConfigError, match="etcd-members must be 1 or 3"):
        from_namespace(StackConfig, environ={"KVSHUTTLE_STACK_ETCD_MEMBERS": "2"})
