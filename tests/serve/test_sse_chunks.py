"""Streaming plumbing of the API process: events made from a template equal `sse` of the whole
event, byte for byte, and a stream takes every output already waiting in one batch (a failure
after some outputs still delivers them first)."""
import asyncio

import pytest

from dsv4.engine.ipc import RequestFailed, TokenOutput
from dsv4.serve.client import RequestGroup
from dsv4.serve.http.completions import PLAIN_CHOICE
from dsv4.serve.http.metrics import ServerMetrics
from dsv4.serve.http.streaming import ChunkFormat, RequestError, output_batches, outputs, sse

TEXTS = ["", "plain", 'quote " and \\ backslash', "tab\tnew\nline\r\x00\x1f\x7f", "é中文😀", "\ud800x",
         "</script>", '"choices":null', "\u2028\u2029"]
HEADS = [{"id": "cmpl-1", "object": "text_completion", "created": 17, "model": "m"},
         {"id": 'x"choices":null', "object": "o", "created": 0, "model": "模型\"choices\":null"}]


@pytest.mark.parametrize("head", HEADS)
@pytest.mark.parametrize("extra", [{}, {"usage": None}])
def test_template_events_equal_the_encoded_event(head, extra):
    chunks = ChunkFormat(head, extra, PLAIN_CHOICE)
    for index, text in enumerate(TEXTS):
        plain = {"index": index, "text": text, "logprobs": None, "finish_reason": None, "stop_reason": None}
        others = [{**plain, "finish_reason": "length"},
                  {**plain, "finish_reason": "stop", "stop_reason": "</s>"},
                  {**plain, "logprobs": {"tokens": [text], "token_logprobs": [-0.5]}},
                  {**plain, "prompt_logprobs": [None]},
                  {"index": index, "delta": {"content": text}, "logprobs": None, "finish_reason": None}]
        for choice in [plain, *others]:
            assert chunks.event(choice) == sse({**head, "choices": [choice], **extra})


def output(rid: str, tokens: list[int], finished: bool = False) -> TokenOutput:
    return TokenOutput(rid, tokens, finished=finished, finish_reason="length" if finished else None)


class _Client:
    def abort(self, request_ids):
        pass


def _run(group, items, consume):
    async def go():
        for rid, item in items:
            group.put(rid, item)
        tracker = ServerMetrics("m", 4).track(len(group.request_ids), 3)
        got = []
        try:
            async for x in consume(group, tracker):
                got.append(x)
        except RequestError as e:
            got.append(e.status)
        return got
    return asyncio.run(go())


def test_a_batch_holds_every_waiting_output_and_ends_at_the_last():
    items = [("a", output("a", [1])), ("b", output("b", [2])), ("a", output("a", [3], finished=True)),
             ("b", output("b", [4], finished=True))]
    batches = _run(RequestGroup(_Client(), ["a", "b"]), items, output_batches)
    assert [[(i, o.token_ids) for i, o in batch] for batch in batches] == [[(0, [1]), (1, [2]), (0, [3]), (1, [4])]]
    single = _run(RequestGroup(_Client(), ["a", "b"]), items, outputs)
    assert [(i, o.token_ids) for i, o in single] == [(0, [1]), (1, [2]), (0, [3]), (1, [4])]


def test_a_failure_after_outputs_comes_after_them():
    items = [("a", output("a", [1])), ("b", output("b", [2])), ("b", RequestFailed("b", 500, "boom")),
             ("a", output("a", [3], finished=True))]
    got = _run(RequestGroup(_Client(), ["a", "b"]), items, output_batches)
    assert [[o.token_ids for _, o in batch] for batch in got[:-1]] == [[[1], [2]]]
    assert got[-1] == 500
