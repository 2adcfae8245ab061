"""Waiting on a condition instead of sleeping: one poll-until helper for every test (async and sync).

``until(check)`` calls ``check`` (a plain function, or one returning an awaitable) every ``interval_s`` until its
value is truthy and returns that value; after ``timeout_s`` it fails with an AssertionError that says what was
awaited and what ``check`` last returned. ``wait_until`` is the same for synchronous code (subprocess tests).
A check whose answer may be falsy (0, an empty list) returns it in a tuple: ``(n,) = await until(...)``.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

T = TypeVar("T")


async def until(check: Callable[[], T | Awaitable[T]], timeout_s: float = 10.0, what: str = "the condition", *,
                interval_s: float = 0.05) -> T:
    """Poll ``check`` until it returns something truthy; return it. Fails after ``timeout_s`` seconds."""
    deadline = time.monotonic() + timeout_s
    while True:
        value: Any = check()
        if inspect.isawaitable(value):
            value = await value
        if value:
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout_s:g} s waiting for {what} (last: {value!r})")
        await asyncio.sleep(interval_s)


def wait_until(check: Callable[[], T], timeout_s: float = 10.0, what: str = "the condition", *,
               interval_s: float = 0.05) -> T:
    """``until`` for synchronous code: poll ``check`` until it returns something truthy; return it."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout_s:g} s waiting for {what} (last: {value!r})")
        time.sleep(interval_s)
