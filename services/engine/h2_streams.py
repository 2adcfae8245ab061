"""A lean gRPC client for server-streaming calls (D's token streams, P's prefill): HTTP/2 over one plaintext
connection per worker, written on an asyncio protocol.

Why not grpc.aio: it reads each message with its own operation on gRPC core's completion queue, handed from core's
poller thread to the event loop (a thread wake, a future, a task step). Measured against the bench's fake engine
that alone costs 75–105 µs of CPU per streamed token, more than a whole token's cost in SMG. Here one socket read
carries the frames of every stream on the connection, parsed in place: a token is one frame header, one protobuf
message and one waiter woken.

Scope: what vLLM's gRPC server needs of a client (it speaks plaintext HTTP/2 only): unary requests with streamed
responses, metadata both ways, ``grpc-timeout``, flow control both ways (windows large enough that a token stream
never waits for an update), SETTINGS/PING acknowledgements, RST_STREAM and GOAWAY. Header blocks: the request's are
written as HPACK literals that never touch a dynamic table (no per-call encoder state: a few µs, where ``hpack``'s
encoder took ~100); we announce a header table of 0 bytes, so the server's blocks decode on their own too, and a
block seen before (the same response headers and trailers on every call) is not decoded again. Everything else
(unary calls, health) stays on grpc.aio.
"""

from __future__ import annotations

import asyncio
import collections
import struct
import urllib.parse
from collections.abc import Callable, Sequence

import grpc
import hpack

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
DATA, HEADERS, PRIORITY, RST_STREAM, SETTINGS, PUSH_PROMISE, PING, GOAWAY, WINDOW_UPDATE, CONTINUATION = range(10)
END_STREAM, ACK, END_HEADERS, PADDED, PRIORITY_FLAG = 0x1, 0x1, 0x4, 0x8, 0x20
SETTINGS_HEADER_TABLE_SIZE, SETTINGS_ENABLE_PUSH, SETTINGS_MAX_CONCURRENT_STREAMS = 1, 2, 3
SETTINGS_INITIAL_WINDOW_SIZE, SETTINGS_MAX_FRAME_SIZE = 4, 5
CANCEL_CODE = 0x8
DEFAULT_WINDOW = 65_535
OUR_WINDOW = 1 << 30  # what we let a stream and the connection send before our next WINDOW_UPDATE
MAX_STREAM_ID = (1 << 31) - 1
_FRAME = struct.Struct(">I")  # 24-bit length + type packed: read as 4 bytes, see _frame_header
_STATUS = {code.value[0]: code for code in grpc.StatusCode}


def _frame(kind: int, flags: int, stream_id: int, payload: bytes = b"") -> bytes:
    return len(payload).to_bytes(3, "big") + bytes((kind, flags)) + stream_id.to_bytes(4, "big") + payload


def _length(n: int) -> bytes:
    """An HPACK string length: an integer with a 7-bit prefix, the Huffman bit off (RFC 7541 5.1, 5.2)."""
    if n < 127:
        return bytes((n,))
    out, n = bytearray((127,)), n - 127
    while n >= 128:
        out.append(n & 127 | 128)
        n >>= 7
    out.append(n)
    return bytes(out)


def literal(name: str, value: str) -> bytes:
    """One header as an HPACK "literal header field without indexing, new name" (RFC 7541 6.2.2): its bytes do not
    depend on what came before, and the server's table is left as it was."""
    n, v = name.encode(), value.encode()
    return b"\x00" + _length(len(n)) + n + _length(len(v)) + v


INDEXED_POST_HTTP = bytes((0x80 | 3, 0x80 | 6))  # ":method: POST", ":scheme: http" from the static table
DECODED_BLOCKS = 64  # distinct server header blocks remembered per connection


class StreamError(Exception):
    """A stream that ended without grpc-status OK: ``code`` (a grpc.StatusCode) and the server's message."""

    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(f"{code.name}: {message}")
        self.code, self.message = code, message


