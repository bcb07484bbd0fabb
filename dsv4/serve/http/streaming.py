"""Plumbing shared by the generating endpoints: the engine outputs of one HTTP request as an
async iterator (failures raised as `RequestError`), server-sent events, and cancelling a
handler when its client disconnects (which aborts its engine requests)."""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from json.encoder import encode_basestring     # JSON string literal, non-ASCII kept (as _dumps writes it)
from collections.abc import AsyncIterator, Awaitable, Callable

from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from ..client import EngineDead, RequestGroup
from .errors import APIError, error_body
from ...engine.ipc import RequestFailed, TokenOutput
from .metrics import RequestTracker
from .render import json_response

log = logging.getLogger("dsv4.serve")
DONE = "data: [DONE]\n\n"
CLIENT_CLOSED = 499   # nginx's code for "client closed request"; the client never sees it


class RequestError(APIError):
    """The engine failed (or rejected) a request of the group."""


async def first_output(group: RequestGroup, tracker: RequestTracker) -> None:
    """Wait for the group's first engine item and keep it for `outputs`, so that a stream
    can still answer with a plain HTTP error when the engine rejects the request."""
    try:
        group.peeked = await group.queue.get()
        _check(group.peeked[1])
    except RequestError:
        _end(group, tracker, "error")
        raise
    except BaseException:
        _end(group, tracker, "abort")
        raise


async def outputs(group: RequestGroup, tracker: RequestTracker) -> AsyncIterator[tuple[int, TokenOutput]]:
    """(choice index, output) until every request of the group finished. The caller ends
    the group (`guarded`) whatever happens."""
    async for batch in output_batches(group, tracker):
        for pair in batch:
            yield pair


async def output_batches(group: RequestGroup, tracker: RequestTracker) -> AsyncIterator[list[tuple[int, TokenOutput]]]:
    """The (choice index, output) pairs of `outputs`, all those already waiting at once (at
    least one): a stream that fell behind the engine catches up with one write, not one per
    engine step. A failure ends the batch before it and is raised on the next round."""
    remaining, queue = len(group.request_ids), group.queue
    while remaining:
        if group.peeked is not None:
            pair, group.peeked = group.peeked, None
        else:
            pair = await queue.get()
        batch = []
        while True:
            if batch and not isinstance(pair[1], TokenOutput):
                group.peeked = pair           # the outputs before it go out first
                break
            _check(pair[1])
            tracker.observe(*pair)
            remaining -= pair[1].finished
            batch.append(pair)
            if not remaining or queue.empty():
                break
            pair = queue.get_nowait()
        yield batch


@contextlib.contextmanager
def guarded(group: RequestGroup, tracker: RequestTracker):
    """On leaving: abort what still runs in the engine and count it ("error" when the
    engine failed it, "abort" when the client went away or the handler was cancelled)."""
    try:
        yield
    except RequestError:
        _end(group, tracker, "error")
        raise
    finally:
        _end(group, tracker, "abort")


async def respond_whole(group: RequestGroup, tracker: RequestTracker, head: dict, choices: list, usage,
                        extra: dict | Callable[[], dict] | None = None):
    """Non-streaming answer: feed every output to its choice, then one JSON body (with
    `extra`'s fields; a callable is asked once every output is in), rendered off the event loop
    when large (render.py)."""
    with guarded(group, tracker):
        async for index, out in outputs(group, tracker):
            choices[index].update(out)
    extra = extra() if callable(extra) else extra
    body = {**head, **(extra or {}), "choices": [c.whole() for c in choices], "usage": usage.to_dict()}
    return await json_response(body, headers={"X-Request-Id": head["id"]})


def _end(group: RequestGroup, tracker: RequestTracker, reason: str) -> None:
    group.abort()
    tracker.close(reason)


def _check(item) -> None:
    if isinstance(item, RequestFailed):
        raise RequestError(item.status, item.message)
    if isinstance(item, EngineDead):
        raise RequestError(500, item.message)


def sse(data: dict) -> str:
    return f"data: {_dumps(data)}\n\n"


def _dumps(data) -> str:
    return json.dumps(data, ensure_ascii=False, separators=(',', ':'))


