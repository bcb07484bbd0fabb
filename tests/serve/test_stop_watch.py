"""Stop strings in the API process (text/stop_watch.py, serve/client.py): the cut, the stop
reason and the final text are those of a brute-force search over the full decode after every
token, for stop strings spanning token boundaries and multi-byte characters; the
client delivers the cut output as the request's last and aborts the request in the engine."""
import asyncio
import random

import pytest

from dsv4.engine import ipc
from dsv4.sampling_params import SamplingParams
from dsv4.serve.client import EngineClient, RequestGroup
from dsv4.text.stop import StopChecker
from dsv4.text.stop_watch import StopStringWatch
from dsv4.text.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def tok():
    from dsv4.assets import demo_model_dir
    return Tokenizer.from_dir(demo_model_dir())


def whole_chars(tok, ids, params) -> str:
    text = tok.decode(ids, skip_special_tokens=params.skip_special_tokens)
    return text.rstrip("\ufffd")       # an incomplete character at the end is not text yet


def brute_force(tok, ids, params):
    """The first token after min_tokens whose new characters complete a stop string (the
    earliest occurrence; ties: first in params.stop): (tokens kept, stop, final text)."""
    prev = ""
    for n in range(1, len(ids) + 1):
        cur = whole_chars(tok, ids[:n], params)
        if n > params.min_tokens and len(cur) > len(prev):
            found = [(cur.find(s, max(0, len(prev) - len(s) + 1)), i, s) for i, s in enumerate(params.stop)]
            found = [f for f in found if f[0] != -1]
            if found:
                start, _, stop = min(found)
                end = start + len(stop) if params.include_stop_str_in_output else start
                return n, stop, cur[:end]
        prev = cur
    return None


def watch_rule(tok, prompt, ids, params, chunks):
    watch, kept = StopStringWatch(tok, prompt, params), 0
    for part in chunks:
        hit = watch.push(part)
        if hit is not None:
            return kept + hit[0], hit[1], hit[2]
        kept += len(part)
    return None


def _chunks(ids, rng):
    out, i = [], 0
    while i < len(ids):
        n = rng.randint(1, 4)
        out.append(ids[i:i + n])
        i += n
    return out


def test_watch_cuts_at_the_first_token_completing_a_stop_string(tok):
    rng = random.Random(0)
    text = "The quick brown fox jumps over the lazy dog; naïve café — 東京 🙂 done. " * 3
    ids = tok.encode(text)
    full = tok.decode(ids)
    hits = 0
    for case in range(120):
        start = rng.randrange(1, len(full) - 6)
        stop = full[start:start + rng.randint(1, 5)]
        params = SamplingParams(stop=[stop, "zzqq"], include_stop_str_in_output=case % 3 == 0,
                                min_tokens=rng.choice([0, 0, 5]), max_tokens=len(ids))
        expected = brute_force(tok, ids, params)
        got = watch_rule(tok, [5, 6], ids, params, _chunks(ids, rng))
        assert got == expected, (stop, params)
        hits += expected is not None
    assert hits > 100


def test_no_stop_string_no_cut(tok):
    ids = tok.encode("hello world, hello again")
    params = SamplingParams(stop=["never"], max_tokens=50)
    assert watch_rule(tok, [], ids, params, [ids]) is None


def test_client_delivers_the_cut_and_aborts_the_engine_request(tok):
    async def scenario():
        client = EngineClient.__new__(EngineClient)
        client.groups, client.watches, client.tokenizer = {}, {}, tok
        client._outbox, client._dead, client.on_stats, client.stats = asyncio.Queue(), False, None, None
        ids = tok.encode("one two three four five six")
        full = tok.decode(ids)
        stop = full[full.index("three") + 2:full.index("three") + 8]     # spans "three" and " four"
        params = SamplingParams(stop=[stop], max_tokens=20, logprobs=0)
        group = RequestGroup(client, ["r"])
        client.groups["r"] = group
        client.watches["r"] = StopStringWatch(tok, [1], params)
        for part in (ids[:2], ids[2:], ids):          # the engine goes on until it reads the abort
            client._dispatch(ipc.StepOutputs([ipc.TokenOutput("r", part, [[(t, -1.0)] for t in part])], [],
                                             ipc.EngineStats()))
        items = []
        while not group.queue.empty():
            items.append(group.queue.get_nowait()[1])
        assert len(items) == 2 and [o.finished for o in items] == [False, True]
        last = items[-1]
        assert (last.finish_reason, last.stop_reason, last.final_text) == ("stop", stop, full[:full.index(stop)])
        kept = items[0].token_ids + last.token_ids
        assert len(last.logprobs) == len(last.token_ids) and kept == ids[:len(kept)]
        assert tok.decode(kept).startswith(full[:full.index(stop)] + stop)
        assert not tok.decode(kept[:-1]).startswith(full[:full.index(stop)] + stop)
        _, frame = client._outbox.get_nowait()
        assert ipc.decode_input(frame) == ipc.AbortRequests(["r"])
        assert client.groups == {} and client.watches == {}
    asyncio.run(scenario())


def test_server_path_text_equals_the_offline_text(tok):
    """The engine core (no stop strings) + the client's watch give the offline engine's tokens,
    finish and text, for stop strings found at several points of a greedy continuation."""
    import torch
    from dsv4.assets import demo_model_dir
    from dsv4.config import EngineConfig
    from dsv4.engine.core import EngineCore
    from dsv4.engine.engine import LLMEngine
    torch.set_num_threads(1)
    config = EngineConfig(num_pages=8, max_model_len=512, async_scheduling="on")
    offline, served = LLMEngine(demo_model_dir(), config), LLMEngine(demo_model_dir(), config)
    served.check_stop_strings = False
    core = EngineCore(served)
    prompt = tok.encode("Once upon a time")
    free = offline.add_request("free", prompt, SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))
    while offline.has_unfinished():
        offline.step()
    full = tok.decode(free.output_token_ids)
    stops = [full[i:i + 3] for i in (2, 9, 17) if full[i:i + 3].strip()]
    assert stops

    async def scenario():
        client = EngineClient.__new__(EngineClient)
        client.groups, client.watches, client.tokenizer = {}, {}, tok
        client._outbox, client._dead, client.on_stats, client.stats = asyncio.Queue(), False, None, None
        groups = {}
        for i, stop in enumerate(stops):
            params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, stop=[stop])
            offline.add_request(f"o{i}", prompt, params)
            core.handle(ipc.AddRequest(f"s{i}", prompt, params))
            groups[i] = client.groups[f"s{i}"] = RequestGroup(client, [f"s{i}"])
            client.watches[f"s{i}"] = StopStringWatch(tok, prompt, params)
        want = {}
        while offline.has_unfinished():
            for out in offline.step():
                if out.finished:
                    want[int(out.request_id[1:])] = out
        while core.has_work:
            client._dispatch(ipc.StepOutputs(core.step(), [], ipc.EngineStats()))
            while not client._outbox.empty():          # the client's aborts reach the engine
                core.handle(ipc.decode_input(client._outbox.get_nowait()[1]))
        for i, group in groups.items():
            items = []
            while not group.queue.empty():
                items.append(group.queue.get_nowait()[1])
            tokens = [t for o in items for t in o.token_ids]
            last = items[-1]
            assert tokens == want[i].token_ids, stops[i]
            assert (last.finish_reason, last.stop_reason, last.final_text) == \
                (want[i].finish_reason, want[i].stop_reason, want[i].text) == ("stop", stops[i], last.final_text)
    asyncio.run(scenario())
    assert served.scheduler.counts() == (0, 0)
