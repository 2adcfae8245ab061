"""The built wheel, installed into a clean virtual environment: only ``kvshuttle`` is importable from it.

The wheel is built from the checkout (no build isolation: setuptools of the project's venv, no network) and installed
without dependencies into a fresh venv that finds the dependencies in the project's venv through a path file, never
its editable install of kvshuttle. Checked from a directory outside the checkout: the wheel holds only the
``kvshuttle`` package (the design card's folders mapped under it), every module of the project imports from the
wheel, the console script and ``python -m`` run, the vLLM plugin entry point names a module of the wheel, and the old
top-level names (``services``, ``workers``, ``control_plane``) are not importable.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

from tests.support.import_graph import modules

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out, src = tmp_path_factory.mktemp("wheel"), tmp_path_factory.mktemp("src")
    # What the images copy in to build it (deploy/docker); built from a copy, so the checkout gets no build/.
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    for folder in ("protos/gen", "control_plane", "services", "workers"):
        shutil.copytree(ROOT / folder, src / folder, ignore=shutil.ignore_patterns("__pycache__"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(out),
                    str(src)], check=True, capture_output=True, text=True, timeout=240)
    (built,) = out.glob("kvshuttle-*.whl")
    return built


@pytest.fixture(scope="module")
def venv(wheel, tmp_path_factory) -> Path:
    home = tmp_path_factory.mktemp("venv")
    subprocess.run([sys.executable, "-m", "venv", str(home)], check=True, timeout=120)
    python = home / "bin" / "python"
    site = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          check=True, capture_output=True, text=True).stdout.strip()
    # The dependencies from the project's venv (a plain path entry: its editable-install hooks are not run).
    Path(site, "deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    subprocess.run([python, "-m", "pip", "install", "-q", "--no-deps", "--no-index", str(wheel)], check=True,
                   capture_output=True, text=True, timeout=120)
    return home


def run(venv: Path, *argv: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(argv, cwd=cwd, capture_output=True, text=True, timeout=120,
                          env={"PATH": f"{venv / 'bin'}:/usr/bin:/bin", "HOME": str(cwd)})


def test_the_wheel_holds_only_kvshuttle(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    assert {n.split("/")[0] for n in names} == {"kvshuttle", wheel.name.split("-")[0] + "-0.1.0.dist-info"}
    shipped = {n.removesuffix(".py").removesuffix("/__init__").replace("/", ".") for n in names if n.endswith(".py")}
    assert set(modules(ROOT)) <= shipped
    assert "kvshuttle.v1.registry_pb2" in shipped
    entry_points = zipfile.ZipFile(wheel).read(next(n for n in names if n.endswith("entry_points.txt"))).decode()
    assert "kvshuttle = kvshuttle.services.commands.cli:main" in entry_points
    assert "kvshuttle-nixl = kvshuttle.workers.vllm_plugin:register" in entry_points


def test_every_module_imports_from_the_installed_wheel(venv, tmp_path):
    names = sorted(m for m in modules(ROOT) if not m.endswith("__main__"))
    code = ("import importlib, sys\n"
            f"for name in {names!r}:\n"
            "    module = importlib.import_module(name)\n"
            f"    assert module.__file__.startswith({str(venv)!r}), module.__file__\n"
            "print(len(sys.modules))\n")
    done = run(venv, str(venv / "bin" / "python"), "-c", code, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]


def test_the_console_script_and_python_m_run(venv, tmp_path):
    done = run(venv, str(venv / "bin" / "kvshuttle"), "--help", cwd=tmp_path)
    assert done.returncode == 0 and "kvshuttle <command>" in done.stdout, done.stderr[-2000:]
    done = run(venv, str(venv / "bin" / "python"), "-m", "kvshuttle.services.commands", "registry", "--help",
               cwd=tmp_path)
    assert done.returncode == 0 and "--etcd-endpoints" in done.stdout, done.stderr[-2000:]


@pytest.mark.parametrize("old", ["services", "workers", "control_plane"])
def test_the_old_top_level_names_are_gone(venv, tmp_path, old):
    done = run(venv, str(venv / "bin" / "python"), "-c", f"import {old}", cwd=tmp_path)
    assert done.returncode != 0 and f"No module named '{old}'" in done.stderr, (done.stdout, done.stderr)
