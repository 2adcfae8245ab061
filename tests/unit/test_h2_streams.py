"""The lean HTTP/2 client for D's token streams (services/engine/h2_streams.py): against a real grpc.aio server on
loopback (statuses, metadata, deadlines, cancellation, flow control of a large request, many streams at once, a lost
server), its frame parser fed by hand (frames split anywhere, padding, CONTINUATION, messages across frames), and the
express lane (Stream.express: what it takes is never queued, what it declines is queued in order with all after it,
what it raises the next read raises)."""

from __future__ import annotations

import asyncio
import struct

import grpc
import hpack
import pytest
from kvshuttle.services.engine import h2_streams
from kvshuttle.services.engine.h2_streams import Channel, StreamError

from tests.support.waits import until

ECHO = "/test.Echo/Stream"


class EchoServer:
    """A grpc.aio server with one server-streaming method of raw bytes: the request names what to do."""

    def __init__(self, options=()):
        self.server = grpc.aio.server(options=list(options))
        self.cancelled: list[bytes] = []
        self.requests: list[bytes] = []
        self.metadata: list[dict] = []

        async def stream(request: bytes, context: grpc.aio.ServicerContext):
            self.requests.append(request)
            self.metadata.append(dict(context.invocation_metadata() or ()))
            await context.send_initial_metadata((("x-hello", "world"),))
            try:
                if request.startswith(b"abort"):
                    await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "no room: 100% used\nsee /x?y")
                if request.startswith(b"slow"):
                    for i in range(1000):
                        yield b"s%d" % i
                        await asyncio.sleep(0.02)
                    return
                if request.startswith(b"big"):
                    yield b"x" * 200_000  # over the default 16 KiB frame: a message across frames
                    return
                count = int(request.split(b":")[1].split()[0]) if request.startswith(b"count:") else 3
                for i in range(count):
                    yield b"m%d" % i
                yield b""  # an empty message is a message
                context.set_trailing_metadata((("x-bye", "now"),))
            except asyncio.CancelledError:
                self.cancelled.append(request)
                raise

        handler = grpc.unary_stream_rpc_method_handler(stream)
        self.server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("test.Echo",
                                                                                  {"Stream": handler}),))
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        self.address = f"127.0.0.1:{self.port}"


@pytest.fixture
async def server():
    s = EchoServer()
    await s.server.start()
    yield s
    await s.server.stop(0)


@pytest.fixture
async def channel(server):
    ch = Channel(server.address)
    yield ch
    ch.close()


async def read_all(stream: h2_streams.Stream) -> list[bytes]:
    out = []
    while (message := await stream.read()) is not None:
        out.append(message)
    return out


async def test_messages_metadata_and_a_clean_end(channel, server):
    stream = await channel.call(ECHO, b"count:3", [("x-salt", "abc"), ("traceparent", "00-" + "1" * 32 + "-"
                                                                      + "2" * 16 + "-01")], 5)
    assert await read_all(stream) == [b"m0", b"m1", b"m2", b""]
    assert stream.initial_metadata["x-hello"] == "world" and stream.done
    assert server.requests == [b"count:3"] and server.metadata[0]["x-salt"] == "abc"
    assert await stream.read() is None  # an ended stream stays ended


async def test_a_status_and_its_message_arrive_decoded(channel):
    stream = await channel.call(ECHO, b"abort", [], 5)
    with pytest.raises(StreamError) as err:
        await read_all(stream)
    assert err.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert err.value.message == "no room: 100% used\nsee /x?y"


async def test_an_unknown_method_is_unimplemented(channel):
    stream = await channel.call("/test.Echo/Nothing", b"", [], 5)
    with pytest.raises(StreamError) as err:
        await read_all(stream)
    assert err.value.code == grpc.StatusCode.UNIMPLEMENTED


async def test_the_deadline_fails_the_stream_and_the_server_stops(channel, server):
    stream = await channel.call(ECHO, b"slow-deadline", [], 0.2)
    with pytest.raises(StreamError) as err:
        await read_all(stream)
    assert err.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
    await until(lambda: b"slow-deadline" in server.cancelled, 5.0, "the server to stop the call")


async def test_cancel_resets_the_stream_and_the_connection_goes_on(channel, server):
    stream = await channel.call(ECHO, b"slow-cancel", [], 5)
    assert await stream.read() == b"s0"
    stream.cancel()
    with pytest.raises(StreamError) as err:
        await stream.read()
    assert err.value.code == grpc.StatusCode.CANCELLED
    await until(lambda: b"slow-cancel" in server.cancelled, 5.0, "the server to see the cancellation")
    assert await read_all(await channel.call(ECHO, b"count:2", [], 5)) == [b"m0", b"m1", b""]


