"""The state hand-off between two engines in one process (disagg/handoff.py, disagg/state.py):
a prefill engine computes prompt[:-1] and exports; a decode engine reserves, installs and
decodes; greedy tokens equal a colocated engine's (invariant 5) for prompts ending at every
offset class, and every page comes back on both sides."""
from __future__ import annotations

import pytest

from dsv4.disagg.handoff import Exporter, Importer
from dsv4.disagg.state import StateMismatch, header_from_json, header_to_json
from dsv4.sampling_params import SamplingParams

CONFIG = dict(max_num_batched_tokens=128, max_num_seqs=4, num_pages=12)
# L = prompt - 1: inside a C4 group, on a C4 boundary, inside a C128 group, shorter than the
# window, exactly one and two pages, one past a page, 3 mod 4 past a page
LENGTHS = [2, 4, 7, 131, 257, 258, 513, 388]


def run(engine, rid: str, ids: list[int], max_tokens: int) -> list[int]:
    engine.add_request(rid, ids, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))
    return drain(engine)[rid]


def drain(engine) -> dict[str, list[int]]:
    out = {}
    while engine.has_unfinished():
        for o in engine.step():
            out[o.request_id] = o.token_ids
    return out


def idle(engine) -> tuple[int, int, int]:
    c = engine.cache
    return c.pages.num_free + c.pages.num_reclaimable, c.swa.num_free, len(c.free_slots)


@pytest.fixture(scope="module")
def engines(tiny):
    return tiny.engine(**CONFIG), tiny.engine(**CONFIG), tiny.engine(**CONFIG)


def exporter_of(prefill) -> Exporter:
    return prefill.scheduler.on_finish.__self__ if prefill.scheduler.on_finish else Exporter(prefill)


def hand_off(prefill, decode, rid, ids, max_tokens):
    """Decode reserves (maybe hitting its own prefix cache), prefill computes and exports the
    pages after the hit, decode installs and runs."""
    importer = Importer(decode)
    req = importer.begin(rid, ids, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))
    first = importer.reserve(req)
    assert first is not None
    exporter = exporter_of(prefill)
    exporter.wanted[rid] = first
    run(prefill, rid, ids[:-1], 1)
    header, data = exporter.ready.pop(rid)
    header = header_from_json(header_to_json(header))
    importer.finish(req, header, data)
    return drain(decode)[rid], header


@pytest.mark.parametrize("length", LENGTHS)
def test_greedy_equals_colocated(engines, tiny, length):
    prefill, decode, plain = engines
    ids = tiny.ids(length, seed=length)
    before = idle(prefill), idle(decode)
    got, header = hand_off(prefill, decode, f"r{length}", ids, 6)
    assert got == run(plain, f"p{length}", ids, 6)
    assert header.num_pages == -(-(length - 1) // 256) and header.length == length - 1
    assert (idle(prefill), idle(decode)) == before


def test_prefill_prefix_hit_gives_the_same_state(engines, tiny):
    prefill, decode, plain = engines
    ids = tiny.ids(600, seed=5)
    first, _ = hand_off(prefill, decode, "h1", ids, 4)
    hits = prefill.scheduler.prefix_hits
    second, _ = hand_off(prefill, decode, "h2", ids, 4)
    assert prefill.scheduler.prefix_hits > hits            # only the missing pages were computed
    assert first == second == run(plain, "hp", ids, 4)


def test_mismatched_signature_is_refused_and_released(engines, tiny):
    prefill, decode, _ = engines
    before = idle(decode)
    exporter = exporter_of(prefill)
    exporter.wanted["m"] = 0
    ids = tiny.ids(40, seed=9)
    run(prefill, "m", ids[:-1], 1)
    header, data = exporter.ready.pop("m")
    bad = header_from_json({**header_to_json(header), "signature": "0" * 64})
    importer = Importer(decode)
    req = importer.begin("m", ids, SamplingParams(max_tokens=2, temperature=0))
    assert importer.reserve(req) == 0
    with pytest.raises(StateMismatch, match="another model config"):
        importer.finish(req, bad, data)
    importer.drop("m")
    assert idle(decode) == before and not decode.has_unfinished()


def test_decode_prefix_hit_fetches_only_the_rest(engines, tiny):
    prefill, decode, plain = engines
    first_prompt = tiny.ids(512, seed=21)             # its decode step checkpoints page boundary 512
    hand_off(prefill, decode, "d1", first_prompt, 2)
    longer = first_prompt + tiny.ids(10, seed=22)
    hits = decode.scheduler.prefix_hits
    got, header = hand_off(prefill, decode, "d2", longer, 5)
    assert header.first_page == 2 and header.num_pages == 3
    assert decode.scheduler.prefix_hits - hits == 512
    assert got == run(plain, "dp", longer, 5)
