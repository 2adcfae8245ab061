"""The Helm chart: lint, render three value profiles, validate every manifest offline, reject broken values with a
readable message, and render exactly the command lines kvshuttle's own commands parse (the worker's vLLM command
line compared with `kvshuttle worker --print-vllm-command`)."""

from __future__ import annotations

import argparse
import copy
import json
import os
import re
import shutil
import subprocess
import sys
from functools import cache
from pathlib import Path

import pytest
import yaml
from kvshuttle.services.common.config import add_arguments, env_name, from_namespace
from kvshuttle.services.devtools.etcd_process import RETENTION_ARGS
from kvshuttle.services.devtools.stack import StackConfig
from kvshuttle.services.gateway.server import GatewayConfig
from kvshuttle.services.registry.server import RegistryConfig
from kvshuttle.services.scheduler.server import SchedulerConfig
from kvshuttle.workers.vllm_process import WorkerConfig

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "deploy/helm/kvshuttle"
PROFILES = sorted((ROOT / "deploy/helm/profiles").glob("*.yaml"))
PROFILE_IDS = [p.stem for p in PROFILES]
HELM = ROOT / ".venv/bin/helm"
RELEASE, NAMESPACE = "kvs", "serving"
CONFIGS = {"registry": RegistryConfig, "scheduler": SchedulerConfig, "gateway": GatewayConfig, "worker": WorkerConfig}
POD_ENV = {"POD_IP": "10.1.2.3", "POD_NAME": "kvs-kvshuttle-decode-7d9f-x2x4q"}


def helm(*args: str) -> subprocess.CompletedProcess:
    if not HELM.exists():
        pytest.fail(f"{HELM} is missing: `make install` (scripts/install_helm.sh) puts it there")
    return subprocess.run([str(HELM), *args], capture_output=True, text=True, timeout=120)


@cache
def rendered(profile: str, *extra: str) -> tuple[dict, ...]:
    out = helm("template", RELEASE, str(CHART), "--namespace", NAMESPACE,
               "-f", str(ROOT / f"deploy/helm/profiles/{profile}.yaml"), *extra)
    assert out.returncode == 0, out.stderr
    return tuple(d for d in yaml.safe_load_all(out.stdout) if d)


def objects(docs, kind: str) -> dict[str, dict]:
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == kind}


def kvshuttle_containers(docs) -> list[tuple[str, dict]]:
    """(command, container) of every container that runs `kvshuttle <command>`."""
    found = []
    for d in docs:
        if d["kind"] in ("Deployment", "StatefulSet"):
            for c in d["spec"]["template"]["spec"]["containers"]:
                if c.get("args") and c["args"][0] in CONFIGS:
                    found.append((c["args"][0], c))
    return found


def container_env(container: dict) -> dict[str, str]:
    """The container's environment as the process sees it (downward-API values faked, secrets left out)."""
    env = {}
    for e in container.get("env", []):
        if "value" in e:
            env[e["name"]] = str(e["value"])
        elif e.get("valueFrom", {}).get("fieldRef"):
            env[e["name"]] = POD_ENV[e["name"]]
    return env


def expand(args: list[str], env: dict[str, str]) -> list[str]:
    """Kubernetes' $(VAR) expansion in args."""
    return [re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: env.get(m.group(1), m.group(0)), a) for a in args]


@pytest.fixture(scope="module")
def pod_root(tmp_path_factory) -> Path:
    """What a pod has mounted, under a temp dir: the TLS and etcd secrets, the API keys and a model directory for
    each profile (the commands' own validation reads these files)."""
    from tests.support.certs import TestCA

    root = tmp_path_factory.mktemp("pod")
    ca = TestCA(root / "ca")
    for mount in ("tls", "etcd-tls", "http-tls"):
        d = root / "etc/kvshuttle" / mount
        d.mkdir(parents=True)
        files = ca.issue("kvshuttle.internal", hosts=("kvshuttle.internal",))
        shutil.copy(ca.ca_file, d / "ca.crt")
        shutil.copy(files.cert, d / "tls.crt")
        shutil.copy(files.key, d / "tls.key")
    (root / "etc/kvshuttle/etcd-auth").mkdir()
    (root / "etc/kvshuttle/etcd-auth/password").write_text("pw\n")
    secret = objects(rendered("gpu-4p4d-external-etcd-tls"), "Secret")[f"{RELEASE}-kvshuttle-api-keys"]
    (root / "etc/kvshuttle/api-keys").mkdir()
    (root / "etc/kvshuttle/api-keys/keys.json").write_text(secret["stringData"]["keys.json"])
    for profile in PROFILE_IDS:
        gateway = objects(rendered(profile), "Deployment")[f"{RELEASE}-kvshuttle-gateway"]
        model_dir = parse_flags(gateway["spec"]["template"]["spec"]["containers"][0]["args"])["--model-dir"]
        (root / model_dir.lstrip("/")).mkdir(parents=True, exist_ok=True)
        (root / model_dir.lstrip("/") / "tokenizer.json").write_text("{}")
    return root