async def test_a_request_larger_than_the_servers_window_goes_out_whole(channel, server):
    body = b"count:1 " + bytes(range(256)) * 4000  # 1 MB: past the 64 KiB windows the server starts with
    stream = await channel.call(ECHO, body, [], 10)
    assert await read_all(stream) == [b"m0", b""]
    assert server.requests[-1] == body


async def test_a_message_across_frames(channel):
    stream = await channel.call(ECHO, b"big", [], 5)
    assert await read_all(stream) == [b"x" * 200_000]


async def test_many_streams_at_once_on_one_connection(channel):
    async def one(n: int) -> list[bytes]:
        return await read_all(await channel.call(ECHO, b"count:%d" % n, [], 10))

    results = await asyncio.gather(*(one(n % 50) for n in range(300)))
    assert all(got == [b"m%d" % i for i in range(n % 50)] + [b""] for n, got in enumerate(results))


async def test_a_lost_server_fails_its_streams_and_a_new_one_is_reached():
    first = EchoServer()
    await first.server.start()
    channel = Channel(first.address)
    stream = await channel.call(ECHO, b"slow-lost", [], 10)
    assert await stream.read() == b"s0"
    await first.server.stop(0)
    with pytest.raises(StreamError) as err:
        await read_all(stream)
    assert err.value.code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED)
    with pytest.raises(StreamError) as err:
        await channel.call(ECHO, b"count:1", [], 5)
    assert err.value.code == grpc.StatusCode.UNAVAILABLE and "cannot connect" in err.value.message

    second = grpc.aio.server()  # the same port again: the channel connects anew
    handler = grpc.unary_stream_rpc_method_handler(_two)
    second.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("test.Echo", {"Stream": handler}),))
    second.add_insecure_port(first.address)
    await second.start()
    try:
        assert await read_all(await channel.call(ECHO, b"", [], 5)) == [b"a", b"b"]
    finally:
        channel.close()
        await second.stop(0)


async def _two(request: bytes, context: grpc.aio.ServicerContext):
    yield b"a"
    yield b"b"


async def test_past_the_servers_stream_limit_calls_go_to_another_connection():
    limited = EchoServer(options=[("grpc.max_concurrent_streams", 2)])
    await limited.server.start()
    channel = Channel(limited.address)
    try:
        async def slow(i: int) -> list[bytes]:
            stream = await channel.call(ECHO, b"slow-%d" % i, [], 10)
            got = [await stream.read() for _ in range(3)]
            stream.cancel()
            return got

        results = await asyncio.gather(*(slow(i) for i in range(5)))
        assert results == [[b"s0", b"s1", b"s2"]] * 5  # none refused: 3 connections, 2 streams each at most
        assert await read_all(await channel.call(ECHO, b"count:1", [], 5)) == [b"m0", b""]
    finally:
        channel.close()
        await limited.server.stop(0)


def test_only_host_port_targets_are_taken():
    assert h2_streams.plain_target("10.0.0.7:50051") == ("10.0.0.7", 50051)
    assert h2_streams.plain_target("dns:///decode-0.svc:8001") == ("decode-0.svc", 8001)
    assert h2_streams.plain_target("[::1]:9") == ("::1", 9)
    for other in ("unix:/run/vllm.sock", "decode-0", "a:b:c:1", "host:port"):
        assert h2_streams.plain_target(other) is None
    with pytest.raises(ValueError):
        Channel("unix:/run/vllm.sock")


# -- the frame parser, fed by hand ---------------------------------------------------------------------------------

class _Transport(asyncio.Transport):
    def __init__(self):
        super().__init__()
        self.written = bytearray()
        self.closed = False

    def write(self, data) -> None:
        self.written += data

    def is_closing(self) -> bool:
        return self.closed

    def close(self) -> None:
        self.closed = True


def _frame(kind: int, flags: int, stream_id: int, payload: bytes) -> bytes:
    return h2_streams._frame(kind, flags, stream_id, payload)


def _message(data: bytes) -> bytes:
    return b"\0" + struct.pack(">I", len(data)) + data