class Stream:
    """One call's response: ``read()`` returns each message's bytes, None at a clean end (grpc-status 0), and raises
    StreamError otherwise. ``initial_metadata`` is set once the response headers have come (before the first
    message). ``cancel()`` resets the stream (the server aborts the request)."""

    __slots__ = ("_conn", "id", "_messages", "_buffer", "_waiter", "_error", "_ended", "initial_metadata",
                 "_headers_done", "_unacked", "_outbound", "send_window", "_deadline", "express", "_raised")

    def __init__(self, conn: Connection, stream_id: int):
        self._conn, self.id = conn, stream_id
        self._messages: collections.deque[bytes] = collections.deque()
        self._buffer = bytearray()  # a message split over DATA frames
        self._waiter: asyncio.Future | None = None
        self._error: StreamError | None = None
        self._ended = False  # the trailers came (or the stream failed): nothing more arrives
        self.initial_metadata: dict[str, str] | None = None
        self._headers_done = False
        self._unacked = 0  # bytes received since our last WINDOW_UPDATE for this stream
        self._outbound = b""  # request bytes the server's windows have not let out yet
        self.send_window = conn.peer_initial_window
        self._deadline: asyncio.TimerHandle | None = None
        # Set while the reader waits: a message it takes (True) is handled in the connection's read callback and
        # never queued; one it declines, and every later one while any is queued, is queued as usual. What it
        # raises is raised by the next ``read`` (it is then unset).
        self.express: Callable[[bytes], bool] | None = None
        self._raised: BaseException | None = None

    async def read(self) -> bytes | None:
        while True:
            if self._raised is not None:
                raised, self._raised = self._raised, None
                raise raised
            if self._messages:
                return self._messages.popleft()
            if self._ended:
                if self._error is not None:
                    raise self._error
                return None
            self._waiter = waiter = self._conn.loop.create_future()
            try:
                await waiter
            finally:
                self._waiter = None

    def cancel(self) -> None:
        """Reset the stream unless it has ended; a pending or later read raises CANCELLED."""
        if not self._ended:
            self._conn.reset(self, CANCEL_CODE)
            self._fail(StreamError(grpc.StatusCode.CANCELLED, "cancelled by the client"))

    @property
    def done(self) -> bool:
        return self._ended

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _data(self, payload: memoryview) -> None:
        buffer = self._buffer
        if not buffer and len(payload) >= 5:  # the usual case: whole messages in one frame
            offset, end = 0, len(payload)
            while end - offset >= 5:
                size = _FRAME.unpack_from(payload, offset + 1)[0]
                if payload[offset]:
                    self._refuse("a compressed message (none was accepted)")
                    return
                if end - offset - 5 < size:
                    break
                self._message(bytes(payload[offset + 5:offset + 5 + size]))
                offset += 5 + size
            if offset < end:
                buffer += payload[offset:]
        else:
            buffer += payload
            while len(buffer) >= 5:
                size = _FRAME.unpack_from(buffer, 1)[0]
                if buffer[0]:
                    self._refuse("a compressed message (none was accepted)")
                    return
                if len(buffer) - 5 < size:
                    break
                self._message(bytes(buffer[5:5 + size]))
                del buffer[:5 + size]
        if self._messages or self._raised is not None:
            self._wake()

    def _message(self, message: bytes) -> None:
        express = self.express
        if express is not None and not self._messages:
            try:
                if express(message):
                    return
            except Exception as exc:  # noqa: BLE001 - the reader's to raise, not the connection's
                self.express, self._raised = None, exc
                return
        self._messages.append(message)

    def _headers(self, headers: list[tuple[str, str]], end_stream: bool) -> None:
        if not self._headers_done:
            self._headers_done = True
            fields = dict(headers)
            self.initial_metadata = {k: v for k, v in fields.items() if not k.startswith(":")}
            status = fields.get(":status", "")
            if status != "200" and "grpc-status" not in fields:
                self._fail(StreamError(_http_status_code(status), f"HTTP status {status or 'missing'}"))
                return
            if not end_stream:
                return
        self._trailers(dict(headers))

    def _trailers(self, fields: dict[str, str]) -> None:
        raw = fields.get("grpc-status")
        code = _STATUS.get(int(raw), grpc.StatusCode.UNKNOWN) if raw and raw.isdigit() else grpc.StatusCode.UNKNOWN
        if raw is None:
            self._fail(StreamError(grpc.StatusCode.INTERNAL, "the stream ended without grpc-status"))
        elif code != grpc.StatusCode.OK:
            self._fail(StreamError(code, urllib.parse.unquote(fields.get("grpc-message", ""))))
        elif self._buffer:
            self._fail(StreamError(grpc.StatusCode.INTERNAL, "the stream ended inside a message"))
        else:
            self._end()

    def _end(self) -> None:
        if not self._ended:
            self._ended = True
            self._conn.forget(self)
            self._wake()

    def _refuse(self, why: str) -> None:
        """The server sent what this client cannot read: the stream is reset and fails (INTERNAL)."""
        if not self._ended:
            self._conn.reset(self, 0x2)  # INTERNAL_ERROR
            self._fail(StreamError(grpc.StatusCode.INTERNAL, why))

    def _fail(self, error: StreamError) -> None:
        if not self._ended:
            self._error = error
            self._messages.clear()
            self._end()