def parse_flags(args: list[str]) -> dict[str, str]:
    return dict(a.split("=", 1) for a in args if a.startswith("--") and "=" in a)


def relocate(values, root: Path):
    """Point the pod's absolute mount paths (/etc/kvshuttle/..., /models/...) into ``root``."""
    fix = lambda v: re.sub(r"(?<![\w.])/(etc/kvshuttle|models)/", f"{root}/\\1/", v)  # noqa: E731
    return {k: fix(v) for k, v in values.items()} if isinstance(values, dict) else [fix(v) for v in values]


def parse(command: str, args: list[str], env: dict[str, str], root: Path | None = None):
    """Parse a container's flags and env with the command's own typed config, its validation included (unknown
    flags, bad values and unreadable certificate files fail here)."""
    cls = CONFIGS[command]
    parser = argparse.ArgumentParser(prog=f"kvshuttle {command}", exit_on_error=False)
    add_arguments(cls, parser)
    args = expand(args[1:], env)
    if root is not None:
        args, env = relocate(args, root), relocate(env, root)
    return from_namespace(cls, parser.parse_args(args), environ=env)


# --- lint, render, validate ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("profile", PROFILE_IDS)
def test_lint_strict(profile):
    out = helm("lint", "--strict", str(CHART), "-f", str(ROOT / f"deploy/helm/profiles/{profile}.yaml"))
    assert out.returncode == 0, out.stdout + out.stderr


