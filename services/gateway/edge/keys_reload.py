"""Reload the API keys file without a restart: poll its status every few seconds (off the event loop, in a thread)
and, when it changed, load it into the running KeyRing. A file that cannot be read or is invalid keeps the keys in
force, is logged (what is wrong, never a hash) and counted (``kvshuttle_api_keys_reloads_total{result="failed"}``);
it is not read again until it changes again."""

from __future__ import annotations

import asyncio
import logging
import os

from kvshuttle.services.common import metrics
from kvshuttle.services.common.config import ConfigError
from kvshuttle.services.gateway.edge.auth import KeyRing

log = logging.getLogger(__name__)


def _signature(path: str) -> tuple[int, int, int] | None:
    """What changes when the file does (replaced or rewritten); None: it cannot be read."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_ino, st.st_mtime_ns, st.st_size


class KeysFileWatcher:
    """Keeps ``keys`` in step with the file at ``path``, checked every ``interval_s``."""

    def __init__(self, keys: KeyRing, path: str, interval_s: float):
        self.keys, self.path, self.interval_s = keys, path, interval_s
        self._seen = _signature(path)  # the version the gateway started with (already loaded)
        self._task: asyncio.Task | None = None

    async def check(self) -> bool | None:
        """Reload when the file changed since the last check: True (loaded), False (failed: old keys kept), None
        (unchanged)."""
        seen = await asyncio.to_thread(_signature, self.path)
        if seen == self._seen:
            return None
        self._seen = seen
        try:
            fresh = await asyncio.to_thread(KeyRing.load, self.path)
        except ConfigError as exc:
            metrics.API_KEYS_RELOADS.labels("failed").inc()
            log.error("API keys file changed but was not loaded, the previous %d keys stay in force: %s",
                      len(self.keys), exc)
            return False
        self.keys.replace(fresh)
        metrics.API_KEYS_RELOADS.labels("loaded").inc()
        log.info("API keys file reloaded: %d keys, limits for %d tenants", len(fresh), len(fresh.limits))
        return True

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                await self.check()
            except Exception:  # keep watching whatever happened
                log.exception("checking the API keys file failed")

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="api-keys-reload")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