class ChunkFormat:
    """`sse({**head, "choices": [choice], **extra})` of one response, its head and extra
    encoded once: the same text, made without encoding the whole event each time. A plain
    text choice (the fields `plain` lists, in that order, with only `index` and `text` set)
    is written from a template."""

    def __init__(self, head: dict, extra: dict, plain: tuple[str, ...] = ()):
        whole = _dumps({**head, "choices": None, **extra})
        at = whole.index('"choices":null')         # a key: quotes inside values are escaped
        self.before, self.after = f'data: {whole[:at]}"choices":[', f"]{whole[at + 14:]}\n\n"
        self.plain = plain
        self.nulls = "".join(f',"{name}":null' for name in plain[2:])

    def event(self, choice: dict) -> str:
        if self.plain and tuple(choice) == self.plain and all(choice[k] is None for k in self.plain[2:]):
            text = encode_basestring(choice["text"])
            return f'{self.before}{{"index":{choice["index"]:d},"text":{text}{self.nulls}}}{self.after}'
        return f"{self.before}{_dumps(choice)}{self.after}"


def internal_error(error: Exception) -> APIError:
    """A 500 for an exception nobody expected (logged with its traceback)."""
    log.error("a response failed", exc_info=error)
    return APIError(500, f"internal error: {type(error).__name__}")


def sse_error(error: APIError) -> str:
    return sse(error_body(error.status, error.message, error.param, error.code))


async def sse_events(events: AsyncIterator[str]) -> AsyncIterator[str]:
    """One stream's events, then `[DONE]`; a RequestError (or any bug) ends it with an error
    event first, and touches nothing else."""
    try:
        async for event in events:
            yield event
    except RequestError as e:
        yield sse_error(e)
    except Exception as e:  # noqa: BLE001 - a bug ends this stream with an error event, nothing else
        yield sse_error(internal_error(e))
    yield DONE


async def until_disconnected(request: Request, work: Awaitable):
    """Await `work` unless the client disconnects first; then cancel it (its `finally`
    blocks abort the engine requests) and return a 499 response nobody will read."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnected(request))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        raise
    finally:
        watcher.cancel()
    if task in done:
        return task.result()
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    return Response(status_code=CLIENT_CLOSED)


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


class Usage:
    """OpenAI usage of one response: prompt tokens once per prompt, all choices' tokens, and the
    prompt tokens resumed from the prefix cache (per prompt, the most any of its choices got)."""

    def __init__(self, prompt_tokens: int, choices: list, group: RequestGroup | None = None,
                 prompt_of: list[int] | None = None):
        self.prompt_tokens, self.choices, self.group = prompt_tokens, choices, group
        self.prompt_of = prompt_of           # choice index -> prompt index (None: one prompt)

    def to_dict(self) -> dict:
        completion = sum(c.num_tokens for c in self.choices)
        cached: dict[int, int] = {}
        for i, n in enumerate(self.group.cached_tokens if self.group is not None else []):
            key = self.prompt_of[i] if self.prompt_of else 0
            cached[key] = max(cached.get(key, 0), n)
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": completion,
                "total_tokens": self.prompt_tokens + completion,
                "prompt_tokens_details": {"cached_tokens": sum(cached.values())}}


async def answer(request: Request, group: RequestGroup, tracker: RequestTracker, request_id: str,
                 whole: Callable[[], Awaitable[Response]],
                 stream: Callable[[], AsyncIterator[str]] | None) -> Response:
    """The response of a generating endpoint: `whole()` when not streaming, else an SSE
    stream once the engine accepted the request (an engine rejection stays an HTTP error)."""
    if stream is None:
        return await until_disconnected(request, whole())
    gone = await until_disconnected(request, first_output(group, tracker))
    if gone is not None:
        return gone
    return EngineStream(stream(), lambda: _end(group, tracker, "abort"), request_id)


class EngineStream(StreamingResponse):
    """An SSE response that ends its engine requests however it ends, even when the client
    hangs up before the body generator ever ran (so its own `finally` never does)."""

    def __init__(self, body: AsyncIterator[str], on_close: Callable[[], None], request_id: str):
        super().__init__(body, media_type="text/event-stream", headers={"X-Request-Id": request_id})
        self.on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.on_close()
