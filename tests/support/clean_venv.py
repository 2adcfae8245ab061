"""kvshuttle in a clean virtual environment, as its users get it: the wheel built, installed by pip, and checked.

The venv sees neither the project's ``.venv`` nor the checkout: pip runs with a clean environment (``PATH``, ``HOME``
for pip's configuration and cache, the ``PIP_*`` and proxy variables; no ``PYTHONPATH``, no ``VIRTUAL_ENV``) and the
checks run from an empty directory with ``HOME`` pointing there. :func:`check` imports, in one child interpreter,
every module an install is meant to run (kvshuttle.services.commands.installs), looks up every third-party module
their functions import, and runs ``kvshuttle <command> --help`` for each command: exit 0 where the install serves the
command, else exit non-zero with one line on stderr naming the pip command that gives it.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

from kvshuttle.services.commands import cli
from kvshuttle.services.commands.installs import Install, install_of, runs

from tests.support.import_graph import modules
from tests.support.install_imports import run_by

ROOT = Path(__file__).resolve().parents[2]
# What the images copy in to build the project (deploy/docker/*.Dockerfile).
PROJECT_FILES = ("pyproject.toml", "README.md")
PROJECT_DIRS = ("protos/gen", "control_plane", "services", "workers")
SYSTEM_PATH = "/usr/sbin:/usr/bin:/sbin:/bin"
PASSED_ON = ("HTTP_PROXY", "HTTPS_PROXY", "NO_PROXY", "http_proxy", "https_proxy", "no_proxy", "SSL_CERT_FILE",
             "SSL_CERT_DIR", "REQUESTS_CA_BUNDLE")


def build_wheel(out: Path, src: Path) -> Path:
    """The wheel, built from a copy of what the images copy (the checkout gets no build/), without build isolation
    (the project venv's setuptools, no network)."""
    for name in PROJECT_FILES:
        shutil.copy(ROOT / name, src / name)
    for folder in PROJECT_DIRS:
        shutil.copytree(ROOT / folder, src / folder, ignore=shutil.ignore_patterns("__pycache__"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(out),
                    str(src)], check=True, capture_output=True, text=True, timeout=240)
    (built,) = out.glob("kvshuttle-*.whl")
    return built


def pip_env(path: str) -> dict[str, str]:
    """What pip sees: this machine's pip configuration and cache (``HOME``, ``PIP_*``), proxies; nothing else."""
    env = {k: v for k, v in os.environ.items() if k.startswith("PIP_") or k in PASSED_ON}
    return {**env, "PATH": path, "HOME": os.environ.get("HOME", "/root"), "LANG": "C.UTF-8"}


def new_venv(home: Path) -> Path:
    subprocess.run([sys.executable, "-m", "venv", str(home)], check=True, capture_output=True, timeout=180)
    return home


def pip_install(venv: Path, wheel: Path, extras: tuple[str, ...], cwd: Path, timeout: float) -> float:
    """``pip install 'WHEEL[extras]'`` in the venv, as a user runs it, less the byte-compiling of what it installs
    (``--no-compile``: the same files, resolved the same way; compiling vLLM and torch costs a minute of CPU);
    returns the seconds it took."""
    target = f"{wheel}[{','.join(extras)}]" if extras else str(wheel)
    start = time.monotonic()
    done = subprocess.run([str(venv / "bin" / "pip"), "install", "-q", "--no-compile", target], cwd=cwd,
                          capture_output=True, text=True, timeout=timeout,
                          env=pip_env(f"{venv / 'bin'}:{SYSTEM_PATH}"))
    assert done.returncode == 0, f"pip install {target} failed:\n{done.stdout[-3000:]}\n{done.stderr[-5000:]}"
    return time.monotonic() - start


_EARLY: dict[tuple[str, ...], Future] = {}


def install_early(root: Path, extras: tuple[str, ...]) -> Future:
    """Build the wheel and ``pip install`` it with ``extras`` into a new venv under ``root``, in a thread of its own,
    from now on (once per session and extras): a future of (venv, seconds pip took). tests/deploy/conftest.py starts
    the worker install (minutes of pip, mostly one core) as soon as the session is collected, so that it runs beside
    the slow and end-to-end tests that come before tests/deploy, not after them."""
    if extras not in _EARLY:
        def work() -> tuple[Path, float]:
            (root / "wheel").mkdir(parents=True, exist_ok=True)
            (root / "src").mkdir(parents=True, exist_ok=True)
            wheel = build_wheel(root / "wheel", root / "src")
            venv = new_venv(root / "venv")
            return venv, pip_install(venv, wheel, extras, root, timeout=1800)

        pool = ThreadPoolExecutor(1, thread_name_prefix="install-early")
        _EARLY[extras] = pool.submit(work)
        pool.shutdown(wait=False)
    return _EARLY[extras]


def run_env(venv: Path, home: Path) -> dict[str, str]:
    return {"PATH": f"{venv / 'bin'}:{SYSTEM_PATH}", "HOME": str(home), "LANG": "C.UTF-8"}


# Run by the venv's interpreter: argv[1] is a JSON object (modules, third_party, venv); prints a JSON report.
_CHILD = r"""
import importlib, importlib.util, json, sys, traceback
want = json.loads(sys.argv[1])
report = {"errors": {}, "absent": [], "not_installed": [], "outside": []}
for name in want["modules"]:
    try:
        module = importlib.import_module(name)
    except ModuleNotFoundError as exc:
        if exc.name and exc.name.startswith("kvshuttle.") and name.startswith(exc.name):
            report["absent"].append(name)
            continue
        report["errors"][name] = traceback.format_exc(limit=-3)
        continue
    except BaseException:
        report["errors"][name] = traceback.format_exc(limit=-3)
        continue
    if not (module.__file__ or "").startswith(want["venv"]):
        report["outside"].append(f"{name}: {module.__file__}")
for top in want["third_party"]:
    if importlib.util.find_spec(top) is None:
        report["not_installed"].append(top)
try:
    import tests
    report["outside"].append(f"the project's tests are importable: {tests.__path__}")
except ImportError:
    pass
print(json.dumps(report))
"""


def check(install: Install, venv: Path, cwd: Path, absent_ok: tuple[str, ...] = ()) -> list[str]:
    """What is wrong with ``install`` in ``venv`` ([] when nothing): modules it runs that fail to import or load from
    elsewhere, third-party modules their code imports that are not installed, commands that do not run or, not
    served here, do not say in one line which install has them. ``absent_ok``: module prefixes the venv may lack
    (the control-plane image removes the development tools)."""
    mods = modules(ROOT)
    names = sorted(m for m in mods if runs(install, m) and not m.endswith("__main__"))
    third_party = sorted({imp.imported.split(".")[0] for m in names for imp in run_by(install, m, mods)})
    want = {"modules": names, "third_party": third_party, "venv": str(venv)}
    done = subprocess.run([str(venv / "bin" / "python"), "-c", _CHILD, json.dumps(want)], cwd=cwd,
                          capture_output=True, text=True, timeout=300, env=run_env(venv, cwd))
    assert done.returncode == 0, done.stderr[-5000:]
    report = json.loads(done.stdout.splitlines()[-1])
    problems = [f"{install.name}: import {name}: {error.strip().splitlines()[-1]}\n{error}"
                for name, error in report["errors"].items()]
    problems += [f"{install.name}: {top} is not installed (imported by the code it runs)"
                 for top in report["not_installed"]]
    problems += [f"{install.name}: {line}" for line in report["outside"]]
    absent = set(report["absent"])
    problems += [f"{install.name}: {name} is not in the venv" for name in sorted(absent)
                 if not name.startswith(absent_ok)]

    def command(name: str) -> str | None:
        module = cli.COMMANDS[name][0]
        needs = install_of(module)
        served = runs(install, module) and module not in absent
        done = subprocess.run([str(venv / "bin" / "kvshuttle"), name, "--help"], cwd=cwd, capture_output=True,
                              text=True, timeout=120, env=run_env(venv, cwd))
        if served:
            if done.returncode != 0 or "usage: kvshuttle" not in done.stdout:
                return f"kvshuttle {name} --help: exit {done.returncode}\n{done.stderr[-3000:]}"
            return None
        lines = done.stderr.strip().splitlines()
        if done.returncode == 0 or len(lines) != 1 or needs.pip not in lines[0]:
            return (f"kvshuttle {name} --help (needs {needs.name}): exit {done.returncode}, expected non-zero and one "
                    f"line naming `{needs.pip}`; stderr:\n{done.stderr[-3000:]}")
        return None

    with ThreadPoolExecutor(2) as pool:
        problems += [f"{install.name}: {p}" for p in pool.map(command, cli.COMMANDS) if p]
    return problems
