"""Child processes in their own process groups, with logs to a file and a stop that leaves no strays."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shlex
import signal
import sys
from collections import deque
from collections.abc import Sequence
from pathlib import Path

# Runs as ``python -c`` in front of the real command: sets PR_SET_PDEATHSIG, checks the parent is still the one that
# started it (it may have died already), then execs the command. Done this way, not with a preexec_fn, because Python
# code between fork and exec in a process with live gRPC threads can abort the child (seen here: epoll_wait EBADF).
_GUARD = ("import ctypes,os,sys;ctypes.CDLL(None).prctl(1,int(sys.argv[1]));"
          "os.getppid()==int(sys.argv[2]) or sys.exit(70);os.execvp(sys.argv[3],sys.argv[3:])")


def die_with_parent(argv: Sequence[str], sig: int = signal.SIGTERM) -> list[str]:
    """``argv`` wrapped so that the child gets ``sig`` when the thread that started it exits (Linux PDEATHSIG).

    Spawn from a long-lived thread (the main one or the event loop's). SIGTERM lets a child clean up its own
    children (a worker agent stops its vLLM); SIGKILL suits leaves like etcd.
    """
    return [sys.executable, "-c", _GUARD, str(int(sig)), str(os.getpid()), *argv]


def child_env(changes: dict[str, str | None] | None) -> dict[str, str]:
    """This process's environment with ``changes`` applied (a None value removes the variable)."""
    env = {**os.environ, **(changes or {})}
    return {k: v for k, v in env.items() if v is not None}


class ChildProcess:
    """``argv`` as a child in its own session/process group; stdout+stderr appended to ``log_path``, or written to
    this process's stderr when ``log_path`` is None (in a container: the pod's log; our stdout stays the child's
    own protocol, e.g. the worker's ready marker). ``env`` changes the inherited environment: a None value removes
    that variable."""

    def __init__(self, name: str, argv: Sequence[str], log_path: str | Path | None,
                 env: dict[str, str | None] | None = None, stop_grace_s: float = 20.0, cwd: str | Path | None = None):
        self.name = name
        self.argv = list(argv)
        self.log_path = Path(log_path) if log_path is not None else None
        self.env = env
        self.stop_grace_s = stop_grace_s
        self.cwd = cwd
        self.proc: asyncio.subprocess.Process | None = None

    async def start(self, stdout_pipe: bool = False) -> None:
        """Start; with ``stdout_pipe`` stdout stays readable (``self.proc.stdout``) and only stderr is logged."""
        header = f"\n=== {shlex.join(self.argv)}\n"
        if self.log_path is None:
            print(header, end="", file=sys.stderr, flush=True)
            log = None
        else:
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
            log = open(self.log_path, "ab")
            log.write(header.encode())
            log.flush()
        try:
            self.proc = await asyncio.create_subprocess_exec(
                *die_with_parent(self.argv), stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE if stdout_pipe else log or sys.stderr.fileno(),
                stderr=log or sys.stderr.fileno() if stdout_pipe or log is None else asyncio.subprocess.STDOUT,
                env=child_env(self.env), cwd=self.cwd, start_new_session=True)
        finally:
            if log is not None:
                log.close()

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    @property
    def returncode(self) -> int | None:
        return self.proc.returncode if self.proc else None

    def _signal_group(self, sig: int) -> bool:
        try:
            os.killpg(self.proc.pid, sig)  # the group id is the child's pid (start_new_session)
            return True
        except (ProcessLookupError, PermissionError):
            return False

    async def stop(self) -> int | None:
        """SIGTERM the group, SIGKILL it after the grace period, then kill whatever the group left behind."""
        if self.proc is None:
            return None
        if self.proc.returncode is None:
            self._signal_group(signal.SIGTERM)
            try:
                await asyncio.wait_for(self.proc.wait(), self.stop_grace_s)
            except TimeoutError:
                self._signal_group(signal.SIGKILL)
                await self.proc.wait()
        if self._signal_group(0):
            await asyncio.sleep(0.5)
            self._signal_group(signal.SIGKILL)
        return self.proc.returncode

    def log_tail(self, lines: int = 40) -> str:
        if self.log_path is None:
            return "(the output went to this process's stderr)"
        with contextlib.suppress(OSError), open(self.log_path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 64 * 1024))
            return "\n".join(deque(f.read().decode(errors="replace").splitlines(), maxlen=lines))
        return ""