async def test_frames_split_anywhere_with_padding_and_continuation_parse_the_same():
    encoder = hpack.Encoder()
    head = encoder.encode([(":status", "200"), ("content-type", "application/grpc"), ("x-a", "1")])
    trailers = encoder.encode([("grpc-status", "0"), ("grpc-message", "")])
    body = _message(b"one") + _message(b"two")
    wire = (_frame(h2_streams.SETTINGS, 0, 0, b"")
            + _frame(h2_streams.HEADERS, 0, 1, head[:3]) + _frame(h2_streams.CONTINUATION, h2_streams.END_HEADERS,
                                                                    1, head[3:])
            + _frame(h2_streams.DATA, h2_streams.PADDED, 1, b"\x04" + body[:6] + b"\0" * 4)  # padded, cut mid-message
            + _frame(h2_streams.PING, 0, 0, b"12345678")
            + _frame(h2_streams.DATA, 0, 1, body[6:])
            + _frame(h2_streams.HEADERS, h2_streams.END_HEADERS | h2_streams.END_STREAM, 1, trailers))
    for step in (len(wire), 1, 7):
        conn = h2_streams.Connection("test")
        transport = _Transport()
        conn.connection_made(transport)
        stream = conn.start("/x/y", b"req", [], 5)
        for i in range(0, len(wire), step):
            conn.data_received(wire[i:i + step])
        assert await read_all(stream) == [b"one", b"two"], step
        assert stream.initial_metadata == {"content-type": "application/grpc", "x-a": "1"}
        assert _frame(h2_streams.PING, h2_streams.ACK, 0, b"12345678") in transport.written
        assert not conn.streams  # forgotten once ended


async def test_a_bad_frame_closes_the_connection_and_fails_its_streams():
    conn = h2_streams.Connection("test")
    transport = _Transport()
    conn.connection_made(transport)
    stream = conn.start("/x/y", b"req", [], 5)
    conn.data_received(_frame(h2_streams.CONTINUATION, h2_streams.END_HEADERS, 1, b""))  # no HEADERS before it
    with pytest.raises(StreamError) as err:
        await stream.read()
    assert err.value.code == grpc.StatusCode.UNAVAILABLE and "protocol error" in err.value.message
    assert transport.closed and not conn.usable


def test_request_headers_are_literals_any_decoder_reads_alone():
    """A request's header block does not depend on earlier blocks (literals without indexing): a fresh decoder
    reads each, and the decoder's table stays empty; lengths past the 7-bit prefix are written in full."""
    long = "v" * 300
    for name, value in [("x", ""), ("x-salt", "abc"), ("x-long", long), ("k" * 127, "w" * 128)]:
        decoder = hpack.Decoder()
        assert decoder.decode(h2_streams.literal(name, value)) == [(name, value)]
        assert not decoder.header_table.dynamic_entries


async def test_the_servers_header_blocks_decode_alone_and_repeats_are_read_from_memory(channel, server, monkeypatch):
    """Our SETTINGS announce a header table of 0 bytes, so the server's blocks decode on their own; a block seen
    before is not decoded again (the same response headers and trailers come with every call)."""
    for _ in range(3):
        assert await read_all(await channel.call(ECHO, b"count:2", [("x-salt", "abc")], 5)) == [b"m0", b"m1", b""]
    conn = channel._conn
    assert not conn.decoder.header_table.dynamic_entries
    assert conn._decoded  # the response headers and the trailers
    decoded = []
    original = conn.decoder.decode
    monkeypatch.setattr(conn.decoder, "decode", lambda block: decoded.append(block) or original(block))
    stream = await channel.call(ECHO, b"count:1", [("x-salt", "abc")], 5)
    assert await read_all(stream) == [b"m0", b""] and stream.initial_metadata["x-hello"] == "world"
    assert decoded == []
    with pytest.raises(StreamError) as err:  # a new block (another status) is decoded, and its message read
        await read_all(await channel.call(ECHO, b"abort", [], 5))
    assert err.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED and len(decoded) == 1


# -- the express lane (Stream.express): a waiting reader's messages taken in the read callback -------------------

async def test_what_express_takes_is_never_queued(channel, server):
    stream = await channel.call(ECHO, b"count:5", (), 5.0)
    taken: list[bytes] = []
    stream.express = lambda message: taken.append(message) or True
    assert await read_all(stream) == []
    assert taken == [b"m0", b"m1", b"m2", b"m3", b"m4", b""]


async def test_a_declined_message_and_all_after_it_are_read_in_order(channel):
    stream = await channel.call(ECHO, b"count:5", (), 5.0)
    taken: list[bytes] = []

    def express(message: bytes) -> bool:
        if message == b"m2":
            return False
        taken.append(message)
        return True

    stream.express = express
    first = await stream.read()  # m2 woke the reader; m3, m4 and b"" came behind it, so they were queued too
    stream.express = None
    assert taken == [b"m0", b"m1"] and [first, *await read_all(stream)] == [b"m2", b"m3", b"m4", b""]


async def test_what_express_raises_the_next_read_raises(channel):
    stream = await channel.call(ECHO, b"count:4", (), 5.0)

    def express(message: bytes) -> bool:
        if message == b"m1":
            raise ValueError("a bug in a spelling")
        return True

    stream.express = express
    with pytest.raises(ValueError, match="a bug in a spelling"):
        await stream.read()
    assert stream.express is None
    assert await read_all(stream) == [b"m2", b"m3", b""]  # nothing lost after it, nothing taken twice
