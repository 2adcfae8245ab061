"""schemathesis checks of our own, loaded by tests/e2e/test_fuzz_openapi.py (``SCHEMATHESIS_HOOKS``)."""

from __future__ import annotations

import json

import schemathesis


@schemathesis.check
def error_body_has_a_message(ctx, response, case) -> None:
    """Every 4xx/5xx answers a JSON object whose ``error.message`` says what was wrong."""
    if response.status_code < 400:
        return
    try:
        error = json.loads(response.content)["error"]
    except (ValueError, TypeError, KeyError) as exc:
        raise AssertionError(f"{response.status_code} body is not a JSON error object ({exc!r})") from None
    message = error.get("message") if isinstance(error, dict) else None
    if not isinstance(message, str) or not message.strip():
        raise AssertionError(f"{response.status_code} error without a message: {error!r}")


@schemathesis.check
def streams_finish_cleanly(ctx, response, case) -> None:
    """A 200 event stream ends with ``[DONE]`` and carries no error event (a turn that failed after it started)."""
    if response.status_code != 200 or not response.headers.get("content-type", [""])[0].startswith("text/event-stream"):
        return
    events = [line[len("data: "):] for line in response.content.decode("utf-8", "replace").splitlines()
              if line.startswith("data: ")]
    if not events or events[-1] != "[DONE]":
        raise AssertionError(f"event stream did not end with [DONE]: {events[-3:]!r}")
    failed = [e for e in events if e.startswith('{"error"')]
    if failed:
        raise AssertionError(f"event stream failed after it started: {failed[0][:300]}")
