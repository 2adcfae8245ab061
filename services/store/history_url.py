"""Which history store a ``--history-store`` value names: ``sqlite:PATH`` (``sqlite::memory:``) or a Redis URL."""

from __future__ import annotations

from kvshuttle.services.store.history import HistoryStore
from kvshuttle.services.store.history_redis import RedisHistoryStore
from kvshuttle.services.store.history_sqlite import SqliteHistoryStore

SCHEMES = ("sqlite:", "redis://", "rediss://", "unix://")


def check_history_url(url: str) -> str | None:
    """Why ``url`` names no history store, or None when it does."""
    if not url.startswith(SCHEMES):
        return "--history-store must be sqlite:PATH, sqlite::memory: or a redis:// (rediss://, unix://) URL"
    if url == "sqlite:":
        return "--history-store sqlite: needs a path (or :memory:)"
    return None


def open_history_store(url: str, key_prefix: str) -> HistoryStore:
    """The (unconnected) store ``url`` names; Redis keys go under ``key_prefix``."""
    if url.startswith("sqlite:"):
        return SqliteHistoryStore(url[len("sqlite:"):])
    return RedisHistoryStore(url, key_prefix)