def _http_status_code(status: str) -> grpc.StatusCode:
    """gRPC's mapping of an HTTP status without grpc-status (e.g. a proxy's answer)."""
    return {"400": grpc.StatusCode.INTERNAL, "401": grpc.StatusCode.UNAUTHENTICATED,
            "403": grpc.StatusCode.PERMISSION_DENIED, "404": grpc.StatusCode.UNIMPLEMENTED,
            "429": grpc.StatusCode.UNAVAILABLE, "502": grpc.StatusCode.UNAVAILABLE,
            "503": grpc.StatusCode.UNAVAILABLE, "504": grpc.StatusCode.UNAVAILABLE}.get(status,
                                                                                       grpc.StatusCode.UNKNOWN)


class Connection(asyncio.Protocol):
    """One HTTP/2 connection to a worker; streams are started with ``start``. A connection that was lost or told
    to go away takes no new streams (``usable``); its open streams fail with UNAVAILABLE when it is lost."""

    def __init__(self, authority: str):
        self.authority = authority
        self.loop = asyncio.get_running_loop()
        self.transport: asyncio.Transport | None = None
        self.streams: dict[int, Stream] = {}
        self.next_id = 1
        self.closed = False  # lost, or the server sent GOAWAY
        self.decoder = hpack.Decoder()
        self.decoder.header_table_size = self.decoder.max_allowed_table_size = 0  # as our SETTINGS announce
        self._decoded: dict[bytes, list] = {}  # header blocks that decoded on their own -> their headers
        self._paths: dict[str, bytes] = {}  # the start of a request's header block for each path
        self._regular = literal("content-type", "application/grpc") + literal("te", "trailers")
        self.peer_initial_window = DEFAULT_WINDOW
        self.peer_max_frame = 16_384
        self.peer_max_streams = 1 << 31  # the server's SETTINGS_MAX_CONCURRENT_STREAMS (none: unlimited)
        self.send_window = DEFAULT_WINDOW  # the connection's, for our request bodies
        self._inbox = bytearray()
        self._header_block: tuple[int, int, bytearray] | None = None  # (stream, flags, fragments) until END_HEADERS
        self._unacked = 0
        self._blocked: list[Stream] = []  # streams with request bytes waiting for a window
        self.ready = self.loop.create_future()  # the server's first SETTINGS

    @property
    def usable(self) -> bool:
        """Whether a new stream may start here: open, stream ids left, under the server's concurrent streams."""
        return not self.closed and self.next_id < MAX_STREAM_ID and len(self.streams) < self.peer_max_streams

    def retire(self) -> None:
        """Take no new streams; close once the last open one has ended (a full or exhausted connection)."""
        self.closed = True
        if not self.streams:
            self.close()

    # -- asyncio.Protocol ----------------------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        settings = struct.pack(">HIHIHI", SETTINGS_ENABLE_PUSH, 0, SETTINGS_INITIAL_WINDOW_SIZE, OUR_WINDOW,
                               SETTINGS_HEADER_TABLE_SIZE, 0)
        transport.write(PREFACE + _frame(SETTINGS, 0, 0, settings)  # type: ignore[attr-defined]
                        + _frame(WINDOW_UPDATE, 0, 0, struct.pack(">I", OUR_WINDOW - DEFAULT_WINDOW)))

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if not self.ready.done():
            self.ready.set_exception(ConnectionError(f"connection closed ({exc or 'by the server'})"))
        for stream in list(self.streams.values()):
            stream._fail(StreamError(grpc.StatusCode.UNAVAILABLE, f"connection lost ({exc or 'closed by the server'})"))

    def data_received(self, data: bytes) -> None:
        inbox = self._inbox
        if inbox:
            inbox += data
            view = memoryview(inbox)
        else:
            view = memoryview(data)
        offset, end = 0, len(view)
        try:
            while end - offset >= 9:
                head = _FRAME.unpack_from(view, offset)[0]
                size, kind = head >> 8, head & 0xFF
                if end - offset - 9 < size:
                    break
                flags = view[offset + 4]
                stream_id = _FRAME.unpack_from(view, offset + 5)[0] & MAX_STREAM_ID
                payload = view[offset + 9:offset + 9 + size]
                offset += 9 + size
                if kind == DATA:
                    self._on_data(stream_id, flags, payload, size)
                else:
                    self._on_control(kind, flags, stream_id, payload)
        except _ProtocolError as exc:
            self._abort(str(exc))
            return
        self._inbox = bytearray(view[offset:]) if offset < end else bytearray()
        if self._unacked > OUR_WINDOW // 2:  # the connection's window, renewed in one update per half
            self._write(_frame(WINDOW_UPDATE, 0, 0, struct.pack(">I", self._unacked)))
            self._unacked = 0

    # -- frames in --------------------------------------------------------------------------------------------

    def _on_data(self, stream_id: int, flags: int, payload: memoryview, size: int) -> None:
        self._unacked += size
        if flags & PADDED:
            if not payload or payload[0] >= len(payload):
                raise _ProtocolError("a DATA frame with bad padding")
            payload = payload[1:len(payload) - payload[0]]
        stream = self.streams.get(stream_id)
        if stream is None:
            return  # a stream we reset or gave up: its bytes still count for the connection's window
        stream._unacked += size
        if stream._unacked > OUR_WINDOW // 2:
            self._write(_frame(WINDOW_UPDATE, 0, stream_id, struct.pack(">I", stream._unacked)))
            stream._unacked = 0
        if payload:
            stream._data(payload)
        if flags & END_STREAM:  # DATA with END_STREAM: no trailers (not gRPC)
            stream._fail(StreamError(grpc.StatusCode.INTERNAL, "the stream ended without trailers"))

    def _on_control(self, kind: int, flags: int, stream_id: int, payload: memoryview) -> None:
        if self._header_block is not None and kind != CONTINUATION:
            raise _ProtocolError("a header block interrupted")
        if kind == HEADERS:
            payload = self._strip(flags, payload)
            if flags & PRIORITY_FLAG:
                payload = payload[5:]
            self._header_block = (stream_id, flags, bytearray(payload))
            if flags & END_HEADERS:
                self._end_headers()
        elif kind == CONTINUATION:
            if self._header_block is None or self._header_block[0] != stream_id:
                raise _ProtocolError("an unexpected CONTINUATION")
            self._header_block[2].extend(payload)
            if flags & END_HEADERS:
                self._end_headers()
        elif kind == SETTINGS:
            if not flags & ACK:
                self._on_settings(payload)
        elif kind == PING:
            if not flags & ACK:
                self._write(_frame(PING, ACK, 0, bytes(payload)))
        elif kind == WINDOW_UPDATE:
            increment = _FRAME.unpack_from(payload)[0] & MAX_STREAM_ID
            if stream_id == 0:
                self.send_window += increment
            elif (stream := self.streams.get(stream_id)) is not None:
                stream.send_window += increment
            self._flush_blocked()
        elif kind == RST_STREAM:
            stream = self.streams.get(stream_id)
            if stream is not None:
                code = _FRAME.unpack_from(payload)[0]
                stream._fail(StreamError(grpc.StatusCode.CANCELLED if code == CANCEL_CODE else
                                         grpc.StatusCode.UNAVAILABLE if code == 0x7 else grpc.StatusCode.INTERNAL,
                                         f"the server reset the stream (HTTP/2 error {code})"))
        elif kind == GOAWAY:
            last = _FRAME.unpack_from(payload)[0] & MAX_STREAM_ID
            self.closed = True
            for sid, stream in list(self.streams.items()):
                if sid > last:  # never processed: safe to send again elsewhere
                    stream._fail(StreamError(grpc.StatusCode.UNAVAILABLE, "the server went away before the call"))
        elif kind == PUSH_PROMISE:
            raise _ProtocolError("a PUSH_PROMISE (push is off)")
        # PRIORITY and unknown frame types are ignored, as HTTP/2 says

    @staticmethod
    def _strip(flags: int, payload: memoryview) -> memoryview:
        if flags & PADDED:
            if not payload or payload[0] >= len(payload):
                raise _ProtocolError("a frame with bad padding")
            return payload[1:len(payload) - payload[0]]
        return payload

    def _end_headers(self) -> None:
        assert self._header_block is not None
        stream_id, flags, block = self._header_block
        self._header_block = None
        key = bytes(block)
        headers = self._decoded.get(key)
        if headers is None:
            table = self.decoder.header_table.dynamic_entries
            alone = not table  # an empty table before and after: the block decodes the same wherever it comes
            try:  # every other block is decoded, whichever stream it is for: a table must stay in step
                headers = self.decoder.decode(key)
            except hpack.HPACKError as exc:
                raise _ProtocolError(f"a header block could not be decoded ({exc})") from None
            if alone and not table and len(self._decoded) < DECODED_BLOCKS:
                self._decoded[key] = headers
        stream = self.streams.get(stream_id)
        if stream is not None:
            stream._headers(headers, bool(flags & END_STREAM))

    def _on_settings(self, payload: memoryview) -> None:
        for offset in range(0, len(payload) - len(payload) % 6, 6):
            key, value = struct.unpack_from(">HI", payload, offset)
            if key == SETTINGS_INITIAL_WINDOW_SIZE:
                for stream in self.streams.values():
                    stream.send_window += value - self.peer_initial_window
                self.peer_initial_window = value
            elif key == SETTINGS_MAX_CONCURRENT_STREAMS:
                self.peer_max_streams = value
            elif key == SETTINGS_MAX_FRAME_SIZE:
                self.peer_max_frame = value
        self._write(_frame(SETTINGS, ACK, 0))
        if not self.ready.done():
            self.ready.set_result(None)
        self._flush_blocked()

    # -- frames out -------------------------------------------------------------------------------------------

    def _write(self, data: bytes) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.write(data)

    def start(self, path: str, message: bytes, metadata: Sequence[tuple[str, str]], timeout_s: float) -> Stream:
        """Send one request (headers and its one message) on a new stream."""
        if not self.usable:
            raise StreamError(grpc.StatusCode.UNAVAILABLE, "the connection is closed")
        stream = Stream(self, self.next_id)
        self.next_id += 2
        millis = max(1, int(timeout_s * 1000))
        start = self._paths.get(path)
        if start is None:
            start = self._paths[path] = (INDEXED_POST_HTTP + literal(":path", path)
                                         + literal(":authority", self.authority) + self._regular)
        timeout = f"{millis}m" if millis < 100_000_000 else f"{millis // 1000}S"
        block = b"".join((start, literal("grpc-timeout", timeout), *(literal(k, v) for k, v in metadata)))
        if len(block) > self.peer_max_frame:
            raise StreamError(grpc.StatusCode.INTERNAL, "the request's metadata is too large")
        self.streams[stream.id] = stream
        stream._outbound = len(message).to_bytes(5, "big") + message  # flag 0 (not compressed) + length
        out = [_frame(HEADERS, END_HEADERS, stream.id, block)]
        self._send_body(stream, out)
        self._write(b"".join(out))  # the headers and what the windows let out of the body: one write
        stream._deadline = self.loop.call_later(timeout_s, self._expire, stream, timeout_s)
        return stream

    def _send_body(self, stream: Stream, out: list[bytes] | None = None) -> None:
        """As much of the request's body as the windows allow (its frames written, or added to ``out``); the rest
        waits for WINDOW_UPDATE or SETTINGS."""
        data = stream._outbound
        while data:
            room = min(self.send_window, stream.send_window, self.peer_max_frame)
            if room <= 0:
                if stream not in self._blocked:
                    self._blocked.append(stream)
                break
            piece, data = data[:room], data[room:]
            self.send_window -= len(piece)
            stream.send_window -= len(piece)
            frame = _frame(DATA, 0 if data else END_STREAM, stream.id, piece)
            if out is not None:
                out.append(frame)
            else:
                self._write(frame)
        stream._outbound = data

    def _flush_blocked(self) -> None:
        blocked, self._blocked = self._blocked, []
        for stream in blocked:
            if not stream.done:
                self._send_body(stream)

    def _expire(self, stream: Stream, timeout_s: float) -> None:
        if not stream.done:
            self.reset(stream, CANCEL_CODE)
            stream._fail(StreamError(grpc.StatusCode.DEADLINE_EXCEEDED, f"deadline of {timeout_s:g} s exceeded"))

    def reset(self, stream: Stream, code: int) -> None:
        self._write(_frame(RST_STREAM, 0, stream.id, struct.pack(">I", code)))

    def forget(self, stream: Stream) -> None:
        self.streams.pop(stream.id, None)
        if stream._deadline is not None:
            stream._deadline.cancel()
        if stream in self._blocked:
            self._blocked.remove(stream)
        if self.closed and not self.streams:  # told to go away: closed once its last stream ended
            self.close()

    def _abort(self, why: str) -> None:
        """A protocol error: the connection is closed and its streams fail."""
        if self.transport is not None:
            self._write(_frame(GOAWAY, 0, 0, struct.pack(">II", 0, 0x1) + why.encode()[:200]))
            self.transport.close()
        self.connection_lost(ConnectionError(f"HTTP/2 protocol error: {why}"))

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()


