"""Shared fixtures."""

from __future__ import annotations

import fcntl
import os
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import pytest_asyncio

from services.etcd_process import EtcdProcess
from services.registry.server import RegistryConfig, serve

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def model_dir() -> Path:
    """The tiny offline test model, built once into ``var/models/tiny`` (kept between runs; rebuilt on recipe change).

    Override the location with ``KVSHUTTLE_TEST_MODEL_DIR``. Needs the worker extras (torch, transformers).
    """
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from workers.model_builder import build_model

    out = Path(os.environ.get("KVSHUTTLE_TEST_MODEL_DIR", REPO / "var" / "models" / "tiny"))
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.parent / f".{out.name}.lock", "w") as lock:  # parallel sessions build it once
        fcntl.flock(lock, fcntl.LOCK_EX)
        return build_model(out, "tiny")


@pytest.fixture(scope="session")
def etcd() -> Iterator[str]:
    """A real etcd on loopback for the whole session (data under /dev/shm); yields its endpoints (``127.0.0.1:PORT``).

    ``KVSHUTTLE_TEST_ETCD_ENDPOINTS`` points the tests at an etcd you run yourself instead.
    """
    external = os.environ.get("KVSHUTTLE_TEST_ETCD_ENDPOINTS")
    if external:
        yield external
        return
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
