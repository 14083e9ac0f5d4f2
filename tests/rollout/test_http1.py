"""``agentrl.rollout.http1``: the rollout client's /generate transport, against raw servers that answer with
every framing it accepts and misbehave in the ways a dying engine or a broken proxy does."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import pytest

from agentrl.rollout.http1 import MAX_HEAD_BYTES, Http1Pool, HttpConnectionError

pytestmark = pytest.mark.timeout(30)


class RawServer:
    """A TCP server on 127.0.0.1: each request's head and body are read, then ``reply(n, head)`` gives the bytes
    to send back (a list: written one by one, with a pause, to split the answer across reads; a last ``b""``
    hangs up after it) or None to hang up at once."""

    def __init__(self, reply: Callable[[int, bytes], list[bytes] | None]) -> None:
        self.reply = reply
        self.requests: list[bytes] = []
        self.connections = 0

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                              if line.lower().startswith(b"content-length:"))
                body = await reader.readexactly(length)
                self.requests.append(head + body)
                parts = self.reply(len(self.requests), head)
                if parts is None:
                    break
                for part in parts:
                    writer.write(part)
                    await writer.drain()
                    await asyncio.sleep(0.001)
                if parts and parts[-1] == b"":  # a last empty part: hang up once the answer is out
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    async def __aenter__(self) -> Http1Pool:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        port = self.server.sockets[0].getsockname()[1]
        return Http1Pool("127.0.0.1", port, connect_timeout=2.0)

    async def __aexit__(self, *exc: object) -> None:
        self.server.close()


def ok(body: bytes = b'{"a": 1}') -> list[bytes]:
    return [b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body) + body]


def run(reply, *posts: dict[str, str]):
    """Send one POST per ``posts`` entry (its headers) through one pool; the (status, body) pairs or exceptions."""
    server = RawServer(reply)

    async def main():
        out = []
        async with server as pool:
            for headers in posts:
                try:
                    out.append(await pool.post("/generate", b'{"x": 1}', headers))
                except HttpConnectionError as exc:
                    out.append(exc)
            pool.close()
        return out

    return asyncio.run(main()), server


def test_keep_alive_reuses_one_connection_and_sends_the_request_exactly():
    (first, second), server = run(lambda n, head: ok(b"%d" % n), {"X-SMG-Routing-Key": "s-1"}, {})
    assert first == (200, b"1") and second == (200, b"2")
    assert server.connections == 1
    assert server.requests[0].startswith(b"POST /generate HTTP/1.1\r\nHost: 127.0.0.1:")
    assert b"\r\nContent-Length: 8\r\nX-SMG-Routing-Key: s-1\r\n\r\n{\"x\": 1}" in server.requests[0]


def test_every_framing_is_read_whole_even_split_into_bytes():
    body = b'{"text": "' + b"y" * 3000 + b'"}'
    framed = ok(body)[0]
    chunked = (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
               b"a;ext=1\r\n" + body[:10] + b"\r\n" + b"%x\r\n" % (len(body) - 10) + body[10:] + b"\r\n0\r\n\r\n")
    trailers = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n4\r\nabcd\r\n0\r\nX-T: 1\r\n\r\n"
    answers = {1: [framed[i:i + 7] for i in range(0, 140, 7)] + [framed[140:]],  # the head 7 bytes a write
               2: [chunked[:5], chunked[5:40], chunked[40:]], 3: [trailers],
               4: [b"HTTP/1.1 204 No Content\r\n\r\n"], 5: [b"HTTP/1.1 503 Busy\r\nContent-Length: 4\r\n\r\nbusy"]}
    results, server = run(lambda n, head: answers[n], *({} for _ in answers))
    assert results == [(200, body), (200, body), (200, b"abcd"), (204, b""), (503, b"busy")]
    assert server.connections == 1


def test_a_body_framed_by_close_is_read_and_the_connection_not_reused():
    results, server = run(lambda n, head: [b"HTTP/1.1 200 OK\r\n\r\nuntil-", b"close", b""] if n == 1 else ok(), {}, {})
    assert results == [(200, b"until-close"), (200, b'{"a": 1}')] and server.connections == 2


def test_connection_close_and_http_1_0_are_not_reused():
    def reply(n, head):
        if n == 1:
            return [b"HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: 1\r\n\r\na"]
        return [b"HTTP/1.0 200 OK\r\nContent-Length: 1\r\n\r\nb"] if n == 2 else ok()

    results, server = run(reply, {}, {}, {})
    assert [r[1] for r in results] == [b"a", b"b", b'{"a": 1}'] and server.connections == 3


@pytest.mark.parametrize(
    ("answer", "match"),
    [
        (None, "closed the connection before the whole response"),
        ([b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n{\"cut", b""], "before the whole response"),
        ([b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nab", b""], "before the whole response"),
        ([b"SMTP ready\r\n\r\n"], "malformed status line"),
        ([b"HTTP/1.1 2000 OK\r\n\r\n"], "malformed status line"),
        ([b"HTTP/1.1 100 Continue\r\n\r\n"], "unexpected interim response 100"),
        ([b"HTTP/1.1 200 OK\r\nno colon here\r\n\r\n"], "malformed header line"),
        ([b"HTTP/1.1 200 OK\r\nContent-Length: -5\r\n\r\n"], "bad Content-Length"),
        ([b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nContent-Length: 3\r\n\r\nab"], "bad Content-Length"),
        ([b"HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip\r\n\r\n"], "unsupported Transfer-Encoding"),
        ([b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n"], "malformed chunk size"),
        ([b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n-1\r\n"], "malformed chunk size"),
        ([b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nabXX"], "chunk not followed by CRLF"),
        ([b"HTTP/1.1 200 OK\r\nX-Big: " + b"a" * (MAX_HEAD_BYTES + 10)], "response head over"),
    ],
)
def test_broken_answers_are_a_connection_error_and_the_next_request_gets_a_fresh_connection(answer, match):
    results, server = run(lambda n, head: answer if n == 1 else ok(), {}, {})
    assert isinstance(results[0], HttpConnectionError) and match in str(results[0])
    assert results[1] == (200, b'{"a": 1}') and server.connections == 2


def test_bytes_beyond_the_response_retire_the_connection():
    results, server = run(lambda n, head: [ok()[0] + b"HTTP/1.1 200 OK\r\n"] if n == 1 else ok(), {}, {})
    assert results == [(200, b'{"a": 1}')] * 2 and server.connections == 2


def test_refused_connection_and_header_injection():
    async def main():
        probe = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
        port = probe.sockets[0].getsockname()[1]
        probe.close()
        await probe.wait_closed()
        pool = Http1Pool("127.0.0.1", port)
        with pytest.raises(HttpConnectionError, match="cannot connect"):
            await pool.post("/generate", b"{}", {})
        for bad in ({"X-SMG-Routing-Key": "s\r\nX-Evil: 1"}, {"X-A\nB": "v"}, {"X-A: B": "v"}):
            with pytest.raises(ValueError, match="header injection"):
                await pool.post("/generate", b"{}", bad)

    asyncio.run(main())


def test_a_cancelled_request_closes_its_connection():
    async def main():
        seen = asyncio.Event()
        server = RawServer(lambda n, head: (seen.set(), [b"HTTP/1.1 200 OK\r\nContent-Length: 1\r\n\r\n"])[1]
                           if n == 1 else ok())
        async with server as pool:
            task = asyncio.create_task(pool.post("/generate", b"{}", {}))
            await asyncio.wait_for(seen.wait(), 5)
            await asyncio.sleep(0.05)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            assert await pool.post("/generate", b"{}", {}) == (200, b'{"a": 1}')
            assert server.connections == 2

    asyncio.run(main())
