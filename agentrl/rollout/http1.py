"""A minimal HTTP/1.1 keep-alive client for the rollout hot path: one POST out, one whole body back.

The rollout client sends one ``/generate`` per agent turn; through aiohttp that cost the client process about
as much CPU as the smg router and the engine server each spent on the same request. This pool does only what
that call needs: ``http://`` origins (smg, an engine), a body framed by ``Content-Length`` or chunked (or, with
neither, by the connection's close), keep-alive with a LIFO pool of idle connections, nothing else (no
redirects, proxies, cookies, TLS or compression: ``https`` URLs stay on aiohttp).

Every failure to get a whole response (refused, reset, a body cut short, a malformed or oversized head) is a
:class:`HttpConnectionError`; the caller decides whether to retry. A connection whose state is unknown (an
error, a cancelled request, bytes the server sent unasked) is closed, never reused.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping

MAX_HEAD_BYTES = 64 * 1024  # a response head (status line + headers) larger than this is refused
_NO_BODY = frozenset({204, 304})


class HttpConnectionError(ConnectionError):
    """No whole HTTP response came back on the connection (the request may or may not have been served)."""


class _Connection(asyncio.Protocol):
    """One keep-alive connection: at most one request in flight, its response parsed as bytes arrive."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.buffer = bytearray()
        self.waiter: asyncio.Future | None = None
        self.closed = False
        self.reusable = True
        self.status: int | None = None
        self.length: int | None = None  # None with status set and not chunked: the body ends at close
        self.chunked = False
        self.chunks = bytearray()

    # -- asyncio.Protocol ---------------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        if self.waiter is None:  # bytes nobody asked for: the connection cannot be trusted any more
            self.reusable = False
            self.transport.close()
            return
        self.buffer += data
        try:
            self._parse()
        except HttpConnectionError as exc:
            self._fail(exc)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        waiter = self.waiter
        if waiter is None or waiter.done():
            return
        if self.status is not None and self.length is None and not self.chunked:
            self._deliver(bytes(self.buffer))  # a body framed by the connection's close
        else:
            why = f": {exc!r}" if exc is not None else ""
            waiter.set_exception(HttpConnectionError(f"the server closed the connection before the whole response{why}"))

    # -- parsing ------------------------------------------------------------------------------------
    def _parse(self) -> None:
        if self.status is None:
            end = self.buffer.find(b"\r\n\r\n")
            if end < 0:
                if len(self.buffer) > MAX_HEAD_BYTES:
                    raise HttpConnectionError(f"response head over {MAX_HEAD_BYTES} bytes")
                return
            self._read_head(bytes(self.buffer[:end]))
            del self.buffer[: end + 4]
        if self.chunked:
            if self._dechunk():
                self._deliver(bytes(self.chunks))
        elif self.length is not None and len(self.buffer) >= self.length:
            body = bytes(self.buffer[: self.length])
            del self.buffer[: self.length]
            self._deliver(body)

    def _read_head(self, head: bytes) -> None:
        lines = head.split(b"\r\n")
        parts = lines[0].split(b" ", 2)
        if len(parts) < 2 or not parts[0].startswith(b"HTTP/1.") or len(parts[1]) != 3 or not parts[1].isdigit():
            raise HttpConnectionError(f"malformed status line {lines[0][:100]!r}")
        status = int(parts[1])
        if status < 200:
            raise HttpConnectionError(f"unexpected interim response {status}")
        keep = parts[0] == b"HTTP/1.1"
        length: int | None = None
        chunked = False
        for line in lines[1:]:
            name, sep, value = line.partition(b":")
            if not sep:
                raise HttpConnectionError(f"malformed header line {line[:100]!r}")
            name = name.strip().lower()
            if name == b"content-length":
                value = value.strip()
                if not value.isdigit() or (length is not None and int(value) != length):
                    raise HttpConnectionError(f"bad Content-Length {value[:40]!r}")
                length = int(value)
            elif name == b"transfer-encoding":
                chunked = value.strip().lower().endswith(b"chunked")
                if not chunked:
                    raise HttpConnectionError(f"unsupported Transfer-Encoding {value.strip()[:40]!r}")
            elif name == b"connection" and b"close" in value.lower():
                keep = False
        self.status = status
        self.reusable = self.reusable and keep
        if chunked:  # chunked wins over a Content-Length (RFC 9112 6.3)
            self.chunked, self.chunks = True, bytearray()
        elif length is None and status in _NO_BODY:
            self.length = 0
        else:
            self.length = length
            if length is None:
                self.reusable = False  # read until close

    def _dechunk(self) -> bool:
        """Move whole chunks from the buffer into ``chunks``; True once the last chunk (and trailers) arrived."""
        buf = self.buffer
        while True:
            line_end = buf.find(b"\r\n")
            if line_end < 0:
                if len(buf) > MAX_HEAD_BYTES:
                    raise HttpConnectionError("chunk size line too long")
                return False
            size_field = bytes(buf[:line_end]).split(b";", 1)[0].strip()
            try:
                size = int(size_field, 16)
            except ValueError:
                raise HttpConnectionError(f"malformed chunk size {size_field[:40]!r}") from None
            if size < 0 or size_field.startswith((b"-", b"+", b"0x", b"0X")):
                raise HttpConnectionError(f"malformed chunk size {size_field[:40]!r}")
            if size == 0:  # the last chunk, then trailers up to an empty line
                if buf[line_end + 2 : line_end + 4] == b"\r\n":
                    del buf[: line_end + 4]
                    return True
                end = buf.find(b"\r\n\r\n", line_end + 2)
                if end < 0:
                    return False
                del buf[: end + 4]
                return True
            start = line_end + 2
            if len(buf) < start + size + 2:
                return False
            if buf[start + size : start + size + 2] != b"\r\n":
                raise HttpConnectionError("chunk not followed by CRLF")
            self.chunks += buf[start : start + size]
            del buf[: start + size + 2]

    def _deliver(self, body: bytes) -> None:
        if self.buffer:
            self.reusable = False  # bytes beyond the response: out of step with the server
        waiter, status = self.waiter, self.status
        self.waiter, self.status, self.length, self.chunked = None, None, None, False
        if waiter is not None and not waiter.done():
            waiter.set_result((status, body))

    def _fail(self, exc: HttpConnectionError) -> None:
        self.reusable = False
        waiter, self.waiter = self.waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_exception(exc)
        self.transport.close()


