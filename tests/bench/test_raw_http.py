"""The benchmark's raw HTTP/1.1 client against scripted loopback servers: the three body
framings, lines split across chunks, connection reuse (and replacing one the server closed),
failures as RawHTTPError (an OSError, so a request fails alone)."""
import asyncio

import pytest

from dsv4.bench.raw_http import RawClient, RawHTTPError


def serve(answers: list[bytes], keep_open: bool = True):
    """An asyncio server answering each request it reads, in order, with the next of `answers`
    (b"" closes the connection without answering); returns (url, connections seen)."""
    seen = []

    async def handle(reader, writer):
        seen.append(writer)
        while answers:
            head = await reader.readuntil(b"\r\n\r\n")
            length = int(next(line.split(b":")[1] for line in head.split(b"\r\n")
                              if line.lower().startswith(b"content-length")))
            await reader.readexactly(length)
            answer = answers.pop(0)
            if not answer:
                break
            writer.write(answer)
            await writer.drain()
            if not keep_open:
                break
        writer.close()

    async def start():
        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        return server, f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}/v1/x?q=1"
    return start, seen


def run(coro):
    return asyncio.run(coro)


def chunked(*pieces: bytes) -> bytes:
    body = b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in pieces)
    return b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + body + b"0\r\nX-Trailer: 1\r\n\r\n"


def test_chunked_lines_split_across_chunks_and_reuse():
    start, seen = serve([chunked(b"data: a\r", b"\n\ndata: b", b"c\n\n"), chunked(b"one\ntwo")])

    async def go():
        server, url = await start()
        async with server, RawClient(timeout=5) as client:
            async with client.stream("POST", url, b"{}", {"X-A": "1"}) as r:
                first = (r.status_code, [line async for line in r.aiter_lines()])
            async with client.stream("POST", url, b"[1]") as r:
                second = [line async for line in r.aiter_lines()]
        return first, second
    first, second = run(go())
    assert first == (200, ["data: a", "", "data: bc", ""])
    assert second == ["one", "two"]
    assert len(seen) == 1                      # the second request reused the connection


def test_content_length_and_end_of_connection_bodies():
    error = b'HTTP/1.1 400 Bad Request\r\nContent-Length: 11\r\n\r\n{"e": "no"}'
    start, _ = serve([error, b"HTTP/1.0 200 OK\r\n\r\nline 1\nline 2"])

    async def go():
        server, url = await start()
        async with server, RawClient(timeout=5) as client:
            async with client.stream("POST", url, b"") as r:
                bad = (r.status_code, await r.aread())
            async with client.stream("POST", url, b"") as r:
                lines = [line async for line in r.aiter_lines()]
        return bad, lines
    assert run(go()) == ((400, b'{"e": "no"}'), ["line 1", "line 2"])


def test_a_kept_connection_the_server_closed_is_replaced():
    start, seen = serve([chunked(b"x"), b"", chunked(b"y")])

    async def go():
        server, url = await start()
        async with server, RawClient(timeout=5) as client:
            texts = []
            for _ in range(2):
                async with client.stream("POST", url, b"") as r:
                    texts.append(await r.aread())
        return texts
    assert run(go()) == [b"x", b"y"]
    assert len(seen) == 2


@pytest.mark.parametrize("answer, error", [
    (b"HTTP/1.1 200 OK\r\nContent-Length: 50\r\n\r\nshort", "ended early"),
    (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n", "malformed"),
    (b"garbage\r\n\r\n", "malformed status line"),
])
def test_broken_answers_fail_as_os_errors(answer, error):
    start, _ = serve([answer], keep_open=False)

    async def go():
        server, url = await start()
        async with server, RawClient(timeout=5) as client:
            async with client.stream("POST", url, b"") as r:
                await r.aread()
    with pytest.raises(RawHTTPError, match=error) as caught:
        run(go())
    assert isinstance(caught.value, OSError)


def test_no_progress_fails_after_the_timeout_and_https_is_refused():
    async def silent(reader, writer):
        await reader.read()                    # never answers

    async def go():
        server = await asyncio.start_server(silent, "127.0.0.1", 0)
        url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}/"
        async with server, RawClient(timeout=0.05) as client:
            async with client.stream("POST", url, b""):
                pass
    with pytest.raises(RawHTTPError, match="no progress for 0.05 s"):
        run(go())
    with pytest.raises(RawHTTPError, match="only http://"):
        RawClient(timeout=1).stream("POST", "https://example.com/", b"")
