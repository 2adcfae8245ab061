"""A minimal OTLP/gRPC trace receiver for tests: real exporters send spans to it over loopback.

Spans are dicts (``kvshuttle.services.commands.trace_view.span_dicts``): service, name, kind, trace_id, span_id, parent_id, start_ns,
end_ns, attributes, status, status_code, events.
"""

from __future__ import annotations

from kvshuttle.services.commands.trace_view import TraceReceiver, receiver_server

from tests.support.waits import until


class OtlpReceiver:
    def __init__(self) -> None:
        self.receiver = TraceReceiver()
        self.server, self.port = receiver_server(self.receiver, "127.0.0.1:0")
        self.endpoint = f"http://127.0.0.1:{self.port}"

    @property
    def spans(self) -> list[dict]:
        return self.receiver.spans

    async def start(self) -> None:
        await self.server.start()

    async def stop(self) -> None:
        await self.server.stop(0)

    async def wait_for(self, predicate, timeout_s: float = 30.0) -> list[dict]:
        """Spans collected so far once ``predicate(spans)`` is true; fails after ``timeout_s``."""
        try:
            await until(lambda: predicate(self.spans), timeout_s, "spans that satisfy the condition", interval_s=0.1)
        except AssertionError:
            raise AssertionError(f"spans never satisfied the condition; got {[s['name'] for s in self.spans]}") \
                from None
        return self.spans
