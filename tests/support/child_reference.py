"""Running a reference implementation (vLLM's own parsers) on test cases in a child process.

vLLM must not be imported into the pytest process (it crashes grpc_tools' protoc there later), so a reference module
runs itself as a module (``python -m``, from the repository's root): :func:`start` writes the cases to a JSON file and
starts ``module``; its ``__main__`` calls
:func:`serve` with its per-case function, which reads the cases, runs each (an exception becomes ``{"error": ...}``)
and writes the results to another file (not stdout: vLLM may print there); :func:`results` waits and reads them.
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

VENV_PYTHON = Path(sys.executable)
ROOT = Path(__file__).resolve().parents[2]


def serve(run: Callable[[dict], dict[str, Any]]) -> None:
    """The script's main: ``argv[1]`` holds the cases, ``argv[2]`` gets the results."""
    logging.disable(logging.CRITICAL)  # vLLM logs every answer it cannot parse, with a traceback
    out = []
    for case in json.loads(Path(sys.argv[1]).read_text(encoding="utf-8")):
        try:
            out.append(run(case))
        except Exception as exc:  # noqa: BLE001 - reported to the test, which names the case
            out.append({"error": f"{type(exc).__name__}: {exc}"})
    Path(sys.argv[2]).write_text(json.dumps(out), encoding="utf-8")


def start(module: str, cases: list[dict], workdir: Path, name: str) -> subprocess.Popen:
    """Start ``module`` on ``cases`` (importing vLLM takes seconds): :func:`results` collects them."""
    cases_path, results_path = workdir / f"{name}_cases.json", workdir / f"{name}_results.json"
    cases_path.write_text(json.dumps(cases), encoding="utf-8")
    return subprocess.Popen([str(VENV_PYTHON), "-m", module, str(cases_path), str(results_path)], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


def results(proc: subprocess.Popen, timeout: float, what: str) -> list[dict]:
    output, _ = proc.communicate(timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"{what} run failed ({proc.returncode}):\n{output.decode('utf-8', 'replace')[-4000:]}")
    return json.loads(Path(proc.args[-1]).read_text(encoding="utf-8"))
