"""The API keys file reloads while the gateway runs (services/gateway/edge/keys_reload.py): a changed file replaces
the keys and limits in the ring every holder shares; a bad one keeps the old keys, is logged and counted."""

from __future__ import annotations

import json
import logging
import os

from kvshuttle.control_plane.rate_limit import TenantLimits
from kvshuttle.services.common import metrics
from kvshuttle.services.gateway.edge import auth
from kvshuttle.services.gateway.edge.keys_reload import KeysFileWatcher
from kvshuttle.services.gateway.edge.tenant_limits import RateLimited, TenantQuotas


def write(path, data, bump: int) -> None:
    """Write ``data`` and give the file a new mtime (filesystems with coarse timestamps would hide a quick rewrite)."""
    path.write_text(data if isinstance(data, str) else json.dumps(data))
    st = os.stat(path)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + bump * 1_000_000_000))


def reloads(result: str) -> float:
    return metrics.API_KEYS_RELOADS.labels(result)._value.get()


async def test_a_changed_file_is_loaded_and_a_bad_one_keeps_the_keys_in_force(tmp_path, caplog):
    path = tmp_path / "keys.json"
    write(path, {"keys": [auth.entry("kvs-one", "acme")]}, 0)
    ring = auth.KeyRing.load(str(path))
    watcher = KeysFileWatcher(ring, str(path), interval_s=3600)
    assert await watcher.check() is None  # unchanged since start-up
    loaded, failed = reloads("loaded"), reloads("failed")

    write(path, {"keys": [auth.entry("kvs-two", "globex")], "limits": {"globex": {"concurrent_turns": 1}}}, 1)
    assert await watcher.check() is True
    assert ring.principal("kvs-two").tenant == "globex" and ring.limits_of("globex").concurrent_turns == 1
    try:
        ring.principal("kvs-one")
        raise AssertionError("a removed key still works")
    except auth.AuthError:
        pass
    assert reloads("loaded") == loaded + 1

    with caplog.at_level(logging.ERROR, logger="kvshuttle.services.gateway.edge.keys_reload"):
        write(path, '{"keys": [', 2)  # half written
        assert await watcher.check() is False
        assert await watcher.check() is None  # not read again until it changes again
    assert ring.principal("kvs-two").tenant == "globex"  # the old keys stay in force
    assert reloads("failed") == failed + 1
    assert any("not valid JSON" in r.getMessage() and "previous 1 keys stay in force" in r.getMessage()
               for r in caplog.records)
    assert not any(auth.hash_key("kvs-two") in r.getMessage() for r in caplog.records)

    path.unlink()
    assert await watcher.check() is False  # gone: the old keys stay too
    write(path, {"keys": [auth.entry("kvs-three", "acme")], "limits": {"nobody": {}}}, 3)
    assert await watcher.check() is False and "no key belongs to that tenant" in caplog.text
    write(path, {"keys": [auth.entry("kvs-three", "acme")]}, 4)
    assert await watcher.check() is True and ring.principal("kvs-three").tenant == "acme"


async def test_reloaded_limits_apply_to_the_next_request(tmp_path):
    path = tmp_path / "keys.json"
    write(path, {"keys": [auth.entry("kvs-a", "acme")], "limits": {"*": {"requests_per_second": 1}}}, 0)
    ring = auth.KeyRing.load(str(path))
    quotas = TenantQuotas(ring, clock=lambda: 50.0)
    assert quotas.check_request("acme") is None
    refused = quotas.check_request("acme")
    assert isinstance(refused, RateLimited) and refused.http_status == 429 and refused.retry_after_s == 1
    assert refused.limit == "requests_per_second" and refused.openai_type == "requests"
    write(path, {"keys": [auth.entry("kvs-a", "acme")], "limits": {"acme": {"tokens_per_minute": 100}}}, 1)
    ring.replace(auth.KeyRing.load(str(path)))
    assert ring.limits_of("acme") == TenantLimits(tokens_per_minute=100)
    assert quotas.check_request("acme") is None  # its own entry (no requests-per-second limit) wins over "*"
