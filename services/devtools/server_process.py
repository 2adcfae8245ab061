"""The life cycle shared by the real servers the tests and the local launcher run on loopback (etcd, Redis).

:class:`ServerProcess` spawns a server in its own process group that dies with its parent (PR_SET_PDEATHSIG), logs
to a file beside its data dir (under /dev/shm when writable: cheap fsyncs; dirs left by killed runs are swept),
waits for it to answer its health check, retries on a new port when the port was taken, and stops it (removing a
data dir it created). Anything still running at interpreter exit is stopped by an atexit hook, so no stray servers
survive a test run. A subclass gives the command line, the health check and how to move to a new port.
"""

from __future__ import annotations

import abc
import asyncio
import atexit
import contextlib
import os
import random
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
from pathlib import Path
from typing import ClassVar, Self

from kvshuttle.services.common.processes import die_with_parent

_SHM = Path("/dev/shm")
_live: set[ServerProcess] = set()
_live_lock = threading.Lock()


def _sweep_stale(base: Path, prefix: str) -> None:
    """Remove data dirs (and logs) whose owning process is gone: SIGKILL skips atexit, and /dev/shm is RAM."""
    for path in base.glob(f"{prefix}*"):
        pid = path.name[len(prefix):].split("-", 1)[0]
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            os.kill(int(pid), 0)
            continue  # owner alive
        except ProcessLookupError:
            pass
        except PermissionError:
            continue
        if path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
        else:
            with contextlib.suppress(OSError):
                path.unlink()


