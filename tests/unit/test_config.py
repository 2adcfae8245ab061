import dataclasses

import pytest
from kvshuttle.services.common.config import (
    ConfigError,
    TelemetryConfig,
    from_namespace,
    given,
    load,
    require,
    require_effect,
    setting,
)

from tests.support.configs import parse_config


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


@dataclasses.dataclass
class Dependent(TelemetryConfig):
    """``detail`` only matters when ``mode`` is 'b'."""

    ENV_PREFIX = "DEP_"
    mode: str = setting("a", "mode", choices=("a", "b"))
    detail: int = setting(1, "detail (mode b)")
    shared_detail: int = setting(1, "a detail set for a group of processes", env="SHARED_DETAIL")

    def validate(self):
        require_effect(self, "detail", self.mode == "b", "unless --mode is b")
        require_effect(self, "shared_detail", self.mode == "b", "unless --mode is b")


def test_a_setting_that_another_makes_a_no_op_is_refused_naming_both(capsys):
    with pytest.raises(ConfigError, match=r"^--detail has no effect unless --mode is b: drop it"):
        parse_config(Dependent, "--detail", "5")
    with pytest.raises(ConfigError, match=r"^--detail \(set by DEP_DETAIL\) has no effect unless --mode is b"):
        parse_config(Dependent, environ={"DEP_DETAIL": "5"})
    with pytest.raises(SystemExit) as exc:  # the command line: argparse's usage error, exit status 2
        load(Dependent, ["--detail", "5"])
    assert exc.value.code == 2 and "--detail has no effect unless --mode is b" in capsys.readouterr().err
    # the valid combinations
    assert parse_config(Dependent, "--detail", "5", "--mode", "b").detail == 5
    assert parse_config(Dependent, environ={"DEP_DETAIL": "5", "DEP_MODE": "b"}).detail == 5
    assert parse_config(Dependent).detail == 1  # not given
    assert parse_config(Dependent, "--detail", "1").detail == 1  # given its default: changes nothing either way
    # a shared env var (set for a group of processes, not for this command) and a config built in code pass
    assert parse_config(Dependent, environ={"SHARED_DETAIL": "7"}).shared_detail == 7
    Dependent(detail=5).validate()
    with pytest.raises(ConfigError, match="--shared-detail has no effect"):  # given on its command line it counts
        parse_config(Dependent, "--shared-detail", "7")


def test_given_says_where_each_setting_came_from():
    cfg = parse_config(Dependent, "--mode", "b", environ={"DEP_DETAIL": "3", "SHARED_DETAIL": "2"})
    assert given(cfg) == {"mode": "--mode", "detail": "DEP_DETAIL"}
    assert given(Dependent()) == {}
    assert "_config_given" not in repr(cfg) and dataclasses.asdict(cfg) == dataclasses.asdict(
        Dependent(mode="b", detail=3, shared_detail=2))


def test_server_settings_that_others_make_no_ops():
    from kvshuttle.services.registry.server import RegistryConfig
    from kvshuttle.services.scheduler.server import SchedulerConfig

    with pytest.raises(ConfigError, match="--census-interval-s has no effect without --metrics-listen"):
        parse_config(RegistryConfig, "--census-interval-s", "5")
    assert parse_config(RegistryConfig, "--census-interval-s", "5", "--metrics-listen", "127.0.0.1:0"
                        ).census_interval_s == 5
    for argv, words in [(["--load-timeout-s", "3", "--load-poll-interval-s", "0"], "--load-timeout-s has no effect "
                                                                                    "with --load-poll-interval-s 0"),
                        (["--no-kv-manage", "--kv-high-water", "0.9"], "--kv-high-water has no effect with "
                                                                        "--no-kv-manage"),
                        (["--no-kv-manage", "--kv-eviction-ranking", "lru"], "--kv-eviction-ranking has no effect"),
                        (["--learning", "local", "--learning-snapshot-interval-s", "5"],
                         "--learning-snapshot-interval-s has no effect with --learning local"),
                        (["--history-store", "sqlite:/tmp/h.db"], "--history-store has no effect without "
                                                                  "--etcd-endpoints"),
                        (["--key-prefix", "/other/"], "--key-prefix has no effect without --etcd-endpoints")]:
        with pytest.raises(ConfigError, match=words):
            parse_config(SchedulerConfig, *argv)
    etcd = ["--etcd-endpoints", "127.0.0.1:2379"]
    cfg = parse_config(SchedulerConfig, "--load-timeout-s", "3", "--kv-high-water", "0.9", "--learning-snapshot-interval-s",
                       "5", "--history-store", "sqlite:/tmp/h.db", "--key-prefix", "/other/", *etcd)
    assert (cfg.load_timeout_s, cfg.kv_high_water, cfg.key_prefix) == (3, 0.9, "/other/")
    # what the chart passes (its defaults, kv-manage possibly off) and what bench-services passes ('' for none)
    parse_config(SchedulerConfig, "--no-kv-manage", "--kv-high-water", "0.8", "--kv-eviction-ranking", "value")
    parse_config(SchedulerConfig, "--etcd-endpoints", "", "--history-store", "", "--load-poll-interval-s", "0")
    # the shared env vars the registry's settings come from (KVSHUTTLE_HISTORY_STORE, ...) are not the scheduler's
    parse_config(SchedulerConfig, environ={"KVSHUTTLE_HISTORY_STORE": "sqlite:/tmp/h.db",
                                           "KVSHUTTLE_REGISTRY_KEY_PREFIX": "/other/"})
