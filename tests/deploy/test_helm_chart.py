"""The Helm chart: lint, render three value profiles, validate every manifest offline, reject broken values with a
readable message, and render exactly the command lines kvshuttle's own commands parse (the worker's vLLM command
line compared with `kvshuttle worker --print-vllm-command`)."""

from __future__ import annotations

import argparse
import base64
import copy
import json
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
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
    fix = lambda v: re.sub(r"(?<![\w.])/(etc/kvshuttle|models(?:-[a-z0-9-]+)?)/", f"{root}/\\1/", v)  # noqa: E731
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
        assert env["KVSHUTTLE_TLS_CLIENT_CERT"] and env["KVSHUTTLE_TLS_SERVER_NAME"] == "kvshuttle.internal", command
        if command != "worker":
            assert env["KVSHUTTLE_TLS_CERT"], command
            assert ("KVSHUTTLE_TLS_CLIENT_CA" in env) == (command != "gateway"), command
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
    "the KV feed's Redis given as a worker setting": ("prefill: {settings: {kv-feed: 'redis://r:6379/0'}}",
                                                      ["/prefill/settings", "'kv-feed' not allowed"]),
    "the KV feed's key prefix given as a worker setting": ("workers: {settings: {kv-feed-key-prefix: /other/}}",
                                                           ["/workers/settings", "'kv-feed-key-prefix' not allowed"]),
    "the KV feed given as a scheduler setting": ("scheduler: {settings: {kv-feed: 'redis://r:6379/0'}}",
                                                 ["/scheduler/settings", "'kv-feed' not allowed"]),
    "the KV feed set in the workers' environment": ("workers: {env: {KVSHUTTLE_KV_FEED: 'redis://r:6379/0'}}",
                                                    ["workers.env.KVSHUTTLE_KV_FEED: the chart sets it"]),
    "KV feed switch that is no boolean": ("kvFeed: {enabled: 'yes'}", ["/kvFeed/enabled", "want boolean"]),
    "unknown KV feed value": ("kvFeed: {url: 'redis://r:6379/0'}", ["/kvFeed", "'url' not allowed"]),
    "external etcd without endpoints": ("etcd: {mode: external}", ["/etcd/external/endpoints"]),
    "TLS turned off without saying so twice": ("tls: {enabled: false}", [
        "tls.enabled=false turns off mutual TLS", "set tls.allowInsecure=true as well"]),
    "allowInsecure with TLS on": ("tls: {allowInsecure: true}", ["tls.allowInsecure=true goes only with "
                                                                 "tls.enabled=false"]),
    "the one shared certificate of old": ("tls: {secretName: kvshuttle-internal-tls}", [
        "tls.secretName (one certificate shared by every service) is no longer taken", "tls.existingSecrets"]),
    "TLS that is not mutual": ("tls: {mutual: false}", ["tls.mutual=false is no longer offered"]),
    "some of the services' own Secrets": ("tls: {existingSecrets: {registry: r, gateway: g}}", [
        "needs one per service: tls.existingSecrets.scheduler, tls.existingSecrets.worker missing"]),
    "own Secrets with certificates made by Helm": (
        "tls: {source: helm, existingSecrets: {registry: r, scheduler: s, gateway: g, worker: w}}",
        ["tls.existingSecrets (registry, scheduler, gateway, worker) are given but tls.source is helm"]),
    "own Secrets with TLS off": ("tls: {enabled: false, allowInsecure: true, existingSecrets: {worker: w}}",
                                 ["tls.existingSecrets (worker) are given but tls.enabled is false"]),
    "cert-manager issuer with certificates made by Helm": ("tls: {source: helm, certManager: {issuerRef: {name: ca}}}",
                                                           ["tls.certManager.issuerRef is given but the certificates "
                                                            "come from helm"]),
    "unknown certificate source": ("tls: {source: vault}", ["/tls/source", "'auto', 'certManager', 'helm'"]),
    "UCX transfer ports set by hand": ("workers: {ucx: {UCX_TCP_PORT_RANGE: '1000-2000'}}",
                                       ["set workers.nixlTransferPorts (first, last) instead of UCX_TCP_PORT_RANGE"]),
    "transfer port range upside down": ("workers: {nixlTransferPorts: {first: 30000, last: 20000}}",
                                        ["workers.nixlTransferPorts: last (20000) is below first (30000)"]),
    "NetworkPolicy peer of an unknown kind": ("networkPolicy: {gatewayFrom: [{pods: {app: x}}]}",
                                              ["/networkPolicy/gatewayFrom/0", "'pods' not allowed"]),
    "port out of range": ("gateway: {httpPort: 80000}", ["/gateway/httpPort", "maximum"]),
    "even etcd member count": ("etcd: {bundled: {replicas: 2}}", ["/etcd/bundled/replicas"]),
    "API key given in clear": ("gateway: {apiKeys: {entries: [{sha256: my-secret-key, tenant: a}]}}",
                               ["/gateway/apiKeys/entries/0/sha256", "does not match pattern"]),
    "extra model id that is no DNS label": ("extraModels: [{id: Big_Model, name: big, source: pvc, "
                                            "pvc: {claimName: m}}]", ["/extraModels/0/id", "does not match pattern"]),
    "extra model built in the pod": ("extraModels: [{id: t, name: t, source: build}]",
                                     ["/extraModels/0/source", "'pvc', 'hostPath', 'huggingface'"]),
    "extra model without its claim": ("extraModels: [{id: b, name: big, source: pvc}]", ["/extraModels/0"]),
    "extra model id used twice": ("extraModels: [{id: b, name: big, source: hostPath, hostPath: {path: /m/b}}, "
                                  "{id: b, name: other, source: hostPath, hostPath: {path: /m/o}}]",
                                  ["extraModels[1]: id \"b\" or name \"other\" is used twice"]),
    "extra model named as the main one": ("extraModels: [{id: b, name: Qwen/Qwen3-8B, source: hostPath, "
                                          "hostPath: {path: /m/b}}]", ["extraModels[0]: id \"b\" or name"]),
    "adapters without a source": ("model: {adapters: {items: [{name: sql, path: sql}]}}",
                                  ["the adapters of model \"Qwen/Qwen3-8B\" list items but no source"]),
    "adapters on a pvc without its claim": ("model: {adapters: {source: pvc}}", ["/model/adapters"]),
    "an adapter's path outside its source": ("model: {adapters: {source: hostPath, hostPath: {path: /a}, items: "
                                             "[{name: sql, path: /etc/sql}]}}",
                                             ["/model/adapters/items/0/path", "does not match pattern"]),
    "an adapter named as a model": ("model: {adapters: {source: hostPath, hostPath: {path: /a}, items: "
                                    "[{name: Qwen/Qwen3-8B, path: q}]}}",
                                    ["adapter \"Qwen/Qwen3-8B\" of model \"Qwen/Qwen3-8B\": the name is already"]),
    "one adapter name for two models": ("model: {adapters: {source: hostPath, hostPath: {path: /a}, items: "
                                        "[{name: sql, path: s}]}}\nextraModels: [{id: b, name: big, source: "
                                        "hostPath, hostPath: {path: /m/b}, adapters: {source: hostPath, hostPath: "
                                        "{path: /a}, items: [{name: sql, path: t}]}}]",
                                        ["adapter \"sql\" of model \"big\": the name is already"]),
    "the adapter list given as a setting": ("prefill: {settings: {lora-modules-file: /x.json}}",
                                            ["/prefill/settings", "'lora-modules-file' not allowed"]),
    "extra models given as a gateway setting": ("gateway: {settings: {models: 'a=/m/a'}}",
                                                ["/gateway/settings", "'models' not allowed"]),
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