class Http1Pool:
    """Keep-alive connections to one ``host:port``, used from the event loop that made the pool.

    ``post`` returns ``(status, body)`` for any status; at most ``max_connections`` requests are in flight (the
    rest wait for a free slot), and connections opened beyond that are never kept."""

    def __init__(self, host: str, port: int, *, max_connections: int = 1024, connect_timeout: float = 10.0) -> None:
        self.host = host
        self.port = port
        self.connect_timeout = connect_timeout
        authority = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        self._host_line = f"Host: {authority}\r\n"
        self._slots = asyncio.Semaphore(max_connections)
        self._idle: list[_Connection] = []

    async def post(self, target: str, payload: bytes, headers: Mapping[str, str]) -> tuple[int, bytes]:
        """``POST target`` with ``payload``; the whole response as ``(status, body)``."""
        head = f"POST {target} HTTP/1.1\r\n{self._host_line}Content-Length: {len(payload)}\r\n"
        for name, value in headers.items():
            if "\r" in name or "\n" in name or "\r" in value or "\n" in value or ":" in name:
                raise ValueError(f"header {name!r} holds a line break or colon: refused (header injection)")
            head += f"{name}: {value}\r\n"
        request = (head + "\r\n").encode("utf-8") + payload
        async with self._slots:
            conn = self._reuse() or await self._connect()
            conn.waiter = waiter = asyncio.get_running_loop().create_future()
            conn.transport.write(request)
            try:
                status, body = await waiter
            except BaseException:  # an error, a timeout or a cancellation: the connection's state is unknown
                conn.reusable = False
                conn.transport.close()
                raise
            if conn.reusable and not conn.closed:
                self._idle.append(conn)
            else:
                conn.transport.close()
            return status, body

    def _reuse(self) -> _Connection | None:
        while self._idle:
            conn = self._idle.pop()
            if not conn.closed and conn.reusable and not conn.transport.is_closing():
                return conn
        return None

    async def _connect(self) -> _Connection:
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(self.connect_timeout):
                _, conn = await loop.create_connection(_Connection, self.host, self.port)
        except TimeoutError:
            raise HttpConnectionError(f"connecting to {self.host}:{self.port} took over {self.connect_timeout:g} s") from None
        except OSError as exc:
            raise HttpConnectionError(f"cannot connect to {self.host}:{self.port}: {exc}") from exc
        return conn

    def close(self) -> None:
        """Close the idle connections (requests in flight finish and close theirs)."""
        while self._idle:
            self._idle.pop().transport.close()
