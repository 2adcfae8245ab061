"""Real etcd servers on loopback for tests and the local launcher.

``EtcdProcess`` runs one member, ``EtcdCluster`` runs ``n`` members that form one cluster (kill/restart a member to
test failover). Data dirs live under /dev/shm (cheap fsyncs; etcd 3.4 has no ``--unsafe-no-fsync``) and are removed on
stop. Each etcd gets its own process group and dies with its parent (PR_SET_PDEATHSIG), and anything still running at
interpreter exit is stopped by an atexit hook, so no stray servers survive a test run.

Both classes offer a blocking API (``start()``, ``stop()``) and an async one (``astart()``, ``astop()``); the async
one polls health without blocking the event loop.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import json
import os
import random
import shutil
import signal
import socket
import ssl
import subprocess
import tempfile
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from kvshuttle.services.common.processes import die_with_parent

ETCD_BIN = os.environ.get("KVSHUTTLE_ETCD_BIN") or shutil.which("etcd") or "/usr/bin/etcd"
_SHM = Path("/dev/shm")
_DIR_PREFIX = "kvshuttle-etcd-"
_live: set[EtcdProcess] = set()
_live_lock = threading.Lock()


class EtcdError(RuntimeError):
    """etcd did not start or did not become healthy; the message carries the tail of its log."""


# Every turn writes its session record (the history's token ids: kilobytes). etcd keeps every old version until
# compacted, and (3.4) the last 100,000 raft entries in memory: in a 16-session soak its memory grew ~64 MiB/min
# without these, ~48 MiB/min with compaction alone (towards its 2 GiB quota). The Helm chart's bundled etcd runs the
# same (tests/deploy checks).
RETENTION_ARGS = ("--auto-compaction-mode", "periodic", "--auto-compaction-retention", "1m", "--snapshot-count", "2000")


def _sweep_stale(base: Path) -> None:
    """Remove data dirs (and logs) whose owning process is gone: SIGKILL skips atexit, and /dev/shm is RAM."""
    for path in base.glob(f"{_DIR_PREFIX}*"):
        pid = path.name[len(_DIR_PREFIX):].split("-", 1)[0]
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


def _http(url: str, body: bytes | None = None, timeout: float = 1.0, context: ssl.SSLContext | None = None) -> dict:
    req = urllib.request.Request(url, data=body, method="POST" if body is not None else "GET")
    with urllib.request.urlopen(req, timeout=timeout, context=context) as resp:
        return json.loads(resp.read() or b"{}")


@dataclass(frozen=True)
class EtcdTls:
    """Client TLS for an etcd member (PEM file paths): its certificate and key, and with ``client_ca`` it requires
    client certificates signed by that CA (``--client-cert-auth``). ``health_cert``/``health_key``: the client
    certificate the health checks present then."""

    cert_file: str
    key_file: str
    client_ca: str = ""
    ca_file: str = ""  # verifies the member's certificate in health checks (default: client_ca)
    health_cert: str = ""
    health_key: str = ""

    def args(self) -> list[str]:
        args = ["--cert-file", self.cert_file, "--key-file", self.key_file]
        if self.client_ca:
            args += ["--client-cert-auth", "--trusted-ca-file", self.client_ca]
        return args

    def context(self) -> ssl.SSLContext:
        context = ssl.create_default_context(cafile=self.ca_file or self.client_ca or None)
        if self.health_cert:
            context.load_cert_chain(self.health_cert, self.health_key)
        return context


class EtcdProcess:
    """One etcd member on 127.0.0.1.

    Standalone by default. ``EtcdCluster`` passes ``initial_cluster`` (``name=peer_url,...``) and fixed ports.
    ``endpoints`` is ``127.0.0.1:<client port>`` (the form kvshuttle's settings take).
    """

    def __init__(self, name: str = "s1", *, client_port: int | None = None, peer_port: int | None = None,
                 data_dir: str | Path | None = None, initial_cluster: str | None = None,
                 cluster_token: str | None = None, heartbeat_ms: int = 100, election_ms: int = 1000,
                 extra_args: list[str] | None = None, tls: EtcdTls | None = None):
        """``tls``: serve clients over TLS only (https; peers stay plaintext on loopback)."""
        self.name = name
        self.tls = tls
        self.client_port = client_port or free_port()
        self.peer_port = peer_port or free_port()
        self._own_dir = data_dir is None
        if data_dir is None:
            base = _SHM if _SHM.is_dir() and os.access(_SHM, os.W_OK) else Path(tempfile.gettempdir())
            _sweep_stale(base)
            data_dir = tempfile.mkdtemp(prefix=f"{_DIR_PREFIX}{os.getpid()}-{name}-", dir=base)
        self.data_dir = Path(data_dir)
        self.initial_cluster = initial_cluster or f"{name}={self.peer_url}"
        self.cluster_token = cluster_token or f"kvshuttle-{os.getpid()}-{id(self):x}"
        self.heartbeat_ms = heartbeat_ms
        self.election_ms = election_ms
        self.extra_args = list(extra_args or [])
        self.proc: subprocess.Popen | None = None
        self._log_path = self.data_dir.parent / f"{self.data_dir.name}.log"

    @property
    def client_url(self) -> str:
        return f"{'https' if self.tls else 'http'}://127.0.0.1:{self.client_port}"

    @property
    def peer_url(self) -> str:
        return f"http://127.0.0.1:{self.peer_port}"

    @property
    def endpoints(self) -> str:
        return f"127.0.0.1:{self.client_port}"

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    # -- life cycle ------------------------------------------------------------------------------------------

    def spawn(self) -> None:
        """Start the process without waiting for health (members of a new cluster must start together)."""
        if self.running:
            return
        member_dir = self.data_dir / "member"
        args = [
            ETCD_BIN, "--name", self.name, "--data-dir", str(self.data_dir),
            "--listen-client-urls", self.client_url, "--advertise-client-urls", self.client_url,
            "--listen-peer-urls", self.peer_url, "--initial-advertise-peer-urls", self.peer_url,
            "--initial-cluster", self.initial_cluster,
            "--initial-cluster-state", "existing" if member_dir.exists() else "new",
            "--initial-cluster-token", self.cluster_token,
            "--heartbeat-interval", str(self.heartbeat_ms), "--election-timeout", str(self.election_ms),
            "--logger", "zap", "--log-level", "warn",
            *RETENTION_ARGS,
            *(self.tls.args() if self.tls else []),
            *self.extra_args,
        ]
        self._log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(self._log_path, "ab")
        try:
            self.proc = subprocess.Popen(die_with_parent(args, signal.SIGKILL), stdin=subprocess.DEVNULL,
                                         stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        finally:
            log.close()
        with _live_lock:
            _live.add(self)

    def healthy(self, timeout: float = 1.0) -> bool:
        """True when the member answers /health with a leader."""
        if not self.running:
            return False
        try:
            return str(_http(f"{self.client_url}/health", timeout=timeout,
                             context=self.tls.context() if self.tls else None).get("health")) == "true"
        except (OSError, ValueError, urllib.error.URLError):
            return False

    def wait_healthy(self, timeout: float = 20.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.healthy():
                return
            if not self.running:
                raise EtcdError(f"etcd {self.name} exited with {self.proc.returncode if self.proc else None}: "
                                f"{self.log_tail()}")
            time.sleep(0.05)
        raise EtcdError(f"etcd {self.name} not healthy after {timeout:.0f}s: {self.log_tail()}")

    async def await_healthy(self, timeout: float = 20.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if await asyncio.to_thread(self.healthy):
                return
            if not self.running:
                raise EtcdError(f"etcd {self.name} exited with {self.proc.returncode if self.proc else None}: "
                                f"{self.log_tail()}")
            await asyncio.sleep(0.05)
        raise EtcdError(f"etcd {self.name} not healthy after {timeout:.0f}s: {self.log_tail()}")

    def start(self, timeout: float = 20.0) -> str:
        """Start and wait until healthy; returns ``endpoints``. A standalone member retries on a port clash."""
        for attempt in range(3):
            self.spawn()
            try:
                self.wait_healthy(timeout)
                return self.endpoints
            except EtcdError:
                self._terminate(signal.SIGKILL)
                if attempt == 2 or not self._retry_on_new_ports():
                    raise
        raise AssertionError("unreachable")

    async def astart(self, timeout: float = 20.0) -> str:
        for attempt in range(3):
            self.spawn()
            try:
                await self.await_healthy(timeout)
                return self.endpoints
            except EtcdError:
                await asyncio.to_thread(self._terminate, signal.SIGKILL)
                if attempt == 2 or not self._retry_on_new_ports():
                    raise
        raise AssertionError("unreachable")

    def _retry_on_new_ports(self) -> bool:
        """A standalone member whose port was taken can move; a cluster member cannot (its peers know its URL)."""
        if self.initial_cluster != f"{self.name}={self.peer_url}" or "address already in use" not in self.log_tail():
            return False
        self.client_port, self.peer_port = free_port(), free_port()
        self.initial_cluster = f"{self.name}={self.peer_url}"
        shutil.rmtree(self.data_dir / "member", ignore_errors=True)
        return True

    def kill(self) -> None:
        """SIGKILL (a crash); the data dir stays, so ``start()`` brings the member back."""
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

    def status(self) -> dict:
        """The member's maintenance status (JSON gateway): ``header.member_id``, ``leader``, ``raftTerm``..."""
        return _http(f"{self.client_url}/v3/maintenance/status", body=b"{}",
                     context=self.tls.context() if self.tls else None)

    def is_leader(self) -> bool:
        try:
            st = self.status()
        except (OSError, ValueError, urllib.error.URLError):
            return False
        return bool(st.get("leader")) and st.get("leader") == st.get("header", {}).get("member_id")

    def __enter__(self) -> EtcdProcess:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


class EtcdCluster:
    """``n`` etcd members on loopback forming one cluster; ``endpoints`` lists all of them, comma-separated."""

    def __init__(self, n: int = 3, *, heartbeat_ms: int = 100, election_ms: int = 1000):
        if n < 1:
            raise ValueError("a cluster needs at least one member")
        names = [f"m{i}" for i in range(n)]
        ports = [(free_port(), free_port()) for _ in names]
        initial = ",".join(f"{name}=http://127.0.0.1:{peer}" for name, (_, peer) in zip(names, ports))
        token = f"kvshuttle-{os.getpid()}-{id(self):x}"
        self.members = [
            EtcdProcess(name, client_port=client, peer_port=peer, initial_cluster=initial, cluster_token=token,
                        heartbeat_ms=heartbeat_ms, election_ms=election_ms)
            for name, (client, peer) in zip(names, ports)
        ]

    @property
    def endpoints(self) -> str:
        return ",".join(m.endpoints for m in self.members)

    def start(self, timeout: float = 30.0) -> str:
        for m in self.members:
            m.spawn()
        try:
            for m in self.members:
                m.wait_healthy(timeout)
        except BaseException:
            self.stop()
            raise
        return self.endpoints

    async def astart(self, timeout: float = 30.0) -> str:
        for m in self.members:
            m.spawn()
        try:
            await asyncio.gather(*(m.await_healthy(timeout) for m in self.members))
        except BaseException:
            await asyncio.to_thread(self.stop)
            raise
        return self.endpoints

    def leader(self) -> int | None:
        """Index of the current leader among running members, if one is known."""
        for i, m in enumerate(self.members):
            if m.running and m.is_leader():
                return i
        return None

    def kill(self, i: int) -> None:
        """SIGKILL member ``i`` (keeps its data for ``restart``)."""
        self.members[i].kill()

    def restart(self, i: int, timeout: float = 20.0) -> None:
        """Bring member ``i`` back on its data dir and wait until it is healthy again."""
        self.members[i].spawn()
        self.members[i].wait_healthy(timeout)

    async def arestart(self, i: int, timeout: float = 20.0) -> None:
        self.members[i].spawn()
        await self.members[i].await_healthy(timeout)

    def kill_all(self) -> None:
        """SIGKILL every member (a full outage); ``arestart_all`` brings them back on their data dirs."""
        for m in self.members:
            m.kill()

    async def arestart_all(self, timeout: float = 30.0) -> None:
        """Start every stopped member together (none is healthy before a quorum is back) and wait for all."""
        for m in self.members:
            m.spawn()
        await asyncio.gather(*(m.await_healthy(timeout) for m in self.members))

    def healthy(self) -> bool:
        """Every member runs and answers /health with a leader."""
        return all(m.healthy() for m in self.members)

    def stop(self) -> None:
        for m in self.members:
            m._terminate(signal.SIGTERM)
        for m in self.members:
            m.stop()

    async def astop(self) -> None:
        await asyncio.to_thread(self.stop)

    def __enter__(self) -> EtcdCluster:
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