EXTRA_MODELS = """
extraModels:
  - id: llama3b
    name: meta-llama/Llama-3.2-3B-Instruct
    source: pvc
    pvc: {claimName: models}
    path: llama-3.2-3b
    maxModelLen: 8192
    toolCallParser: llama3_json
    prefill: {replicas: 2}
    decode: {replicas: 3, settings: {max-num-seqs: 64}}
  - id: small
    name: small
    source: huggingface
    huggingface: {repo: HuggingFaceTB/SmolLM2-135M-Instruct}
"""


def test_extra_models_get_their_own_pools_and_the_gateway_serves_them(pod_root, tmp_path):
    """extraModels (issue #37, docs/models.md): each model gets a prefill and a decode Deployment of its own, serving
    it under its name from its own files, with the main pools' values where it sets none; the gateway mounts each
    one's tokenizer and serves them all (--models, parsed here by the gateway's own config, files checked); the
    NetworkPolicy and the PodMonitor take every pool of a role alike; the manifests validate."""
    from kvshuttle.services.gateway.model_specs import ModelSpec

    values = tmp_path / "extra.yaml"
    values.write_text(EXTRA_MODELS)
    docs = rendered("gpu-1p1d", "-f", str(values))
    deployments = objects(docs, "Deployment")
    pools = {name: d for name, d in deployments.items() if name.startswith(f"{RELEASE}-kvshuttle-prefill")
             or name.startswith(f"{RELEASE}-kvshuttle-decode")}
    seen = {}
    for name, d in pools.items():
        pod = d["spec"]["template"]["spec"]
        flags = parse_flags(pod["containers"][0]["args"])
        labels = d["spec"]["template"]["metadata"]["labels"]
        assert d["spec"]["selector"]["matchLabels"].items() <= labels.items()
        seen[name.removeprefix(f"{RELEASE}-kvshuttle-")] = (
            d["spec"]["replicas"], flags["--served-model-name"], flags["--model"], flags.get("--max-model-len"),
            flags.get("--max-num-seqs"), labels["kvshuttle.io/worker-role"], labels["app.kubernetes.io/component"])
    assert seen == {
        "prefill": (1, "Qwen/Qwen3-8B", "/models/Qwen3-8B", "32768", None, "prefill", "prefill"),
        "decode": (1, "Qwen/Qwen3-8B", "/models/Qwen3-8B", "32768", None, "decode", "decode"),
        "prefill-llama3b": (2, "meta-llama/Llama-3.2-3B-Instruct", "/models/llama-3.2-3b", "8192", None, "prefill",
                            "prefill-llama3b"),
        "decode-llama3b": (3, "meta-llama/Llama-3.2-3B-Instruct", "/models/llama-3.2-3b", "8192", "64", "decode",
                           "decode-llama3b"),
        "prefill-small": (1, "small", "/models/hf", None, None, "prefill", "prefill-small"),
        "decode-small": (1, "small", "/models/hf", None, None, "decode", "decode-small"),
    }
    assert len({tuple(sorted(d["spec"]["selector"]["matchLabels"].items())) for d in pools.values()}) == 6

    gateway = dict(kvshuttle_containers(docs))["gateway"]
    for d in ("models-llama3b/llama-3.2-3b", "models-small/hf"):
        (pod_root / d).mkdir(parents=True, exist_ok=True)
        (pod_root / d / "tokenizer.json").write_text("{}")
    cfg = parse("gateway", gateway["args"], container_env(gateway), pod_root)
    assert cfg.model_specs()[1:] == [
        ModelSpec("meta-llama/Llama-3.2-3B-Instruct", f"{pod_root}/models-llama3b/llama-3.2-3b",
                  tool_call_parser="llama3_json", max_model_len=8192),
        ModelSpec("small", f"{pod_root}/models-small/hf")]
    gateway_pod = deployments[f"{RELEASE}-kvshuttle-gateway"]["spec"]["template"]["spec"]
    mounts = {m["mountPath"]: m["name"] for m in gateway_pod["containers"][0]["volumeMounts"]}
    assert mounts["/models-llama3b"] == "model-llama3b" and mounts["/models-small"] == "model-small"
    volumes = {v["name"]: v for v in gateway_pod["volumes"]}
    assert volumes["model-llama3b"]["persistentVolumeClaim"]["claimName"] == "models"
    fetch = next(c for c in gateway_pod["initContainers"] if c["name"] == "model-small")  # the tokenizer only
    assert {"name": "KVSHUTTLE_MODEL_DIR", "value": "/models-small/hf"} in fetch["env"]
    assert any(e["name"] == "KVSHUTTLE_MODEL_PATTERNS" for e in fetch["env"])
    for command, container in kvshuttle_containers(docs):
        parse(command, container["args"], container_env(container), pod_root)

    policies = objects(docs, "NetworkPolicy")
    for role in ("prefill", "decode"):
        selector = policies[f"{RELEASE}-kvshuttle-{role}-traffic"]["spec"]["podSelector"]["matchLabels"]
        matched = [n for n, d in pools.items() if selector.items() <= d["spec"]["template"]["metadata"]["labels"].items()]
        assert len(matched) == 3, (role, matched)  # every model's pool of the role
    manifest = tmp_path / "rendered.yaml"
    manifest.write_text(yaml.safe_dump_all(docs))
    out = subprocess.run([str(ROOT / ".venv/bin/kubernetes-validate"), "--strict", "--quiet", "-k", "1.30.0",
                          str(manifest)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr


ADAPTERS = """
model:
  adapters:
    source: pvc
    pvc: {claimName: adapters}
    items:
      - {name: sql-lora, path: qwen3/sql}
      - {name: support-v2, path: qwen3/support}
extraModels:
  - id: small
    name: small
    source: hostPath
    hostPath: {path: /m/small}
    adapters: {source: hostPath, hostPath: {path: /a}}
"""


def test_adapters_are_a_list_the_workers_follow_from_a_config_map(pod_root, tmp_path):
    """model.adapters / extraModels[].adapters (issue #37, docs/models.md#lora-adapters): the files mounted read-only
    at /adapters, the list a ConfigMap per model mounted where the workers' --lora-modules-file reads it (parsed
    here by the worker's own config: each name -> its directory); a model without adapters runs its pools with LoRA
    off, one with a source and no items with LoRA on and an empty list; the manifests validate."""
    values = tmp_path / "adapters.yaml"
    values.write_text(ADAPTERS)
    docs = rendered("gpu-1p1d", "-f", str(values))
    maps = objects(docs, "ConfigMap")
    lists = {name.removeprefix(f"{RELEASE}-kvshuttle-"): json.loads(m["data"]["lora-modules.json"])
             for name, m in maps.items() if "adapters" in name}
    assert lists == {"adapters": {"sql-lora": "/adapters/qwen3/sql", "support-v2": "/adapters/qwen3/support"},
                     "adapters-small": {}}
    for name, d in objects(docs, "Deployment").items():
        component = name.removeprefix(f"{RELEASE}-kvshuttle-")
        if not component.startswith(("prefill", "decode")):
            continue
        pod = d["spec"]["template"]["spec"]
        container = pod["containers"][0]
        flags = parse_flags(container["args"])
        listed = "adapters-small" if component.endswith("-small") else "adapters"
        assert flags["--lora-modules-file"] == "/etc/kvshuttle/adapters/lora-modules.json", component
        mounts = {m["mountPath"]: (m["name"], m.get("readOnly")) for m in container["volumeMounts"]}
        assert mounts["/adapters"] == ("adapters", True) and mounts["/etc/kvshuttle/adapters"] == ("adapter-list", True)
        volumes = {v["name"]: v for v in pod["volumes"]}
        assert volumes["adapter-list"]["configMap"]["name"] == f"{RELEASE}-kvshuttle-{listed}"
        source = volumes["adapters"]
        assert (source["hostPath"]["path"] == "/a") if listed == "adapters-small" else (
            source["persistentVolumeClaim"] == {"claimName": "adapters", "readOnly": True})
        # the worker's own config takes the flags, and reads the list the ConfigMap holds
        adapter_file = pod_root / "etc/kvshuttle/adapters/lora-modules.json"
        adapter_file.parent.mkdir(parents=True, exist_ok=True)
        adapter_file.write_text(maps[f"{RELEASE}-kvshuttle-{listed}"]["data"]["lora-modules.json"])
        cfg = parse("worker", container["args"], container_env(container), pod_root)
        assert cfg.serves_adapters and cfg.lora_modules_file.endswith("/etc/kvshuttle/adapters/lora-modules.json")
    plain = rendered("gpu-1p1d")
    for name, d in objects(plain, "Deployment").items():
        assert "--lora-modules-file" not in " ".join(d["spec"]["template"]["spec"]["containers"][0]["args"]), name
    manifest = tmp_path / "rendered.yaml"
    manifest.write_text(yaml.safe_dump_all(docs))
    out = subprocess.run([str(ROOT / ".venv/bin/kubernetes-validate"), "--strict", "--quiet", "-k", "1.30.0",
                          str(manifest)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr


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


def history_store_url(values: dict) -> str:
    """The history store's Redis URL the chart gives its clients: the bundled one's Service, or historyStore.url."""
    h = values["historyStore"]
    return f"redis://{RELEASE}-kvshuttle-history:{h['port']}/0" if h["bundled"] else h["url"]


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
    if values["kvFeed"]["enabled"]:  # KVSHUTTLE_KV_FEED, KVSHUTTLE_KV_FEED_KEY_PREFIX
        flags += ["--kv-feed", history_store_url(values), "--kv-feed-key-prefix", values["etcd"]["keyPrefix"]]
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
    # The KV feed (on by default): a prefill worker's vLLM publishes KV-cache events, a decode worker's does not.
    assert (vllm_env.get("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES") == "1") == (role == "prefill")
    assert vllm_env["SMG_VLLM_SERVICER_KV_EVENTS"] == (None if role == "prefill" else "0")
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


# --- the KV feed: prefill workers publish their KV events, every worker its load, to the history store's Redis ------

def kv_feed_env(docs) -> dict[str, dict[str, dict]]:
    """component -> its containers' KVSHUTTLE_KV_FEED* env entries as rendered (value or valueFrom), every pod kind."""
    out = {}
    for d in docs:
        template = d["spec"]["template"] if d["kind"] in ("Deployment", "StatefulSet") else d if d["kind"] == "Pod" \
            else None
        if template is not None:
            component = template["metadata"]["labels"]["app.kubernetes.io/component"]
            out[component] = {e["name"]: e for c in template["spec"]["containers"] for e in c.get("env", [])
                              if e["name"].startswith("KVSHUTTLE_KV_FEED")}
    return out


def feed_configs(docs, root: Path) -> dict:
    """The parsed configs of the prefill and decode workers, the scheduler and (planning in process) the gateway's
    embedded scheduler: what each process makes of the KV feed's settings."""
    from kvshuttle.services.scheduler.in_process import embedded_config

    out = {}
    deployments = objects(docs, "Deployment")
    for role in WORKERS:
        c = deployments[f"{RELEASE}-kvshuttle-{role}"]["spec"]["template"]["spec"]["containers"][0]
        out[role] = parse("worker", c["args"], container_env(c), root)
    containers = dict(kvshuttle_containers(docs))
    out["scheduler"] = parse("scheduler", containers["scheduler"]["args"], container_env(containers["scheduler"]), root)
    env = container_env(containers["gateway"])
    gateway = parse("gateway", containers["gateway"]["args"], env, root)
    if gateway.scheduler == "local":
        out["gateway"] = embedded_config(gateway.scheduler_args, registry=gateway.registry, tls=gateway,
                                         environ=relocate(env, root))
    return out


@pytest.mark.parametrize("profile", PROFILE_IDS)
def test_prefill_workers_publish_the_kv_feed_that_the_planners_follow(profile, pod_root):
    """kvFeed is on by default: the prefill workers publish their vLLM's KV events, and every worker its load samples,
    to the history store's Redis, under the planners' key prefix, and the scheduler replicas (and the gateways, when
    they plan in process) follow those streams; the registry and a gateway that does not plan get none of it. Each
    process's own config parses what the chart renders (the snapshot interval is a worker setting)."""
    values = merged_values(profile)
    url = history_store_url(values)
    for plan_in_process in (False, True):
        docs = rendered(profile, "--set", "gateway.planInProcess=true", "--set",
                        "prefill.settings.kv-feed-snapshot-s=2") if plan_in_process else rendered(profile)
        envs = kv_feed_env(docs)
        planners = ["scheduler"] + (["gateway"] if plan_in_process else [])
        assert sorted(c for c, e in envs.items() if e) == sorted(["prefill", "decode", *planners]), (profile, envs)
        assert set(envs["prefill"]) == set(envs["decode"]) == {"KVSHUTTLE_KV_FEED", "KVSHUTTLE_KV_FEED_KEY_PREFIX"}
        assert all(set(envs[p]) == {"KVSHUTTLE_KV_FEED"} for p in planners)  # their --key-prefix is the feed's
        cfgs = feed_configs(docs, pod_root)
        prefill, decode = cfgs["prefill"], cfgs["decode"]
        assert prefill.kv_feed == url and prefill.kv_events and prefill.load_feed, profile
        assert decode.kv_feed == url and not decode.kv_events and decode.load_feed, profile  # loads, no KV events
        assert prefill.kv_feed_snapshot_s == (2 if plan_in_process else WorkerConfig().kv_feed_snapshot_s)
        for planner in planners:
            cfg = cfgs[planner]
            assert cfg.kv_feed == url and cfg.history_store == url, (profile, planner)
            assert cfg.key_prefix == prefill.kv_feed_key_prefix == decode.kv_feed_key_prefix \
                == values["etcd"]["keyPrefix"], (profile, planner)
        assert "gateway" not in cfgs or plan_in_process


def test_the_kv_feed_turned_off_reaches_no_pod(pod_root):
    """kvFeed.enabled=false: no pod gets the KV feed (a gateway planning in process neither), so no prefill worker's
    vLLM publishes KV events; the history store is unchanged."""
    from kvshuttle.workers.vllm_process import vllm_command

    docs = rendered("gpu-1p1d", "--set", "kvFeed.enabled=false", "--set", "gateway.planInProcess=true")
    assert not any(kv_feed_env(docs).values())
    cfgs = feed_configs(docs, pod_root)
    assert sorted(cfgs) == ["decode", "gateway", "prefill", "scheduler"]
    assert not any(cfg.kv_feed for cfg in cfgs.values())
    assert not cfgs["prefill"].kv_events
    _, vllm_env = vllm_command(cfgs["prefill"])
    assert vllm_env["SMG_VLLM_SERVICER_KV_EVENTS"] == "0" and vllm_env["VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES"] is None
    assert cfgs["scheduler"].history_store == history_store_url(merged_values("gpu-1p1d"))


def test_the_kv_feed_uses_your_own_redis_from_its_url_or_secret(pod_root):
    """historyStore.bundled false: the KV feed is in your Redis too, at historyStore.url, or from the Secret in
    historyStore.urlSecret (password included) on each pod that uses it, as KVSHUTTLE_HISTORY_STORE is."""
    url = "rediss://redis.infra.svc:6380/3"
    docs = rendered("gpu-1p1d", "--set", "historyStore.bundled=false", "--set", f"historyStore.url={url}",
                    "--set", "gateway.planInProcess=true")
    cfgs = feed_configs(docs, pod_root)
    assert {name: cfg.kv_feed for name, cfg in cfgs.items()} == {"prefill": url, "decode": url, "scheduler": url,
                                                                 "gateway": url}

    docs = rendered("gpu-1p1d", "--set", "historyStore.bundled=false", "--set", "historyStore.urlSecret.name=redis-url",
                    "--set", "historyStore.urlSecret.key=redis", "--set", "gateway.planInProcess=true")
    from_secret = {"secretKeyRef": {"name": "redis-url", "key": "redis"}}
    envs = kv_feed_env(docs)
    for component in ("prefill", "decode", "scheduler", "gateway"):
        assert envs[component]["KVSHUTTLE_KV_FEED"] == {"name": "KVSHUTTLE_KV_FEED", "valueFrom": from_secret}
    assert envs["prefill"]["KVSHUTTLE_KV_FEED_KEY_PREFIX"]["value"] == "/kvshuttle/"
    assert envs["decode"]["KVSHUTTLE_KV_FEED_KEY_PREFIX"]["value"] == "/kvshuttle/"
    assert not envs["registry"]
    for command, c in kvshuttle_containers(docs):
        if command != "worker":
            history = next(e for e in c["env"] if e["name"] == "KVSHUTTLE_HISTORY_STORE")
            assert history["valueFrom"] == from_secret, command


def test_workers_reach_the_redis_only_with_the_kv_feed():
    """The NetworkPolicy lets the workers reach the history store's Redis (bundled: its pod; your own: its port)
    while the KV feed is on (prefill workers publish KV events and loads, decode workers loads), and not once it is
    off."""
    port = merged_values("gpu-1p1d")["historyStore"]["port"]
    on, _, _ = allowed_paths(rendered("gpu-1p1d"))
    off, _, _ = allowed_paths(rendered("gpu-1p1d", "--set", "kvFeed.enabled=false"))
    assert {(s, p) for s, d, p in on if d == "history"} - {(s, p) for s, d, p in off if d == "history"} == {
        ("prefill", port), ("decode", port)}
    assert not [path for path in off if path[:2] in (("prefill", "history"), ("decode", "history"))]

    own = ("--set", "historyStore.bundled=false", "--set", "historyStore.url=redis://redis.infra.svc:6390/0")
    _, _, out_on = allowed_paths(rendered("gpu-1p1d", *own))
    _, _, out_off = allowed_paths(rendered("gpu-1p1d", *own, "--set", "kvFeed.enabled=false"))
    for role in WORKERS:
        assert (role, "internet", 6390, "TCP") in out_on and (role, "internet", 6390, "TCP") not in out_off


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
    # The chart's own certificates (the default): the name checked is the server's Service, which its certificate names.
    secrets = objects(rendered("gpu-1p1d"), "Secret")
    for command, c in kvshuttle_containers(rendered("gpu-1p1d")):
        if command in ("registry", "scheduler"):
            probe = c["livenessProbe"]["exec"]["command"]
            name = parse_flags(probe)["--tls-server-name"]
            assert name == f"{RELEASE}-kvshuttle-{command}"
            assert name in dns_names(certificate(secrets[f"{RELEASE}-kvshuttle-tls-{command}"]))
    for command, c in kvshuttle_containers(rendered("gpu-1p1d", *INSECURE)):
        if command in ("registry", "scheduler"):
            assert c["livenessProbe"]["grpc"]["port"] == c["ports"][0]["containerPort"]


def test_api_keys_secret_holds_a_keys_file_the_gateway_loads(tmp_path):
    from kvshuttle.services.gateway.edge.auth import KeyRing

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
        # the gateway's too: on its HTTP port /metrics needs an admin key once API keys are set
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


# --- mutual TLS: the chart's own certificates, each pod's identity ----------------------------------------------------

INSECURE = ("--set", "tls.enabled=false", "--set", "tls.allowInsecure=true")
CERT_MANAGER = ("--api-versions", "cert-manager.io/v1")
IDENTITIES = ("registry", "scheduler", "gateway", "worker", "admin")
POD_IDENTITY = {"registry": "registry", "scheduler": "scheduler", "gateway": "gateway", "worker": "worker"}


def service_dns_names(*services: str) -> list[str]:
    """Every name a pod may dial a Service of the release by."""
    return [name for svc in services for name in (
        f"{RELEASE}-kvshuttle-{svc}", f"{RELEASE}-kvshuttle-{svc}.{NAMESPACE}",
        f"{RELEASE}-kvshuttle-{svc}.{NAMESPACE}.svc", f"{RELEASE}-kvshuttle-{svc}.{NAMESPACE}.svc.cluster.local")]


# What each identity's certificate names: the Services its server is dialed by; the gateway's also the loopback
# addresses its REST bridge calls its own gRPC API on. Workers and admin only call.
EXPECTED_DNS = {"registry": service_dns_names("registry"),
                "scheduler": service_dns_names("scheduler", "scheduler-peers"),
                "gateway": service_dns_names("gateway"), "worker": [], "admin": []}
EXPECTED_IPS = {"gateway": ["127.0.0.1", "0.0.0.0"]}


def certificate(secret: dict, key: str = "tls.crt"):
    from cryptography import x509

    return x509.load_pem_x509_certificate(base64.b64decode(secret["data"][key]))


def common_name(cert) -> str:
    from cryptography.x509.oid import NameOID

    (attr,) = cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
    return attr.value


def dns_names(cert) -> list[str]:
    from cryptography import x509

    try:
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return []
    return san.get_values_for_type(x509.DNSName)


def ip_addresses(cert) -> list[str]:
    from cryptography import x509

    try:
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return []
    return [str(ip) for ip in san.get_values_for_type(x509.IPAddress)]


def pod_tls(docs) -> dict[str, tuple[dict, dict]]:
    """Deployment name -> (its kvshuttle container's env, its volumes by name)."""
    out = {}
    for d in docs:
        if d["kind"] == "Deployment":
            spec = d["spec"]["template"]["spec"]
            out[d["metadata"]["name"]] = (container_env(spec["containers"][0]), {v["name"]: v for v in spec["volumes"]})
    return out


def test_a_default_install_makes_its_own_ca_and_one_certificate_per_identity():
    """No certificates given and no cert-manager: Helm makes a CA and a certificate per identity (CN = the identity,
    server and client auth, signed by the CA, naming the Services it serves), each Secret with the CA beside it; the
    CA Secret keeps its key, so upgrades sign with the same CA (lookup)."""
    from cryptography import x509
    from cryptography.hazmat.primitives.asymmetric import padding
    from cryptography.x509.oid import ExtendedKeyUsageOID
    from kvshuttle.control_plane.service_access import caller_of

    docs = rendered("gpu-1p1d")
    assert not [d for d in docs if d["apiVersion"].startswith("cert-manager.io/")]
    secrets = objects(docs, "Secret")
    ca_secret = secrets[f"{RELEASE}-kvshuttle-tls-ca"]
    ca = certificate(ca_secret)
    assert ca.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    assert ca_secret["data"]["tls.key"] and ca_secret["data"]["ca.crt"] == ca_secret["data"]["tls.crt"]
    tls_secrets = sorted(n for n, s in secrets.items() if s["type"] == "kubernetes.io/tls")
    assert tls_secrets == sorted(f"{RELEASE}-kvshuttle-tls-{i}" for i in (*IDENTITIES, "ca"))
    for identity in IDENTITIES:
        secret = secrets[f"{RELEASE}-kvshuttle-tls-{identity}"]
        cert = certificate(secret)
        assert secret["data"]["ca.crt"] == ca_secret["data"]["tls.crt"], identity
        assert common_name(cert) == identity and caller_of(common_name(cert)).role == identity
        assert cert.issuer == ca.subject
        ca.public_key().verify(cert.signature, cert.tbs_certificate_bytes, padding.PKCS1v15(),
                               cert.signature_hash_algorithm)  # raises unless the CA signed it
        usages = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
        assert {ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH} <= set(usages), identity
        assert sorted(dns_names(cert)) == sorted(EXPECTED_DNS[identity]), identity
        assert sorted(ip_addresses(cert)) == sorted(EXPECTED_IPS.get(identity, [])), identity
        assert "kvshuttle.io/tls-spec" in secret["metadata"]["annotations"]
    # tls.serverName: the servers' certificates name it too (clients then verify it whatever address they dial).
    named = objects(rendered("gpu-1p1d", "--set", "tls.serverName=kvshuttle.internal"), "Secret")
    for identity in IDENTITIES:
        cert = certificate(named[f"{RELEASE}-kvshuttle-tls-{identity}"])
        assert ("kvshuttle.internal" in dns_names(cert)) == (identity in ("registry", "scheduler", "gateway"))
    # Without a cluster to look in (helm template) every render makes new ones: what `lookup` prevents on upgrades.
    again = objects(rendered("gpu-1p1d", "--set", "logLevel=DEBUG"), "Secret")[f"{RELEASE}-kvshuttle-tls-ca"]
    assert again["data"]["tls.crt"] != ca_secret["data"]["tls.crt"]


def test_with_cert_manager_the_chart_asks_it_for_the_same_certificates():
    """cert-manager installed (its API present, or tls.source certManager): a self-signed Issuer, a CA Certificate,
    a CA Issuer and one Certificate per identity with the names the Helm-made ones carry, into the Secrets the pods
    mount; no Secret of certificates made by Helm. tls.certManager.issuerRef: your issuer signs them instead."""
    for docs in (rendered("gpu-1p1d", *CERT_MANAGER), rendered("gpu-1p1d", "--set", "tls.source=certManager")):
        kinds = [(d["kind"], d["metadata"]["name"]) for d in docs if d["apiVersion"] == "cert-manager.io/v1"]
        issuers, certs = objects(docs, "Issuer"), objects(docs, "Certificate")
        assert len(kinds) == len(issuers) + len(certs) == 2 + 1 + len(IDENTITIES)
        assert not [n for n, s in objects(docs, "Secret").items() if s["type"] == "kubernetes.io/tls"]
        selfsigned, ca_issuer = issuers[f"{RELEASE}-kvshuttle-tls-selfsigned"], issuers[f"{RELEASE}-kvshuttle-tls-ca"]
        assert selfsigned["spec"] == {"selfSigned": {}}
        ca = certs[f"{RELEASE}-kvshuttle-tls-ca"]["spec"]
        assert ca["isCA"] is True and ca["issuerRef"]["name"] == f"{RELEASE}-kvshuttle-tls-selfsigned"
        assert ca_issuer["spec"] == {"ca": {"secretName": ca["secretName"]}}
        for identity in IDENTITIES:
            spec = certs[f"{RELEASE}-kvshuttle-tls-{identity}"]["spec"]
            # Only fields of cert-manager.io/v1 Certificate (its CRD is not in the offline schemas).
            assert set(spec) <= {"secretName", "commonName", "dnsNames", "ipAddresses", "usages", "duration",
                                 "renewBefore", "privateKey", "issuerRef"}, identity
            assert spec["commonName"] == identity and spec["secretName"] == f"{RELEASE}-kvshuttle-tls-{identity}"
            assert spec.get("dnsNames", []) == EXPECTED_DNS[identity]
            assert spec.get("ipAddresses", []) == EXPECTED_IPS.get(identity, [])
            assert {"server auth", "client auth"} <= set(spec["usages"])
            assert spec["issuerRef"] == {"name": f"{RELEASE}-kvshuttle-tls-ca", "kind": "Issuer",
                                         "group": "cert-manager.io"}
            assert re.fullmatch(r"\d+h", spec["duration"]) and re.fullmatch(r"\d+h", spec["renewBefore"])
        for name, (env, volumes) in pod_tls(docs).items():
            assert volumes["tls"]["secret"]["secretName"].startswith(f"{RELEASE}-kvshuttle-tls-"), name
    own = rendered("gpu-1p1d", *CERT_MANAGER, "--set", "tls.certManager.issuerRef.name=corp-ca",
                   "--set", "tls.certManager.issuerRef.kind=ClusterIssuer")
    assert not objects(own, "Issuer") and f"{RELEASE}-kvshuttle-tls-ca" not in objects(own, "Certificate")
    for identity in IDENTITIES:
        spec = objects(own, "Certificate")[f"{RELEASE}-kvshuttle-tls-{identity}"]["spec"]
        assert spec["issuerRef"] == {"name": "corp-ca", "kind": "ClusterIssuer", "group": "cert-manager.io"}


@pytest.mark.parametrize("variant", ["helm", "cert-manager", "existing", "gateway client certificates"])
def test_every_kvshuttle_pod_mounts_its_own_certificate_and_the_ca(variant):
    """Each Deployment mounts its identity's Secret (prefill and decode: worker's) and is given, as the services read
    them, the CA and its certificate to call with; the servers also serve with it, and the registry and the scheduler
    require client certificates. The gateway's gRPC API faces clients: client certificates only when asked."""
    extra = {"helm": (), "cert-manager": CERT_MANAGER, "existing": (),
             "gateway client certificates": ("--set", "gateway.grpcClientCertificates=true")}[variant]
    profile = "gpu-4p4d-external-etcd-tls" if variant == "existing" else "gpu-1p1d"
    docs = rendered(profile, *extra)
    secrets = {i: f"{RELEASE}-kvshuttle-tls-{i}" for i in POD_IDENTITY}
    if variant == "existing":
        secrets = merged_values(profile)["tls"]["existingSecrets"]
        assert not [n for n, s in objects(docs, "Secret").items() if s["type"] == "kubernetes.io/tls"]
        assert not objects(docs, "Certificate")
    pods = pod_tls(docs)
    assert sorted(pods) == sorted(f"{RELEASE}-kvshuttle-{c}" for c in ("registry", "scheduler", "gateway",
                                                                         "prefill", "decode"))
    for name, (env, volumes) in pods.items():
        component = name.removeprefix(f"{RELEASE}-kvshuttle-")
        identity = "worker" if component in ("prefill", "decode") else component
        assert volumes["tls"]["secret"]["secretName"] == secrets[identity], name
        assert env["KVSHUTTLE_TLS_CA"] == "/etc/kvshuttle/tls/ca.crt"
        assert (env["KVSHUTTLE_TLS_CLIENT_CERT"], env["KVSHUTTLE_TLS_CLIENT_KEY"]) == (
            "/etc/kvshuttle/tls/tls.crt", "/etc/kvshuttle/tls/tls.key")
        serves = identity != "worker"
        assert ("KVSHUTTLE_TLS_CERT" in env) == ("KVSHUTTLE_TLS_KEY" in env) == serves, name
        requires = identity in ("registry", "scheduler") or (
            identity == "gateway" and variant == "gateway client certificates")
        assert ("KVSHUTTLE_TLS_CLIENT_CA" in env) == requires, name
        assert "KVSHUTTLE_AUTHORIZE_CALLERS" not in env  # the services' default: authorize by identity
        template = objects(docs, "Deployment")[name]["spec"]["template"]
        assert template["metadata"]["annotations"]["kvshuttle.io/tls-checksum"], name


def test_the_certificates_name_every_address_their_callers_dial(pod_root):
    """Each address a kvshuttle container dials (registry, scheduler; the gateway its own gRPC API) is a name the
    server's certificate carries, so clients verify it without tls.serverName."""
    docs = rendered("gpu-1p1d")
    secrets = objects(docs, "Secret")
    for command, c in kvshuttle_containers(docs):
        cfg = parse(command, c["args"], container_env(c), pod_root)
        assert not cfg.tls_server_name
        for field in ("registry", "scheduler"):
            address = getattr(cfg, field, "")
            if address and address != "local":
                host = address.removeprefix("dns:///").rsplit(":", 1)[0]
                assert host in dns_names(certificate(secrets[f"{RELEASE}-kvshuttle-tls-{field}"])), (command, field)
        if command == "gateway":
            host = cfg.grpc_listen.rsplit(":", 1)[0]
            assert host in ip_addresses(certificate(secrets[f"{RELEASE}-kvshuttle-tls-gateway"]))


@pytest.fixture
def generated_certs(tmp_path) -> Path:
    """The Secrets of one render of the chart's own certificates, as files: <identity>/{ca.crt,tls.crt,tls.key}."""
    for name, secret in objects(rendered("gpu-1p1d"), "Secret").items():
        if name.startswith(f"{RELEASE}-kvshuttle-tls-"):
            d = tmp_path / name.removeprefix(f"{RELEASE}-kvshuttle-tls-")
            d.mkdir()
            for key, value in secret["data"].items():
                (d / key).write_bytes(base64.b64decode(value))
    return tmp_path


def test_the_generated_certificates_make_mutual_tls_work(generated_certs):
    """On real gRPC servers on loopback: a server with the registry's certificate requiring client certificates of
    the CA takes a worker's call that verifies the registry's Service name; it refuses a caller without a
    certificate and one with a certificate of another install's CA; a client verifying another Service's name
    refuses the server. The gateway's certificate serves its own REST bridge's calls on 0.0.0.0."""
    import asyncio

    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    from kvshuttle.services.common.grpc_server import Server, client_channel
    from kvshuttle.services.common.tls import ClientTls, ServerTls

    def files(identity: str, root: Path = generated_certs) -> dict[str, bytes]:
        return {k: (root / identity / k).read_bytes() for k in ("ca.crt", "tls.crt", "tls.key")}

    other = generated_certs / "other"
    for name, secret in objects(rendered("gpu-1p1d", "--set", "logLevel=WARNING"), "Secret").items():
        if name == f"{RELEASE}-kvshuttle-tls-worker":
            (other / "worker").mkdir(parents=True)
            for key, value in secret["data"].items():
                (other / "worker" / key).write_bytes(base64.b64decode(value))

    async def check(server_identity: str, target: str, client: ClientTls) -> str:
        f = files(server_identity)
        server = Server("0.0.0.0:0", [], [], tls=ServerTls(f["tls.crt"], f["tls.key"], f["ca.crt"]))
        await server.start()
        channel = client_channel(target.format(port=server.port), client)
        try:
            await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
            return "OK"
        except grpc.RpcError as exc:
            return exc.code().name
        finally:
            await channel.close()
            await server.stop()

    worker, gateway = files("worker"), files("gateway")
    as_worker = ClientTls(worker["ca.crt"], worker["tls.crt"], worker["tls.key"], f"{RELEASE}-kvshuttle-registry")

    async def all_checks() -> list[str]:
        return await asyncio.wait_for(asyncio.gather(*checks), timeout=60)

    checks = (
        check("registry", "127.0.0.1:{port}", as_worker),
        check("registry", "127.0.0.1:{port}", ClientTls(worker["ca.crt"], server_name=f"{RELEASE}-kvshuttle-registry")),
        check("registry", "127.0.0.1:{port}", ClientTls(worker["ca.crt"], *[
            (other / "worker" / k).read_bytes() for k in ("tls.crt", "tls.key")], f"{RELEASE}-kvshuttle-registry")),
        check("registry", "127.0.0.1:{port}", ClientTls(worker["ca.crt"], worker["tls.crt"], worker["tls.key"],
                                                        f"{RELEASE}-kvshuttle-scheduler")),
        check("gateway", "0.0.0.0:{port}", ClientTls(gateway["ca.crt"], gateway["tls.crt"], gateway["tls.key"])),
    )
    outcomes = asyncio.run(all_checks())
    assert outcomes == ["OK", "UNAVAILABLE", "UNAVAILABLE", "UNAVAILABLE", "OK"]


def test_turning_tls_off_takes_two_values_and_the_notes_warn():
    """tls.enabled=false alone fails the install (BROKEN above); with tls.allowInsecure=true the release has no
    certificates, no TLS settings in any pod, and NOTES.txt warns in capitals. With TLS on, NOTES shows how to call
    the internal APIs with the admin certificate."""
    docs = rendered("gpu-1p1d", *INSECURE)
    assert not [n for n in objects(docs, "Secret") if "-tls-" in n] and not objects(docs, "Certificate")
    for command, c in kvshuttle_containers(docs):
        assert not [k for k in container_env(c) if k.startswith("KVSHUTTLE_TLS_")], command
        assert "tls" not in {m["name"] for m in c.get("volumeMounts", [])}, command

    def notes(*extra: str) -> str:
        out = helm("install", RELEASE, str(CHART), "--dry-run=client", "--namespace", NAMESPACE,
                   "-f", str(ROOT / "deploy/helm/profiles/gpu-1p1d.yaml"), *extra)
        assert out.returncode == 0, out.stderr
        return out.stdout[out.stdout.index("NOTES:"):]

    off, on = notes(*INSECURE), notes()
    assert "WARNING: TLS IS OFF (tls.enabled=false, tls.allowInsecure=true)" in off
    assert "register a worker of its own" in off and "admin certificate" not in off
    assert "TLS IS OFF" not in on and "Mutual TLS between kvshuttle's services is on" in on
    assert f"get secret {RELEASE}-kvshuttle-tls-admin" in on
    assert re.search(rf"grpcurl -cacert ca.crt -cert admin.crt -key admin.key -servername {RELEASE}-kvshuttle-registry",
                     on)
    assert "networkPolicy.enabled is false" in notes("--set", "networkPolicy.enabled=false")
    assert "networkPolicy.enabled is false" not in on


# --- NetworkPolicy: exactly the paths kvshuttle uses ------------------------------------------------------------------

@dataclass(frozen=True)
class Peer:
    """A pod (namespace, labels, its namespace's labels) or, with namespace None, an address outside the cluster."""

    name: str
    namespace: str | None
    labels: tuple = ()
    namespace_labels: tuple = ()


OUTSIDE = (Peer("client pod", "apps", (("app", "client"),), (("kubernetes.io/metadata.name", "apps"),)),
           Peer("pod beside", NAMESPACE, (("app", "other"),), (("kubernetes.io/metadata.name", NAMESPACE),)),
           Peer("prometheus", "monitoring", (("app.kubernetes.io/name", "prometheus"),),
                (("kubernetes.io/metadata.name", "monitoring"),)),
           Peer("internet", None))


def selects(selector: dict, labels: tuple) -> bool:
    assert set(selector) <= {"matchLabels"}, selector  # all the chart uses
    have = dict(labels)
    return all(have.get(k) == v for k, v in selector.get("matchLabels", {}).items())


def peer_matches(rule_peer: dict, peer: Peer) -> bool:
    if "ipBlock" in rule_peer:
        return peer.namespace is None
    if peer.namespace is None:
        return False
    if "namespaceSelector" in rule_peer:
        in_namespace = selects(rule_peer["namespaceSelector"], peer.namespace_labels)
    else:
        in_namespace = peer.namespace == NAMESPACE
    return in_namespace and selects(rule_peer.get("podSelector", {}), peer.labels)


def port_matches(ports: list | None, port: int, protocol: str) -> bool:
    return not ports or any(p.get("protocol", "TCP") == protocol and (
        "port" not in p or p["port"] == port or p["port"] <= port <= p.get("endPort", p["port"])) for p in ports)


def side_allows(policies: list[dict], pod: Peer, kind: str, other: Peer, port: int, protocol: str) -> bool:
    """Whether the policies let ``pod`` take in (kind Ingress) or send out (Egress) this connection with ``other``."""
    if pod.namespace != NAMESPACE:
        return True  # no policy of the release applies to it
    selecting = [p["spec"] for p in policies if kind in p["spec"]["policyTypes"]
                 and selects(p["spec"]["podSelector"], pod.labels)]
    peers_key = "from" if kind == "Ingress" else "to"
    return not selecting or any(
        port_matches(rule.get("ports"), port, protocol)
        and (peers_key not in rule or any(peer_matches(p, other) for p in rule[peers_key]))
        for spec in selecting for rule in spec.get(kind.lower(), []))


def connection_allowed(policies: list[dict], src: Peer, dst: Peer, port: int, protocol: str = "TCP") -> bool:
    return side_allows(policies, dst, "Ingress", src, port, protocol) and side_allows(
        policies, src, "Egress", dst, port, protocol)


def release_pods(docs) -> dict[str, tuple[Peer, set[int]]]:
    """component -> (its pods as a peer, the ports its containers declare)."""
    out = {}
    for d in docs:
        template = d["spec"]["template"] if d["kind"] in ("Deployment", "StatefulSet") else d if d["kind"] == "Pod" \
            else None
        if template is None:
            continue
        labels = template["metadata"]["labels"]
        ports = {p["containerPort"] for c in template["spec"]["containers"] for p in c.get("ports", [])}
        out[labels["app.kubernetes.io/component"]] = (
            Peer(labels["app.kubernetes.io/component"], NAMESPACE, tuple(sorted(labels.items())),
                 (("kubernetes.io/metadata.name", NAMESPACE),)), ports)
    return out


def allowed_paths(docs) -> tuple[set, set, set]:
    """(component -> component, outside -> component, component -> outside) connections the policies allow, probed
    on every declared port, every port a policy names, and NIXL's transfer range's ends and neighbours."""
    policies = [d for d in docs if d["kind"] == "NetworkPolicy"]
    pods = release_pods(docs)
    named = {p["port"] for pol in policies for kind in ("ingress", "egress") for r in pol["spec"].get(kind, [])
             for p in r.get("ports", [])}
    probe = named | {p for _, ports in pods.values() for p in ports} | {80, 443, 8080}
    for d in docs:  # NIXL's transfer range (workers' UCX_TCP_PORT_RANGE): its ends, middle and neighbours
        if d["kind"] == "Deployment":
            ranges = container_env(d["spec"]["template"]["spec"]["containers"][0]).get("UCX_TCP_PORT_RANGE")
            if ranges:
                first, last = map(int, ranges.split("-"))
                probe |= {first - 1, first, (first + last) // 2, last, last + 1}
    inside = {(s, d, port) for s, (src, _) in pods.items() for d, (dst, ports) in pods.items()
              for port in probe if connection_allowed(policies, src, dst, port)}
    inbound = {(o.name, d, port) for o in OUTSIDE for d, (dst, _) in pods.items() for port in probe
               if connection_allowed(policies, o, dst, port)}
    outbound = {(s, o.name, port, proto) for s, (src, _) in pods.items() for o in OUTSIDE
                for port in probe | {53} for proto in ("TCP", "UDP") if connection_allowed(policies, src, o, port, proto)}
    return inside, inbound, outbound


WORKERS = ("prefill", "decode")


def expected_inside(values: dict, pods: set[str]) -> set:
    """The calls kvshuttle makes between its pods (deploy/README.md, "What runs where"), and nothing else; `helm
    test`'s pod (when the release has one) calls the gateway."""
    reg, sched, grpc = values["registry"]["port"], values["scheduler"]["port"], values["workers"]["grpcPort"]
    first, last = values["workers"]["nixlTransferPorts"]["first"], values["workers"]["nixlTransferPorts"]["last"]
    paths = {(src, "registry", reg) for src in ("gateway", "scheduler", *WORKERS)}
    paths |= {("gateway", "scheduler", sched)}
    paths |= {(src, w, grpc) for src in ("gateway", "scheduler") for w in WORKERS}
    paths |= {(a, b, port) for a in WORKERS for b in WORKERS
              for port in (values["workers"]["nixlPort"], first, (first + last) // 2, last)}
    stores = ["registry", "scheduler"] + (["gateway"] if values["gateway"]["planInProcess"] else [])
    if values["etcd"]["mode"] == "bundled":
        paths |= {(s, "etcd", values["etcd"]["bundled"]["clientPort"]) for s in stores}
        paths |= {("etcd", "etcd", values["etcd"]["bundled"]["peerPort"])}
    redis_clients = stores + (["prefill", "decode"] if values["kvFeed"]["enabled"] else [])  # they publish the feeds
    if values["historyStore"]["bundled"]:
        paths |= {(s, "history", values["historyStore"]["port"]) for s in redis_clients}
    if "smoke-test" in pods:
        paths.add(("smoke-test", "gateway", values["gateway"]["httpPort"]))
    return paths


def expected_outside(values: dict, pods: set[str]) -> tuple[set, set]:
    """(inbound, outbound): clients anywhere reach the gateway's ports; Prometheus the metrics ports; every pod may
    look names up; the rest goes out only where the values point outside (tracing, external etcd and Redis)."""
    g = values["gateway"]
    inbound = {(o.name, "gateway", port) for o in OUTSIDE for port in (g["httpPort"], g["grpcPort"])}
    metrics = {c: values["metrics"]["port"] for c in ("gateway", "registry", "scheduler", *WORKERS)}
    if values["etcd"]["mode"] == "bundled":
        metrics["etcd"] = 2381
    inbound |= {("prometheus", c, port) for c, port in metrics.items()}
    outbound = {(p, o.name, 53, proto) for p in pods for o in OUTSIDE for proto in ("TCP", "UDP")}
    out_ports = {c: set() for c in ("gateway", "registry", "scheduler", *WORKERS)}
    if values["tracing"]["enabled"]:
        for ports in out_ports.values():
            ports.add(int(values["tracing"]["otlpEndpoint"].rsplit(":", 1)[1]))
    stores = ["registry", "scheduler"] + (["gateway"] if g["planInProcess"] else [])
    if values["etcd"]["mode"] == "external":
        for s in stores:
            out_ports[s] |= {int(e.rsplit(":", 1)[1]) for e in values["etcd"]["external"]["endpoints"]}
    if not values["historyStore"]["bundled"]:
        for s in stores + (list(WORKERS) if values["kvFeed"]["enabled"] else []):
            out_ports[s].add(int(re.search(r":(\d+)(/|$)", values["historyStore"]["url"].split("@")[-1]).group(1)))
    outbound |= {(c, o.name, port, "TCP") for c, ports in out_ports.items() for port in ports for o in OUTSIDE}
    return inbound, outbound


NETWORK_CASES = {
    "default": ("gpu-1p1d", ()),
    "cpu dev": ("cpu-dev", ()),
    "4p4d, external etcd": ("gpu-4p4d-external-etcd-tls", ()),
    "planning in the gateway, own Redis": ("gpu-1p1d", ("--set", "gateway.planInProcess=true", "--set",
                                                         "historyStore.bundled=false", "--set",
                                                         "historyStore.url=rediss://redis.infra.svc:6380/3")),
    "KV feed off": ("gpu-1p1d", ("--set", "kvFeed.enabled=false")),
    "KV feed off, own Redis": ("gpu-4p4d-external-etcd-tls", ("--set", "kvFeed.enabled=false", "--set",
                                                               "historyStore.bundled=false", "--set",
                                                               "historyStore.url=redis://redis.infra.svc:6390/0")),
}


@pytest.mark.parametrize("case", sorted(NETWORK_CASES))
def test_network_policies_allow_exactly_the_paths_kvshuttle_uses(case):
    """Evaluating the rendered NetworkPolicies as Kubernetes does (a pod selected by a policy of a direction takes
    only what one of them allows; a connection needs the sender's egress and the receiver's ingress): between the
    release's pods exactly the calls kvshuttle makes pass; from outside only clients to the gateway and Prometheus to
    the metrics ports; out of the release only DNS and what the values point outside."""
    profile, extra = NETWORK_CASES[case]
    docs = rendered(profile, *extra)
    values = merged_values(profile)
    for i in range(0, len(extra), 2):
        key, value = extra[i + 1].split("=", 1)
        node = values
        *parents, leaf = key.split(".")
        for part in parents:
            node = node[part]
        node[leaf] = yaml.safe_load(value)
    inside, inbound, outbound = allowed_paths(docs)
    pods = set(release_pods(docs))
    want_inside = expected_inside(values, pods)
    assert inside == want_inside, inside ^ want_inside
    want_in, want_out = expected_outside(values, pods)
    assert inbound == want_in, inbound ^ want_in
    assert outbound == want_out, outbound ^ want_out


def test_network_policy_values_open_what_they_say():
    """gatewayFrom narrows the gateway's clients (Prometheus keeps its scrape); metricsFrom names the scrapers;
    networkPolicy.enabled=false renders none, and then everything passes (the evaluation above can tell)."""
    docs = rendered("gpu-1p1d", "--set-json", 'networkPolicy.gatewayFrom=[{"namespaceSelector": {"matchLabels": '
                    '{"kubernetes.io/metadata.name": "apps"}}}]', "--set-json",
                    'networkPolicy.metricsFrom=[{"namespaceSelector": {"matchLabels": '
                    '{"kubernetes.io/metadata.name": "monitoring"}}}]')
    _, inbound, _ = allowed_paths(docs)
    to_gateway = {(o, port) for o, d, port in inbound if d == "gateway"}
    assert to_gateway == {("client pod", 8000), ("client pod", 50053), ("prometheus", 9090)}
    assert {o for o, d, _ in inbound if d == "registry"} == {"prometheus"}
    off = rendered("gpu-1p1d", "--set", "networkPolicy.enabled=false")
    assert not objects(off, "NetworkPolicy")
    inside, inbound, _ = allowed_paths(off)
    assert ("pod beside", "registry", 50051) in inbound and ("gateway", "etcd", 2379) in inside


def test_workers_listen_for_nixl_transfers_where_the_policy_opens():
    """NIXL's UCX TCP transfers listen in workers.nixlTransferPorts (UCX_TCP_PORT_RANGE in the worker's
    environment, which vLLM inherits), the range the NetworkPolicy opens between workers."""
    docs = rendered("gpu-1p1d", "--set", "workers.nixlTransferPorts.first=31000", "--set",
                    "workers.nixlTransferPorts.last=31099")
    for role in WORKERS:
        container = objects(docs, "Deployment")[f"{RELEASE}-kvshuttle-{role}"]["spec"]["template"]["spec"][
            "containers"][0]
        assert container_env(container)["UCX_TCP_PORT_RANGE"] == "31000-31099"
    inside, _, _ = allowed_paths(docs)
    assert ("prefill", "decode", 31000) in inside and ("decode", "prefill", 31099) in inside
    assert ("prefill", "decode", 20000) not in inside
