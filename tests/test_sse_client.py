"""bench/sse_client.py, the serving benchmarks' streaming client, against a small asyncio
server that frames its answers the ways HTTP allows: chunked (cut at every byte), by
Content-Length, by closing the connection; keep-alive reuse; a stalled server."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

import vs_llamacpp as vs
from sse_client import HTTPStreamError, SSEConnection

EVENTS = [b'data: {"choices":[{"index":0,"text":"a"}]}',
          'data: {"choices":[{"index":0,"text":"\u00e9"}]}'.encode(),
          b'data: {"choices":[],"usage":{"completion_tokens":2}}',
          b"data: [DONE]"]
SSE = b"".join(e + b"\n\n" for e in EVENTS)


def chunked(body: bytes, size: int) -> bytes:
    parts = [body[i:i + size] for i in range(0, len(body), size)]
    return b"".join(b"%x\r\n" % len(p) + p + b"\r\n" for p in parts) + b"0\r\n\r\n"


async def serve(answers: list[bytes], piece: int, seen: list[bytes], stall: bool = False):
    """A server that answers each request on a connection with the next of ``answers``,
    written ``piece`` bytes at a time; records the requests' bodies."""
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while answers:
            head = await reader.readuntil(b"\r\n\r\n")
            length = int(next(line.split(b":")[1] for line in head.split(b"\r\n")
                              if line.lower().startswith(b"content-length")))
            seen.append(await reader.readexactly(length))
            if stall:
                await asyncio.sleep(10)
            answer = answers.pop(0)
            for i in range(0, len(answer), piece):
                writer.write(answer[i:i + piece])
                await writer.drain()
                await asyncio.sleep(0)
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    return server, server.sockets[0].getsockname()[1]


def run(answers: list[bytes], piece: int = 1 << 16, stall: bool = False,
        timeout: float = 5.0) -> tuple[list[tuple[int, list[bytes], str]], list[bytes]]:
    async def main():
        seen: list[bytes] = []
        server, port = await serve(answers, piece, seen, stall)
        conn = SSEConnection("127.0.0.1", port, timeout)
        results = []
        try:
            for i in range(len(answers)):
                lines: list[bytes] = []
                response = await conn.post_stream("/v1/completions", {"i": i},
                                                  lambda line, now, out=lines: out.append(line))
                results.append((response.status, lines, response.text))
        finally:
            await conn.close()
            server.close()
        return results, seen
    return asyncio.run(main())


OK_HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"


@pytest.mark.parametrize("piece", [1, 7, 1 << 16])
def test_chunked_stream_cut_anywhere_gives_every_line(piece):
    answers = [OK_HEAD + b"transfer-encoding: chunked\r\n\r\n" + chunked(SSE, 5)] * 2
    results, seen = run(answers, piece)
    assert [json.loads(b) for b in seen] == [{"i": 0}, {"i": 1}]  # one connection, reused
    for status, lines, _ in results:
        assert status == 200
        assert [line for line in lines if line] == EVENTS


def test_content_length_and_close_delimited_bodies():
    error = b'{"error":{"message":"bad","param":"max_tokens"}}'
    answers = [b"HTTP/1.1 400 Bad Request\r\ncontent-length: %d\r\n\r\n" % len(error) + error,
               OK_HEAD + b"content-length: %d\r\n\r\n" % len(SSE) + SSE,
               OK_HEAD + b"connection: close\r\n\r\n" + SSE]
    results, seen = run(answers, 3)
    assert len(seen) == 3
    assert results[0][0] == 400 and results[0][1] == [] and "max_tokens" in results[0][2]
    for status, lines, _ in results[1:]:
        assert status == 200 and [x for x in lines if x] == EVENTS


def test_a_bad_chunk_size_is_an_error():
    with pytest.raises(HTTPStreamError, match="bad chunk size"):
        run([OK_HEAD + b"transfer-encoding: chunked\r\n\r\nzz\r\nabc\r\n0\r\n\r\n"])


def test_records_from_the_lean_client_count_tokens():
    record = vs.Record(0.0)
    for i, line in enumerate(SSE.split(b"\n")):
        chunk = vs.parse_event(line.decode())
        if chunk is not None:
            vs.add_chunk(record, chunk, float(i))
    assert record.num_chunks == 2 and record.num_tokens == 2


def test_a_stalled_server_times_out():
    with pytest.raises(HTTPStreamError, match="no data"):
        run([OK_HEAD + b"content-length: 0\r\n\r\n"], stall=True, timeout=0.2)


def test_a_refused_connection_is_an_error():
    async def main():
        server = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        server.close()
        await server.wait_closed()
        await SSEConnection("127.0.0.1", port, 1.0).post_stream("/", {}, lambda *a: None)
    with pytest.raises(HTTPStreamError, match="cannot connect"):
        asyncio.run(main())
