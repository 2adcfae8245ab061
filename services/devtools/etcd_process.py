"""Real etcd servers on loopback for tests and the local launcher.

``EtcdProcess`` runs one member, ``EtcdCluster`` runs ``n`` members that form one cluster (kill/restart a member to
test failover). Data dirs live under /dev/shm (cheap fsyncs; etcd 3.4 has no ``--unsafe-no-fsync``) and are removed on
stop. Each etcd gets its own process group and dies with its parent (PR_SET_PDEATHSIG), and anything still running at
interpreter exit is stopped by an atexit hook, so no stray servers survive a test run (that life cycle is
:class:`~kvshuttle.services.devtools.server_process.ServerProcess`'s, shared with Redis; ``free_port`` is re-exported).

Both classes offer a blocking API (``start()``, ``stop()``) and an async one (``astart()``, ``astop()``); the async
one polls health without blocking the event loop.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import ssl
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from kvshuttle.services.devtools.server_process import ServerProcess, free_port

ETCD_BIN = os.environ.get("KVSHUTTLE_ETCD_BIN") or shutil.which("etcd") or "/usr/bin/etcd"


class EtcdError(RuntimeError):
    """etcd did not start or did not become healthy; the message carries the tail of its log."""


# Every turn writes its session record (the history's token ids: kilobytes). etcd keeps every old version until
# compacted, and (3.4) the last 100,000 raft entries in memory: in a 16-session soak its memory grew ~64 MiB/min
# without these, ~48 MiB/min with compaction alone (towards its 2 GiB quota). The Helm chart's bundled etcd runs the
# same (tests/deploy checks). Compaction frees pages inside etcd's database file without shrinking it (in RAM here,
# under /dev/shm): the registry defragments it every --etcd-defrag-interval-s (services/registry/defrag.py).
RETENTION_ARGS = ("--auto-compaction-mode", "periodic", "--auto-compaction-retention", "1m", "--snapshot-count", "2000")


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


class EtcdProcess(ServerProcess):
    """One etcd member on 127.0.0.1.

    Standalone by default. ``EtcdCluster`` passes ``initial_cluster`` (``name=peer_url,...``) and fixed ports.
    ``endpoints`` is ``127.0.0.1:<client port>`` (the form kvshuttle's settings take).
    """

    kind = "etcd"
    error = EtcdError
    dir_prefix = "kvshuttle-etcd-"

    def __init__(self, name: str = "s1", *, client_port: int | None = None, peer_port: int | None = None,
                 data_dir: str | Path | None = None, initial_cluster: str | None = None,
                 cluster_token: str | None = None, heartbeat_ms: int = 100, election_ms: int = 1000,
                 extra_args: list[str] | None = None, tls: EtcdTls | None = None):
        """``tls``: serve clients over TLS only (https; peers stay plaintext on loopback)."""
        self.tls = tls
        self.client_port = client_port or free_port()
        self.peer_port = peer_port or free_port()
        super().__init__(name, data_dir)
        self.initial_cluster = initial_cluster or f"{name}={self.peer_url}"
        self.cluster_token = cluster_token or f"kvshuttle-{os.getpid()}-{id(self):x}"
        self.heartbeat_ms = heartbeat_ms
        self.election_ms = election_ms
        self.extra_args = list(extra_args or [])

    @property
    def client_url(self) -> str:
        return f"{'https' if self.tls else 'http'}://127.0.0.1:{self.client_port}"

    @property
    def peer_url(self) -> str:
        return f"http://127.0.0.1:{self.peer_port}"

    @property
    def endpoints(self) -> str:
        return f"127.0.0.1:{self.client_port}"

    def _address(self) -> str:
        return self.endpoints

    def _command(self) -> list[str]:
        member_dir = self.data_dir / "member"
        return [
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

    def healthy(self, timeout: float = 1.0) -> bool:
        """True when the member answers /health with a leader."""
        if not self.running:
            return False
        try:
            return str(_http(f"{self.client_url}/health", timeout=timeout,
                             context=self.tls.context() if self.tls else None).get("health")) == "true"
        except (OSError, ValueError, urllib.error.URLError):
            return False

    def _move_to_new_port(self) -> bool:
        """A standalone member can move; a cluster member cannot (its peers know its URL)."""
        if self.initial_cluster != f"{self.name}={self.peer_url}":
            return False
        self.client_port, self.peer_port = free_port(), free_port()
        self.initial_cluster = f"{self.name}={self.peer_url}"
        shutil.rmtree(self.data_dir / "member", ignore_errors=True)
        return True

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

