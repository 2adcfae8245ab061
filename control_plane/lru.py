"""A least-recently-used map bounded by the total size of its values (sizes given by the caller)."""

from __future__ import annotations

import collections
from collections.abc import Hashable
from typing import Generic, TypeVar

V = TypeVar("V")


class BoundedLru(Generic[V]):
    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self._items: collections.OrderedDict[Hashable, tuple[V, int]] = collections.OrderedDict()
        self.bytes = 0

    def __len__(self) -> int:
        return len(self._items)

    def put(self, key: Hashable, value: V, size: int) -> None:
        """Store ``value``; drops the least recently used entries beyond ``max_bytes`` (a value larger than the
        whole budget is not kept)."""
        self.discard(key)
        if size > self.max_bytes:
            return
        self._items[key] = (value, size)
        self.bytes += size
        while self.bytes > self.max_bytes:
            _, (_, dropped) = self._items.popitem(last=False)
            self.bytes -= dropped

    def get(self, key: Hashable) -> V | None:
        item = self._items.get(key)
        if item is None:
            return None
        self._items.move_to_end(key)
        return item[0]

    def discard(self, key: Hashable) -> None:
        item = self._items.pop(key, None)
        if item is not None:
            self.bytes -= item[1]
