"""The proto contract: committed stubs match a fresh generation, and buf lint/build pass."""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

PROTOS = Path(__file__).resolve().parents[2] / "protos"
GEN = PROTOS / "gen"
REGENERATE = "run `python protos/generate.py` and commit protos/gen/"

pytestmark = pytest.mark.timeout(300)


def _load_generate():
    spec = importlib.util.spec_from_file_location("kvshuttle_protos_generate", PROTOS / "generate.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*"))
            if p.is_file() and "__pycache__" not in p.parts and p.suffix != ".pyc"}


def test_committed_stubs_are_fresh(tmp_path):
    _load_generate().generate(tmp_path)
    fresh, committed = _files(tmp_path), _files(GEN)
    missing = sorted(set(fresh) - set(committed))
    extra = sorted(set(committed) - set(fresh))
    stale = sorted(name for name in set(fresh) & set(committed) if fresh[name] != committed[name])
    assert not (missing or extra or stale), (
        f"protos/gen/ is out of date with the .proto files: missing {missing}, unexpected {extra}, "
        f"stale {stale}; {REGENERATE}")


def buf_binary() -> str:
    """buf from the venv running the tests (the buf-bin package), else from PATH; fails with an install hint."""
    candidate = Path(sys.executable).parent / "buf"
    found = str(candidate) if candidate.is_file() else shutil.which("buf")
    if not found:
        pytest.fail("buf is not installed: `pip install buf-bin==1.75.0` (in the dev extras: pip install -e '.[dev]')")
    return found


def _buf(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([buf_binary(), *args], cwd=PROTOS, capture_output=True, text=True, timeout=240)


def test_buf_lint_is_clean():
    result = _buf("lint")
    assert result.returncode == 0 and not result.stdout.strip() and not result.stderr.strip(), (
        f"buf lint (in protos/) failed with {result.returncode}:\n{result.stdout}{result.stderr}")


def test_buf_build(tmp_path):
    image = tmp_path / "image.binpb"
    result = _buf("build", "-o", str(image))
    assert result.returncode == 0, f"buf build (in protos/) failed:\n{result.stdout}{result.stderr}"
    from google.protobuf import descriptor_pb2

    files = descriptor_pb2.FileDescriptorSet.FromString(image.read_bytes()).file
    names = {f.name for f in files}
    assert {"kvshuttle/v1/common.proto", "kvshuttle/v1/registry.proto", "kvshuttle/v1/scheduler.proto",
            "kvshuttle/v1/gateway.proto"} <= names, names
    services = {f"{f.package}.{s.name}" for f in files for s in f.service}
    assert services >= {"kvshuttle.v1.SessionRegistry", "kvshuttle.v1.TransferScheduler", "kvshuttle.v1.Gateway"}