@pytest.mark.parametrize("kube_version", ["1.37.0", "1.30.0"])
@pytest.mark.parametrize("profile", PROFILE_IDS)
def test_every_rendered_manifest_passes_strict_schema_validation(profile, kube_version, tmp_path):
    manifest = tmp_path / "rendered.yaml"
    manifest.write_text(yaml.safe_dump_all(rendered(profile)))
    out = subprocess.run([str(ROOT / ".venv/bin/kubernetes-validate"), "--strict", "--quiet", "-k", kube_version,
                          str(manifest)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    kinds = {d["kind"] for d in rendered(profile)}
    assert {"Deployment", "Service", "ServiceAccount"} <= kinds


def test_validation_catches_a_broken_manifest(tmp_path):
    """The offline validation above can fail: a wrong type and an unknown field are both rejected."""
    docs = [copy.deepcopy(d) for d in rendered("gpu-1p1d")]
    first, second = [d for d in docs if d["kind"] == "Deployment"][:2]
    first["spec"]["template"]["spec"]["containers"][0]["ports"][0]["containerPort"] = "fifty"
    second["spec"]["template"]["spec"]["containers"][0]["imagePullPolicyy"] = "Always"
    manifest = tmp_path / "broken.yaml"
    manifest.write_text(yaml.safe_dump_all(docs))
    out = subprocess.run([str(ROOT / ".venv/bin/kubernetes-validate"), "--strict", "--quiet", str(manifest)],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode != 0
    assert "containerPort" in out.stdout + out.stderr and "imagePullPolicyy" in out.stdout + out.stderr


def test_profiles_render_what_they_promise():
    cpu, one, four = rendered("cpu-dev"), rendered("gpu-1p1d"), rendered("gpu-4p4d-external-etcd-tls")
    # CPU dev: no accelerators requested, the offline model built in an init container, one etcd member.
    for d in objects(cpu, "Deployment").values():
        for c in d["spec"]["template"]["spec"]["containers"]:
            assert "nvidia.com/gpu" not in json.dumps(c.get("resources", {}))
    assert objects(cpu, "StatefulSet")[f"{RELEASE}-kvshuttle-etcd"]["spec"]["replicas"] == 1
    decode = objects(cpu, "Deployment")[f"{RELEASE}-kvshuttle-decode"]["spec"]["template"]["spec"]
    assert decode["initContainers"][0]["command"] == ["kvshuttle", "make-model", "/models/tiny"]
    # 1P1D: one GPU per worker, bundled 3-member etcd, gateway autoscaled.
    for role in ("prefill", "decode"):
        w = objects(one, "Deployment")[f"{RELEASE}-kvshuttle-{role}"]
        assert w["spec"]["replicas"] == 1
        assert w["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert objects(one, "StatefulSet")[f"{RELEASE}-kvshuttle-etcd"]["spec"]["replicas"] == 3
    assert f"{RELEASE}-kvshuttle-gateway" in objects(one, "HorizontalPodAutoscaler")
    # 4P4D: two GPUs per worker (tensor parallel 2), external etcd (no etcd StatefulSet), TLS everywhere.
    for role in ("prefill", "decode"):
        w = objects(four, "Deployment")[f"{RELEASE}-kvshuttle-{role}"]
        assert w["spec"]["replicas"] == 4
        assert w["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == 2
    assert sorted(objects(four, "StatefulSet")) == [f"{RELEASE}-kvshuttle-history"]
    for command, c in kvshuttle_containers(four):
        env = container_env(c)
        assert env["KVSHUTTLE_TLS_CA"] == "/etc/kvshuttle/tls/ca.crt", command
        if command != "worker":
            assert env["KVSHUTTLE_TLS_CERT"] and env["KVSHUTTLE_TLS_CLIENT_CA"], command
            assert c["livenessProbe"].get("exec") or c["livenessProbe"].get("httpGet"), command


# --- broken values ---------------------------------------------------------------------------------------------------

BROKEN = {
    "string replica count": ("prefill: {replicas: '3'}", ["/prefill/replicas", "got string, want integer"]),
    "missing model": ("model: {name: ''}", ["/model/name", "minLength"]),
    "pvc source without a claim": ("model: {pvc: {claimName: ''}}", ["/model/pvc/claimName"]),
    "misspelt worker setting": ("workers: {settings: {dtyp: float16}}", ["/workers/settings", "'dtyp' not allowed"]),
    "worker setting of the wrong type": ("decode: {settings: {decoder-kv-blocks-ttl: soon}}",
                                         ["/decode/settings/decoder-kv-blocks-ttl", "want integer"]),
    "worker setting outside its choices": ("workers: {settings: {kv-buffer-device: gpu}}",
                                           ["/workers/settings/kv-buffer-device", "'cpu', 'cuda', 'xpu'"]),
    "a flag the chart sets itself": ("registry: {settings: {listen: '0.0.0.0:1'}}",
                                     ["/registry/settings", "'listen' not allowed"]),
    "the history store given as a setting": ("scheduler: {settings: {history-store: 'redis://r:6379/0'}}",
                                             ["/scheduler/settings", "'history-store' not allowed"]),
    "own history store without its URL": ("historyStore: {bundled: false}",
                                          ["historyStore.bundled is false: set historyStore.url"]),
    "own history store URL left beside the bundled one": ("historyStore: {url: 'redis://r:6379/0'}",
                                                          ["set historyStore.bundled=false to use it"]),
    "history store URL and Secret both": (
        "historyStore: {bundled: false, url: 'redis://r:6379/0', urlSecret: {name: s}}",
        ["set historyStore.url or historyStore.urlSecret, not both"]),
    "history store URL that is no Redis": ("historyStore: {bundled: false, url: 'sqlite:/var/h.db'}",
                                           ["/historyStore/url", "does not match pattern"]),
    "unknown history store value": ("historyStore: {replicas: 2}",
                                    ["/historyStore", "'replicas' not allowed"]),
    "external etcd without endpoints": ("etcd: {mode: external}", ["/etcd/external/endpoints"]),
    "TLS without its secret": ("tls: {enabled: true}", ["/tls/secretName"]),
    "port out of range": ("gateway: {httpPort: 80000}", ["/gateway/httpPort", "maximum"]),
    "even etcd member count": ("etcd: {bundled: {replicas: 2}}", ["/etcd/bundled/replicas"]),
    "API key given in clear": ("gateway: {apiKeys: {entries: [{sha256: my-secret-key, tenant: a}]}}",
                               ["/gateway/apiKeys/entries/0/sha256", "does not match pattern"]),
    "GPU limit that contradicts tensor parallel": (
        "decode: {settings: {tensor-parallel-size: 2}, resources: {limits: {nvidia.com/gpu: 1}}}",
        ["decode.resources.limits[nvidia.com/gpu] is 1 but tensor-parallel-size is 2"]),
}


@pytest.mark.parametrize("case", sorted(BROKEN))
def test_broken_values_fail_with_a_message_naming_the_value(case, tmp_path):
    snippet, expected = BROKEN[case]
    values = tmp_path / "broken.yaml"
    values.write_text(snippet + "\n")
    out = helm("template", RELEASE, str(CHART), "-f", str(ROOT / "deploy/helm/profiles/gpu-1p1d.yaml"),
               "-f", str(values))
    assert out.returncode != 0, f"{case}: rendered anyway"
    for text in expected:
        assert text in out.stderr, f"{case}: {text!r} not in:\n{out.stderr}"
    assert "panic" not in out.stderr.lower()


def test_default_values_alone_ask_for_a_model():
    out = helm("lint", "--strict", str(CHART))
    assert out.returncode != 0
    assert "/model/name" in out.stdout + out.stderr


def test_settings_schema_is_generated_from_the_commands_configs():
    out = subprocess.run([sys.executable, str(ROOT / "deploy/helm/schema.py"), "--check"], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr


# --- one source of truth: the chart renders flags kvshuttle's commands parse ------------------------------------------

@pytest.mark.parametrize("profile", PROFILE_IDS)
def test_every_kvshuttle_container_parses_with_its_commands_config(profile, pod_root):
    """Each flag and KVSHUTTLE_* variable the chart renders is one the command knows, with a valid value."""
    containers = kvshuttle_containers(rendered(profile))
    assert sorted({c for c, _ in containers}) == ["gateway", "registry", "scheduler", "worker"]
    for command, c in containers:
        names = [e["name"] for e in c.get("env", [])]
        assert len(names) == len(set(names)), f"{profile} {command}: an env var set twice"
        env = container_env(c)
        known = {env_name(CONFIGS[command], f) for f in CONFIGS[command].__dataclass_fields__.values()}
        unknown = {k for k in env if k.startswith("KVSHUTTLE_")} - known
        assert not unknown, f"{profile} {command}: env {unknown} is no setting of kvshuttle {command}"
        parse(command, c["args"], env, pod_root)  # raises on an unknown flag, a bad value, a missing file


@pytest.mark.parametrize("profile", ["cpu-dev", "gpu-4p4d-external-etcd-tls"])
def test_a_gateway_planning_in_process_gets_the_schedulers_settings_etcd_and_history_store(profile, pod_root):
    """gateway.planInProcess: the gateway runs `--scheduler local` with scheduler.settings and the etcd prefix as
    --scheduler-args, and the etcd and history-store environment (and etcd secrets) the scheduler pods get; the
    embedded scheduler's own config parses it all, as `kvshuttle gateway` does."""
    from kvshuttle.services.scheduler.in_process import embedded_config

    docs = rendered(profile, "--set", "gateway.planInProcess=true", "--set", "scheduler.settings.candidates=8")
    containers = dict(kvshuttle_containers(docs))
    gateway, scheduler = containers["gateway"], containers["scheduler"]
    env = container_env(gateway)
    known = {env_name(cls, f) for cls in (GatewayConfig, SchedulerConfig) for f in cls.__dataclass_fields__.values()}
    assert not {k for k in env if k.startswith("KVSHUTTLE_")} - known
    cfg = parse("gateway", gateway["args"], env, pod_root)
    assert cfg.scheduler == "local"
    embedded = embedded_config(cfg.scheduler_args, registry=cfg.registry, tls=cfg, environ=relocate(env, pod_root))
    standalone = parse("scheduler", scheduler["args"], container_env(scheduler), pod_root)
    for field in ("etcd_endpoints", "key_prefix", "history_store", "policy", "kv_manage", "kv_high_water",
                  "kv_idle_limit_s", "candidates", "etcd_username", "etcd_ca"):
        assert getattr(embedded, field) == getattr(standalone, field), field
    assert embedded.etcd_endpoints and embedded.candidates == 8 and embedded.registry == cfg.registry
    mounts = {m["name"] for m in gateway.get("volumeMounts", [])}
    assert {m["name"] for m in scheduler.get("volumeMounts", []) if m["name"].startswith("etcd")} <= mounts
    off = dict(kvshuttle_containers(rendered(profile)))["gateway"]
    assert "--scheduler=local" not in off["args"] and "KVSHUTTLE_ETCD_ENDPOINTS" not in container_env(off)


@pytest.mark.parametrize("profile", PROFILE_IDS)
def test_services_dial_the_addresses_the_chart_serves(profile, pod_root):
    """Every address a component is given is a Service of this release, on a port a matching pod listens on."""
    docs = rendered(profile)
    services = objects(docs, "Service")
    listeners = {}  # (component label, port) of each container port
    for d in docs:
        if d["kind"] in ("Deployment", "StatefulSet"):
            component = d["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/component"]
            for c in d["spec"]["template"]["spec"]["containers"]:
                for p in c.get("ports", []):
                    listeners[(component, p["name"])] = p["containerPort"]

    def served(address: str) -> int:
        host, port = address.removeprefix("dns:///").rsplit(":", 1)  # dns:///: every replica (round robin)
        svc = services.get(host)
        if svc is None:  # an external etcd: nothing of ours to check
            return 0
        match = next(p for p in svc["spec"]["ports"] if p["port"] == int(port))
        component = svc["spec"]["selector"]["app.kubernetes.io/component"]
        return listeners[(component, match["targetPort"])]

    for command, c in kvshuttle_containers(docs):
        cfg = parse(command, c["args"], container_env(c), pod_root)
        for field in ("registry", "scheduler"):
            if hasattr(cfg, field):
                assert served(getattr(cfg, field)) == int(getattr(cfg, field).rsplit(":", 1)[1]), (command, field)
        for endpoint in filter(None, getattr(cfg, "etcd_endpoints", "").split(",")):
            assert served(endpoint) in (0, int(endpoint.rsplit(":", 1)[1])), (command, endpoint)
        if command == "scheduler":
            assert cfg.etcd_endpoints, "the scheduler claims in etcd itself, as the local launcher runs it"
        if command in ("registry", "scheduler"):
            assert cfg.key_prefix == yaml.safe_load((ROOT / f"deploy/helm/profiles/{profile}.yaml").read_text()).get(
                "etcd", {}).get("keyPrefix", "/kvshuttle/")


def merged_values(profile: str) -> dict:
    """values.yaml with the profile over it (Helm's merge: maps merge, everything else is replaced)."""
    def merge(base, over):
        if isinstance(base, dict) and isinstance(over, dict):
            return {k: merge(base.get(k), over[k]) if k in base else over[k] for k in over} | {
                k: v for k, v in base.items() if k not in over}
        return over
    return merge(yaml.safe_load((CHART / "values.yaml").read_text()),
                 yaml.safe_load((ROOT / f"deploy/helm/profiles/{profile}.yaml").read_text()))


def expected_worker_flags(values: dict, role: str) -> list[str]:
    """The `kvshuttle worker` flags the chart's values mean (deploy/README.md, "Settings": worker values)."""
    model = values["model"]
    model_dir = {"build": "/models/tiny", "huggingface": "/models/hf"}.get(
        model["source"], f"/models/{model.get('path', '')}".rstrip("/"))
    flags = ["--role", role, "--model", model_dir, "--served-model-name", model["name"], "--host", "0.0.0.0",
             "--grpc-port", str(values["workers"]["grpcPort"]), "--advertise-host", POD_ENV["POD_IP"],
             "--nixl-host", POD_ENV["POD_IP"], "--nixl-port", str(values["workers"]["nixlPort"]),
             "--worker-id", POD_ENV["POD_NAME"], "--work-dir", "/var/lib/kvshuttle", "--vllm-log", "-",
             "--registry", f"{RELEASE}-kvshuttle-registry:{values['registry']['port']}"]
    if model.get("maxModelLen"):
        flags += ["--max-model-len", str(model["maxModelLen"])]
    if values["metrics"]["enabled"]:
        flags += ["--metrics-listen", f"0.0.0.0:{values['metrics']['port']}"]
    if values["tracing"]["enabled"] and values["tracing"]["vllm"]:
        flags += ["--vllm-otlp-traces-endpoint", values["tracing"]["otlpEndpoint"]]
    settings = {**values["workers"]["settings"], **values[role].get("settings", {})}
    for key, value in settings.items():
        if isinstance(value, bool):
            flags.append(f"--{key}" if value else f"--no-{key}")
        else:
            flags += [f"--{key}", str(value)]
    return flags


def print_vllm_command(args: list[str], env: dict[str, str]) -> dict:
    base = {k: v for k, v in os.environ.items() if not k.startswith("KVSHUTTLE_")}
    out = subprocess.run([sys.executable, "-m", "kvshuttle.services.commands", *args, "--print-vllm-command"], cwd=ROOT,
                         env={**base, **env}, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


@pytest.mark.parametrize("role", ["prefill", "decode"])
@pytest.mark.parametrize("profile", PROFILE_IDS)
def test_chart_and_kvshuttle_worker_give_vllm_the_same_command_line(profile, role, pod_root):
    """The worker container's own args and env, run through `kvshuttle worker --print-vllm-command`, give the same
    vLLM argv and environment as `kvshuttle worker` given the profile's settings by hand."""
    deploy = objects(rendered(profile), "Deployment")[f"{RELEASE}-kvshuttle-{role}"]
    container = deploy["spec"]["template"]["spec"]["containers"][0]
    env = container_env(container)
    from_chart = print_vllm_command(expand(container["args"], env), relocate(env, pod_root))
    values = merged_values(profile)
    by_hand = print_vllm_command(["worker", *expected_worker_flags(values, role)], {})
    assert from_chart == by_hand

    argv, vllm_env = from_chart["argv"], from_chart["env"]
    transfer = json.loads(argv[argv.index("--kv-transfer-config") + 1])
    assert transfer["kv_connector"] == "NixlConnector"
    assert transfer["kv_connector_extra_config"]["bidirectional_kv_xfer"] is True
    assert transfer["kv_buffer_device"] == values["workers"]["settings"]["kv-buffer-device"]
    # vLLM listens where the pod's probes and ports say, and tells peers the pod IP for NIXL.
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert argv[argv.index("--port") + 1] == str(ports["grpc"]) == str(container["readinessProbe"]["grpc"]["port"])
    assert vllm_env["VLLM_NIXL_SIDE_CHANNEL_PORT"] == str(ports["nixl"])
    assert vllm_env["VLLM_NIXL_SIDE_CHANNEL_HOST"] == POD_ENV["POD_IP"]
    tp = values["workers"]["settings"].get("tensor-parallel-size", 1)
    assert ("--tensor-parallel-size" in argv) == (tp > 1)
    for key, value in values["workers"].get("ucx", {}).items():
        assert env[key] == str(value)  # UCX settings reach vLLM through the inherited environment


def test_cpu_dev_profile_runs_the_local_launchers_worker_settings(pod_root):
    """`kvshuttle up` and the CPU dev profile give vLLM the same settings (paths, ports and hosts aside)."""
    deploy = objects(rendered("cpu-dev"), "Deployment")[f"{RELEASE}-kvshuttle-decode"]
    container = deploy["spec"]["template"]["spec"]["containers"][0]
    chart = parse("worker", container["args"], container_env(container), pod_root)
    stack = StackConfig()
    for field in ("dtype", "decoder_kv_blocks_ttl", "nixl_progress_delay_us", "vllm_idle_spin_ms", "max_model_len"):
        assert getattr(chart, field) == getattr(stack, field), field
    assert chart.kv_buffer_device == "cpu" and chart.kv_cache_gib == WorkerConfig().kv_cache_gib


def test_bundled_etcd_runs_the_local_launchers_retention_settings():
    etcd = objects(rendered("gpu-1p1d"), "StatefulSet")[f"{RELEASE}-kvshuttle-etcd"]
    command = etcd["spec"]["template"]["spec"]["containers"][0]["command"]
    joined = " ".join(command)
    assert " ".join(RETENTION_ARGS) in joined
    members = re.search(r"--initial-cluster=(\S+)", joined).group(1).split(",")
    assert [m.split("=")[0] for m in members] == [f"{RELEASE}-kvshuttle-etcd-{i}" for i in range(3)]
    pdb = objects(rendered("gpu-1p1d"), "PodDisruptionBudget")[f"{RELEASE}-kvshuttle-etcd"]
    assert pdb["spec"]["minAvailable"] == 2  # a quorum of 3 survives a drain


def test_the_registry_defragments_etcd_on_a_schedule(pod_root):
    """Compaction frees pages inside etcd's database file; only defragmentation shrinks it. Every profile's registry
    defragments on the chart's schedule (its `settings`), and `registry.settings` turns it off."""
    def registry_config(docs):
        ((_, container),) = [(cmd, c) for cmd, c in kvshuttle_containers(docs) if cmd == "registry"]
        return parse("registry", container["args"], container_env(container), pod_root)

    for profile in PROFILE_IDS:
        cfg = registry_config(rendered(profile))
        assert (cfg.etcd_defrag_interval_s, cfg.etcd_defrag_min_free_mb) == (3600, 64), profile
    off = registry_config(rendered("gpu-1p1d", "--set", "registry.settings.etcd-defrag-interval-s=0"))
    assert off.etcd_defrag_interval_s == 0


def history_store_configs(docs, root: Path) -> dict[str, object]:
    """The registry's and the scheduler's parsed configs (one container each)."""
    return {cmd: parse(cmd, c["args"], container_env(c), root) for cmd, c in kvshuttle_containers(docs)
            if cmd in ("registry", "scheduler")}


@pytest.mark.parametrize("profile", PROFILE_IDS)
def test_registry_and_schedulers_share_the_bundled_history_store(profile, pod_root):
    """Every profile runs the bundled Redis (one pod, a volume, append-only, never evicting) behind a Service, and the
    registry replicas and the schedulers all get its URL: one store, since any replica may serve a session's turn."""
    docs = rendered(profile)
    name = f"{RELEASE}-kvshuttle-history"
    sts, svc = objects(docs, "StatefulSet")[name], objects(docs, "Service")[name]
    values = merged_values(profile)["historyStore"]
    assert sts["spec"]["replicas"] == 1 and sts["spec"]["serviceName"] == name
    pod = sts["spec"]["template"]["spec"]
    (redis,) = pod["containers"]
    assert redis["image"] == f"{values['image']['repository']}:{values['image']['tag']}"
    assert re.fullmatch(r"redis:7\.\d+(-alpine)?", redis["image"])
    command = " ".join(f'"{a}"' if a == "" else a for a in redis["command"])
    for flags in ("--appendonly yes", "--appendfsync everysec", '--save ""', "--maxmemory-policy noeviction",
                  f"--maxmemory {values['maxMemory']}"):
        assert flags in command, (profile, flags)
    assert {"name": "data", "mountPath": "/data"} in redis["volumeMounts"] and "--dir /data" in command
    (claim,) = sts["spec"]["volumeClaimTemplates"]
    assert claim["metadata"]["name"] == "data"
    assert claim["spec"]["resources"]["requests"]["storage"] == values["persistence"]["size"]
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert re.search(r"redis-cli -p \S+ ping", " ".join(redis[probe]["exec"]["command"])), probe
    assert pod["securityContext"]["runAsNonRoot"] and redis["securityContext"]["capabilities"]["drop"] == ["ALL"]
    assert svc["spec"]["selector"] == sts["spec"]["selector"]["matchLabels"] == sts["spec"]["template"]["metadata"][
        "labels"]
    (port,) = svc["spec"]["ports"]
    assert port["targetPort"] == redis["ports"][0]["name"]
    configs = history_store_configs(docs, pod_root)
    assert sorted(configs) == ["registry", "scheduler"]
    for command, cfg in configs.items():
        assert cfg.history_store == f"redis://{name}:{port['port']}/0", (profile, command)
        assert redis["ports"][0]["containerPort"] == port["port"]


def test_an_external_history_store_is_passed_through(pod_root):
    """historyStore.bundled false: no Redis of ours, and the registry and scheduler get historyStore.url, or the URL
    (password included) from historyStore.urlSecret."""
    url = "rediss://redis.infra.svc:6380/3"
    docs = rendered("gpu-1p1d", "--set", "historyStore.bundled=false", "--set", f"historyStore.url={url}")
    assert f"{RELEASE}-kvshuttle-history" not in objects(docs, "StatefulSet")
    assert f"{RELEASE}-kvshuttle-history" not in objects(docs, "Service")
    configs = history_store_configs(docs, pod_root)
    assert sorted(configs) == ["registry", "scheduler"]
    assert all(cfg.history_store == url for cfg in configs.values())

    docs = rendered("gpu-1p1d", "--set", "historyStore.bundled=false", "--set", "historyStore.urlSecret.name=redis-url")
    assert f"{RELEASE}-kvshuttle-history" not in objects(docs, "StatefulSet")
    for command, c in kvshuttle_containers(docs):
        env = {e["name"]: e for e in c.get("env", [])}
        if command in ("registry", "scheduler"):
            assert env["KVSHUTTLE_HISTORY_STORE"]["valueFrom"] == {
                "secretKeyRef": {"name": "redis-url", "key": "url"}}, command
        else:
            assert "KVSHUTTLE_HISTORY_STORE" not in env, command


def test_tls_probes_use_the_health_check_command(pod_root):
    """The kubelet's gRPC probe cannot speak TLS: with TLS on, probes run `kvshuttle health-check` with a server
    name the certificate carries, and that command line parses."""
    from kvshuttle.services.commands.health_check import HealthCheckConfig

    for command, c in kvshuttle_containers(rendered("gpu-4p4d-external-etcd-tls")):
        if command in ("registry", "scheduler"):
            probe = c["livenessProbe"]["exec"]["command"]
            assert probe[:2] == ["kvshuttle", "health-check"]
            parser = argparse.ArgumentParser(exit_on_error=False)
            add_arguments(HealthCheckConfig, parser)
            cfg = from_namespace(HealthCheckConfig, parser.parse_args(probe[2:]),
                                 environ=relocate(container_env(c), pod_root))
            assert cfg.tls_server_name == "kvshuttle.internal" and cfg.tls_ca == f"{pod_root}/etc/kvshuttle/tls/ca.crt"
            assert cfg.address.endswith(f":{c['ports'][0]['containerPort']}")
    for command, c in kvshuttle_containers(rendered("gpu-1p1d")):
        if command in ("registry", "scheduler"):
            assert c["livenessProbe"]["grpc"]["port"] == c["ports"][0]["containerPort"]


def test_api_keys_secret_holds_a_keys_file_the_gateway_loads(tmp_path):
    from kvshuttle.services.gateway.auth import KeyRing

    docs = rendered("gpu-4p4d-external-etcd-tls")
    secret = objects(docs, "Secret")[f"{RELEASE}-kvshuttle-api-keys"]
    keys_file = tmp_path / "keys.json"
    keys_file.write_text(secret["stringData"]["keys.json"])
    ring = KeyRing.load(str(keys_file))
    assert len(ring) == 2
    gateway = objects(docs, "Deployment")[f"{RELEASE}-kvshuttle-gateway"]["spec"]["template"]["spec"]
    assert {"name": "api-keys", "secret": {"secretName": f"{RELEASE}-kvshuttle-api-keys"}} in gateway["volumes"]


def test_notes_render_for_every_profile():
    for profile in PROFILE_IDS:
        out = helm("install", RELEASE, str(CHART), "--dry-run=client", "--namespace", NAMESPACE,
                   "-f", str(ROOT / f"deploy/helm/profiles/{profile}.yaml"))
        assert out.returncode == 0, out.stderr
        assert "X-Session-Id" in out.stdout and f"{RELEASE}-kvshuttle-gateway" in out.stdout


def test_metrics_are_scraped_where_they_are_served():
    """Each ServiceMonitor selects a Service of the release and names one of its ports; the PodMonitor selects the
    worker pods by labels they carry, on a port they declare; each process serving metrics listens on the port its
    annotations and monitors name; the dashboard ConfigMap holds the dashboard file."""
    docs = rendered("gpu-4p4d-external-etcd-tls")
    services, monitors = objects(docs, "Service"), objects(docs, "ServiceMonitor")
    assert sorted(monitors) == [f"{RELEASE}-kvshuttle-{c}" for c in ("gateway", "registry", "scheduler")]
    for name, sm in monitors.items():
        svc = next(s for s in services.values() if s["spec"]["selector"] == sm["spec"]["selector"]["matchLabels"])
        assert sm["spec"]["endpoints"][0]["port"] in {p["name"] for p in svc["spec"]["ports"]}, name
        assert sm["metadata"]["labels"]["release"] == "prometheus"
    pod_monitor = objects(docs, "PodMonitor")[f"{RELEASE}-kvshuttle-workers"]
    for role in ("prefill", "decode"):
        template = objects(docs, "Deployment")[f"{RELEASE}-kvshuttle-{role}"]["spec"]["template"]
        labels = template["metadata"]["labels"]
        for expr in pod_monitor["spec"]["selector"]["matchExpressions"]:
            assert labels[expr["key"]] in expr["values"], (role, expr)
        ports = {p["name"]: p["containerPort"] for p in template["spec"]["containers"][0]["ports"]}
        assert pod_monitor["spec"]["podMetricsEndpoints"][0]["port"] in ports
    for command, c in kvshuttle_containers(docs):
        ports = {p["name"]: p["containerPort"] for p in c["ports"]}
        listen = parse_flags(c["args"]).get("--metrics-listen")
        if command == "gateway":
            assert listen is None  # on its HTTP port, next to /health
        else:
            assert listen == f"0.0.0.0:{ports['metrics']}", command
    for d in objects(docs, "Deployment").values():
        annotations = d["spec"]["template"]["metadata"].get("annotations", {})
        ports = {p["containerPort"] for c in d["spec"]["template"]["spec"]["containers"] for p in c["ports"]}
        assert annotations["prometheus.io/scrape"] == "true" and int(annotations["prometheus.io/port"]) in ports
    dashboard = objects(docs, "ConfigMap")[f"{RELEASE}-kvshuttle-dashboard"]
    assert dashboard["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(dashboard["data"]["kvshuttle.json"]) == json.loads(
        (CHART / "dashboards/kvshuttle.json").read_text())
    off = rendered("gpu-1p1d", "--set", "metrics.enabled=false")
    assert not objects(off, "ServiceMonitor") and all(
        "--metrics-listen" not in " ".join(c["args"]) for _, c in kvshuttle_containers(off))


def test_the_alert_rules_watch_metrics_the_gateway_serves():
    """metrics.prometheusRule.enabled renders a PrometheusRule whose alerts read metrics of kvshuttle's catalogue, by
    label values those metrics take (a renamed metric or outcome would leave the alert silent for ever)."""
    from kvshuttle.control_plane import reasons
    from kvshuttle.services.common import metrics

    assert not objects(rendered("gpu-1p1d"), "PrometheusRule")  # off by default
    docs = rendered("gpu-1p1d", "--set", "metrics.prometheusRule.enabled=true", "--set",
                    "metrics.prometheusRule.for=2m")
    rule = objects(docs, "PrometheusRule")[f"{RELEASE}-kvshuttle-alerts"]
    alerts = {a["alert"]: a for a in rule["spec"]["groups"][0]["rules"]}
    assert set(alerts) == {"KvshuttleTurnsNotRecorded", "KvshuttleOutcomesNotLearned"}
    names = {m.name for m in metrics.CATALOGUE}
    for alert in alerts.values():
        assert alert["for"] == "2m"
        used = set(re.findall(r"\b(kvshuttle_[a-z_]+)\b", alert["expr"]))
        assert used and used <= names, used - names
    records = alerts["KvshuttleTurnsNotRecorded"]
    assert set(re.findall(r'outcome!~"([a-z_|]+)"', records["expr"])[0].split("|")) == {reasons.RECORDED,
                                                                                      reasons.UNRECORDED}
    assert "{{ $labels.outcome }}" in records["annotations"]["summary"]
    learned = alerts["KvshuttleOutcomesNotLearned"]
    assert re.findall(r'result!="([a-z_]+)"', learned["expr"]) == ["applied"]
    assert "applied" in metrics.LEARNED_RESULTS and "{{ $labels.result }}" in learned["annotations"]["summary"]


def test_helm_test_pod_runs_the_smoke_test_against_the_gateway_service():
    """`helm test` runs `kvshuttle smoke-test` at the gateway Service's HTTP port, with the test key when the gateway
    needs one; with keys but no test key there is no test pod (it could only fail)."""
    from kvshuttle.services.commands.smoke_test import SmokeTestConfig

    for profile, scheme in (("cpu-dev", "http"), ("gpu-4p4d-external-etcd-tls", "https")):
        docs = rendered(profile)
        pod = objects(docs, "Pod")[f"{RELEASE}-kvshuttle-smoke-test"]
        assert pod["metadata"]["annotations"]["helm.sh/hook"] == "test"
        assert pod["spec"]["restartPolicy"] == "Never"
        container = pod["spec"]["containers"][0]
        assert container["args"][0] == "smoke-test"
        parser = argparse.ArgumentParser(exit_on_error=False)
        add_arguments(SmokeTestConfig, parser)
        cfg = from_namespace(SmokeTestConfig, parser.parse_args(container["args"][1:]), environ={})
        gateway = objects(docs, "Service")[f"{RELEASE}-kvshuttle-gateway"]
        http_port = next(p["port"] for p in gateway["spec"]["ports"] if p["name"] == "http")
        assert cfg.url == f"{scheme}://{RELEASE}-kvshuttle-gateway:{http_port}"
        assert cfg.model == merged_values(profile)["model"]["name"]
        assert cfg.insecure == (scheme == "https")
        env = {e["name"]: e for e in container.get("env", [])}
        assert ("KVSHUTTLE_SMOKE_TEST_API_KEY" in env) == (profile != "cpu-dev")
    assert "Pod" not in {d["kind"] for d in rendered("gpu-1p1d")}  # keys from a Secret, no test key given
