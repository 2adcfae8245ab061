"""A real Redis server on loopback for tests and the local stack (the cluster's history store).

Its life cycle is :class:`~kvshuttle.services.devtools.server_process.ServerProcess`'s, as for etcd: a free port, a
data dir under /dev/shm removed on stop, its own process group, death with its parent (PR_SET_PDEATHSIG) and an
atexit hook, so no stray server survives a test run. Without ``persistent`` it keeps nothing on disk
(``--save "" --appendonly no``).
"""

from __future__ import annotations

import os
import shutil
import socket
from pathlib import Path

from kvshuttle.services.devtools.server_process import ServerProcess, free_port

REDIS_BIN = os.environ.get("KVSHUTTLE_REDIS_BIN") or shutil.which("redis-server") or "/usr/bin/redis-server"


class RedisError(RuntimeError):
    """redis-server did not start or did not answer PING; the message carries the tail of its log."""


class RedisProcess(ServerProcess):
    """One redis-server on 127.0.0.1; ``url`` is ``redis://127.0.0.1:PORT/0``. ``persistent``: an append-only file
    (fsync every second) in ``data_dir``, so a restart on the same dir (``kill()``, ``start()``) keeps the data."""

    kind = "redis"
    error = RedisError
    dir_prefix = "kvshuttle-redis-"
    not_ready = "did not answer PING in"
    poll_s = 0.02

    def __init__(self, name: str = "redis", *, port: int | None = None, data_dir: str | Path | None = None,
                 persistent: bool = False, extra_args: list[str] | None = None):
        self.port = port or free_port()
        self.persistent = persistent
        self.extra_args = list(extra_args or [])
        super().__init__(name, data_dir)

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def _address(self) -> str:
        return self.url

    def _command(self) -> list[str]:
        persistence = (["--appendonly", "yes", "--appendfsync", "everysec"] if self.persistent
                       else ["--save", "", "--appendonly", "no"])
        return [REDIS_BIN, "--bind", "127.0.0.1", "--port", str(self.port), "--dir", str(self.data_dir),
                "--daemonize", "no", "--loglevel", "warning", *persistence, *self.extra_args]

    def _make_dirs(self) -> None:
        self.data_dir.mkdir(parents=True, exist_ok=True)

    def healthy(self, timeout: float = 1.0) -> bool:
        """True when the server answers PING."""
        if not self.running:
            return False
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=timeout) as s:
                s.sendall(b"PING\r\n")
                return s.recv(64).startswith(b"+PONG")
        except OSError:
            return False

    def _move_to_new_port(self) -> bool:
        self.port = free_port()
        return True

    def wait_healthy(self, timeout: float = 10.0) -> None:
        super().wait_healthy(timeout)

    async def await_healthy(self, timeout: float = 10.0) -> None:
        await super().await_healthy(timeout)

    def start(self, timeout: float = 10.0) -> str:
        """Start and wait until it answers PING; returns ``url``. Retries on a new port when the port was taken."""
        return super().start(timeout)

    async def astart(self, timeout: float = 10.0) -> str:
        return await super().astart(timeout)