class _ProtocolError(Exception):
    pass


def plain_target(address: str) -> tuple[str, int] | None:
    """(host, port) of a gRPC target this client can reach (``host:port``, ``[v6]:port``, ``dns:///host:port``),
    else None (e.g. ``unix:`` sockets)."""
    target = address.removeprefix("dns:///").removeprefix("ipv4:").removeprefix("ipv6:")
    host, sep, port = target.rpartition(":")
    if not sep or not host or not port.isdigit() or ":" in target.split("]")[-1].rpartition(":")[0] or "/" in target:
        return None
    return host.strip("[]"), int(port)


class Channel:
    """Streams to one worker (``host:port``) over one connection, opened on first use and again after it was
    lost or told to go away."""

    def __init__(self, address: str, connect_timeout_s: float = 2.0):
        self.address = address
        target = plain_target(address)
        if target is None:
            raise ValueError(f"not a host:port target: {address!r}")
        self.host, self.port = target
        self.connect_timeout_s = connect_timeout_s
        self._conn: Connection | None = None
        self._connecting: asyncio.Future | None = None

    async def _connection(self) -> Connection:
        conn = self._conn
        if conn is not None and conn.usable:
            return conn
        if conn is not None and not conn.closed:  # full (the server's stream limit) or out of stream ids
            conn.retire()
        if self._connecting is None:
            self._connecting = asyncio.ensure_future(self._connect())
        connecting = self._connecting
        try:
            return await asyncio.shield(connecting)
        finally:
            if connecting.done() and self._connecting is connecting:
                self._connecting = None

    async def _connect(self) -> Connection:
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(self.connect_timeout_s):
                _, conn = await loop.create_connection(lambda: Connection(self.address), self.host, self.port)
                await conn.ready
        except (OSError, TimeoutError, ConnectionError) as exc:
            raise StreamError(grpc.StatusCode.UNAVAILABLE, f"cannot connect to {self.address} ({exc!r})") from None
        old, self._conn = self._conn, conn
        if old is not None and not old.streams:
            old.close()
        return conn

    async def call(self, path: str, message: bytes, metadata: Sequence[tuple[str, str]], timeout_s: float) -> Stream:
        while True:  # a connection that others filled meanwhile is retired, and the call goes to a new one
            conn = await self._connection()
            if conn.usable:
                return conn.start(path, message, metadata, timeout_s)

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None
