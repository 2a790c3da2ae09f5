"""A lean HTTP/1.1 client for streamed (SSE) responses, for the serving benchmarks.

The benchmark client shares the machine with the server it measures: on the 2-core
reference, httpx's streaming path cost ~0.5 ms of CPU per received chunk (anyio, the
line decoder, the per-read timeouts), ~10 % of a core at 16 clients, taken from the
server's threads and counted in its inter-token latency. This client reads a
keep-alive connection in large reads, undoes the chunked transfer coding in a
buffer and hands over complete ``data:`` lines with the time of the read that
completed them (what httpx's ``aiter_lines`` gave too), at a fraction of the cost.

It speaks just what the benchmarks need: ``POST`` of a JSON body, responses framed by
``Transfer-Encoding: chunked``, ``Content-Length`` or the end of the connection, one
request at a time per connection.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable


class HTTPStreamError(Exception):
    """A connection that failed, timed out or answered something that is not HTTP."""


class Response:
    def __init__(self, status: int, body: bytes) -> None:
        self.status = status
        self.body = body

    @property
    def text(self) -> str:
        return self.body.decode("utf-8", "replace")


class SSEConnection:
    """One keep-alive connection to ``host:port``, reconnecting when the server closed it.

    ``idle_timeout``: seconds a request may wait for its next bytes before it fails.
    """

    def __init__(self, host: str, port: int, idle_timeout: float) -> None:
        self.host, self.port = host, port
        self.idle_timeout = idle_timeout
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            try:
                await self.writer.wait_closed()
            except OSError:
                pass
        self.reader = self.writer = None

    async def _read(self) -> bytes:
        assert self.reader is not None
        try:
            return await asyncio.wait_for(self.reader.read(1 << 16), self.idle_timeout)
        except (TimeoutError, asyncio.TimeoutError) as exc:
            raise HTTPStreamError(f"no data for {self.idle_timeout:.0f} s") from exc

    async def post_stream(self, path: str, body: dict,
                          on_line: Callable[[bytes, float], None]) -> Response:
        """POST ``body`` as JSON to ``path``; call ``on_line(line, t)`` for every line of
        a 200 response's body as it arrives (``t``: ``time.perf_counter()`` when the read
        that completed it returned). Returns the status, and the body of any other status."""
        if self.writer is None:
            try:
                self.reader, self.writer = await asyncio.wait_for(
                    asyncio.open_connection(self.host, self.port), self.idle_timeout)
            except (OSError, TimeoutError, asyncio.TimeoutError) as exc:
                raise HTTPStreamError(f"cannot connect to {self.host}:{self.port}: {exc}") \
                    from exc
        payload = json.dumps(body).encode()
        self.writer.write(
            f"POST {path} HTTP/1.1\r\nHost: {self.host}:{self.port}\r\n"
            f"Content-Type: application/json\r\nAccept: text/event-stream\r\n"
            f"Content-Length: {len(payload)}\r\n\r\n".encode() + payload)
        try:
            return await self._response(on_line)
        except BaseException:
            await self.close()  # the connection's state is unknown
            raise

    async def _response(self, on_line: Callable[[bytes, float], None]) -> Response:
        buf = b""
        while (end := buf.find(b"\r\n\r\n")) < 0:
            data = await self._read()
            if not data:
                raise HTTPStreamError("the server closed the connection before a response")
            buf += data
        head, buf = buf[:end].decode("latin-1").split("\r\n"), buf[end + 4:]
        try:
            status = int(head[0].split(" ", 2)[1])
        except (IndexError, ValueError) as exc:
            raise HTTPStreamError(f"not an HTTP response: {head[0]!r}") from exc
        headers = {}
        for line in head[1:]:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
        chunked = "chunked" in headers.get("transfer-encoding", "").lower()
        length = int(headers["content-length"]) if "content-length" in headers else None
        keep = headers.get("connection", "").lower() != "close"
        body = bytearray()   # the decoded body not yet split into lines (or all of it)
        received = 0         # bytes of a Content-Length body so far
        stream = status == 200
        now = time.perf_counter()
        done = False
        while True:
            # Decode what the buffer holds.
            if chunked:
                while True:
                    eol = buf.find(b"\r\n")
                    if eol < 0:
                        break
                    try:
                        size = int(buf[:eol].split(b";", 1)[0], 16)
                    except ValueError as exc:
                        raise HTTPStreamError(f"bad chunk size {bytes(buf[:eol][:20])!r}") \
                            from exc
                    if size == 0:
                        # Trailers end with an empty line; none are sent here in practice.
                        if buf.find(b"\r\n", eol + 2) < 0:
                            break
                        buf = b""
                        done = True
                        break
                    if len(buf) < eol + 2 + size + 2:
                        break
                    body += buf[eol + 2:eol + 2 + size]
                    buf = buf[eol + 4 + size:]
            else:
                body += buf
                received += len(buf)
                buf = b""
                done = length is not None and received >= length
            if stream:
                start = 0
                while (nl := body.find(b"\n", start)) >= 0:
                    on_line(bytes(body[start:nl]).rstrip(b"\r"), now)
                    start = nl + 1
                del body[:start]
            if done:
                break
            data = await self._read()
            now = time.perf_counter()
            if not data:
                if chunked or length is not None:
                    raise HTTPStreamError("the server closed the connection mid-response")
                keep = False
                break
            buf += data
        if stream and body:
            on_line(bytes(body).rstrip(b"\r"), now)
        if not keep:
            await self.close()
        return Response(status, b"" if stream else bytes(body))