def _ephemeral_range() -> tuple[int, int]:
    try:
        low, high = (int(x) for x in Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
        return low, high
    except (OSError, ValueError):
        return 32768, 60999


def free_port(host: str = "127.0.0.1") -> int:
    """A port that was free a moment ago, for a server to listen on.

    Picked below the kernel's ephemeral range when there is room: a port the kernel hands out (port 0) is also what
    it gives outgoing connections as their local port, and on a busy machine one of those can take it before the
    server binds (seen: vLLM's NIXL side channel failing with "Address already in use"). Falls back to port 0.
    """
    low, _ = _ephemeral_range()
    lo = 20000 if low > 21000 else 1024
    if low - lo > 100:
        for _ in range(50):
            port = random.randint(lo, low - 1)
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                try:
                    s.bind((host, port))
                except OSError:
                    continue
                return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class ServerProcess(abc.ABC):
    """One server process on 127.0.0.1 with a data dir (``data_dir``: a new one under /dev/shm, removed on stop, when
    None). ``proc`` is its Popen while it runs. Subclasses set the class attributes and the abstract hooks."""

    kind: ClassVar[str]  # in error messages: "etcd s1 exited with ..."
    error: ClassVar[type[RuntimeError]]  # raised when the server does not start or answer
    dir_prefix: ClassVar[str]  # of the data dirs it creates (and sweeps)
    not_ready: ClassVar[str] = "not healthy after"  # "<kind> <name> {not_ready} 20s: <log tail>"
    poll_s: ClassVar[float] = 0.05

    def __init__(self, name: str, data_dir: str | Path | None):
        self.name = name
        self._own_dir = data_dir is None
        if data_dir is None:
            base = _SHM if _SHM.is_dir() and os.access(_SHM, os.W_OK) else Path(tempfile.gettempdir())
            _sweep_stale(base, self.dir_prefix)
            data_dir = tempfile.mkdtemp(prefix=f"{self.dir_prefix}{os.getpid()}-{name}-", dir=base)
        self.data_dir = Path(data_dir)
        self.proc: subprocess.Popen | None = None
        self._log_path = self.data_dir.parent / f"{self.data_dir.name}.log"

    # -- hooks ----------------------------------------------------------------------------------------------

    @abc.abstractmethod
    def _command(self) -> list[str]:
        """The server's command line."""

    @abc.abstractmethod
    def healthy(self, timeout: float = 1.0) -> bool:
        """True when the server runs and answers its health check."""

    @abc.abstractmethod
    def _address(self) -> str:
        """What ``start()`` returns: the address clients use."""

    @abc.abstractmethod
    def _move_to_new_port(self) -> bool:
        """Pick new ports after a port clash; False when the server cannot move."""

    def _make_dirs(self) -> None:
        self._log_path.parent.mkdir(parents=True, exist_ok=True)

    # -- life cycle ------------------------------------------------------------------------------------------

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def spawn(self) -> None:
        """Start the process without waiting for health (the members of a new etcd cluster start together)."""
        if self.running:
            return
        args = self._command()
        self._make_dirs()
        log = open(self._log_path, "ab")
        try:
            self.proc = subprocess.Popen(die_with_parent(args, signal.SIGKILL), stdin=subprocess.DEVNULL,
                                         stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        finally:
            log.close()
        with _live_lock:
            _live.add(self)

    def _check_alive(self) -> None:
        if not self.running:
            raise self.error(f"{self.kind} {self.name} exited with {self.proc.returncode if self.proc else None}: "
                             f"{self.log_tail()}")

    def wait_healthy(self, timeout: float = 20.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.healthy():
                return
            self._check_alive()
            time.sleep(self.poll_s)
        raise self.error(f"{self.kind} {self.name} {self.not_ready} {timeout:.0f}s: {self.log_tail()}")

    async def await_healthy(self, timeout: float = 20.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if await asyncio.to_thread(self.healthy):
                return
            self._check_alive()
            await asyncio.sleep(self.poll_s)
        raise self.error(f"{self.kind} {self.name} {self.not_ready} {timeout:.0f}s: {self.log_tail()}")

    def start(self, timeout: float = 20.0) -> str:
        """Start and wait until healthy; returns the address. Retries on a new port when the port was taken."""
        for attempt in range(3):
            self.spawn()
            try:
                self.wait_healthy(timeout)
                return self._address()
            except self.error:
                self._terminate(signal.SIGKILL)
                if attempt == 2 or not self._retry_on_new_port():
                    raise
        raise AssertionError("unreachable")

    async def astart(self, timeout: float = 20.0) -> str:
        for attempt in range(3):
            self.spawn()
            try:
                await self.await_healthy(timeout)
                return self._address()
            except self.error:
                await asyncio.to_thread(self._terminate, signal.SIGKILL)
                if attempt == 2 or not self._retry_on_new_port():
                    raise
        raise AssertionError("unreachable")

    def _retry_on_new_port(self) -> bool:
        return "address already in use" in self.log_tail().lower() and self._move_to_new_port()

    def kill(self) -> None:
        """SIGKILL (a crash); the data dir stays, so ``start()`` brings the server back on it."""
        self._terminate(signal.SIGKILL)

    def stop(self, timeout: float = 5.0, *, remove_data: bool | None = None) -> None:
        """SIGTERM, then SIGKILL after ``timeout``; removes a data dir this object created unless told otherwise."""
        self._terminate(signal.SIGTERM, timeout)
        if remove_data if remove_data is not None else self._own_dir:
            shutil.rmtree(self.data_dir, ignore_errors=True)
            with contextlib.suppress(OSError):
                self._log_path.unlink()

    async def astop(self, timeout: float = 5.0) -> None:
        await asyncio.to_thread(self.stop, timeout)

    def _terminate(self, sig: int, timeout: float = 5.0) -> None:
        proc = self.proc
        if proc is None:
            return
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, sig)
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        with _live_lock:
            _live.discard(self)

    def log_tail(self, chars: int = 2000) -> str:
        try:
            return self._log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


@atexit.register
def _stop_all() -> None:
    with _live_lock:
        live = list(_live)
    for proc in live:
        with contextlib.suppress(Exception):
            proc.stop(timeout=2.0)
