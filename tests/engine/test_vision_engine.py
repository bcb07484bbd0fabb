"""Vision requests in the engine (docs/vision.md, "Engine"), on the random tiny-vision model:
invariant 5 (whole vs chunked prefill, the same greedy tokens) with chunk boundaries just
before, inside and just after image blocks; chunks never end inside a block; prefix hits with
the same image (resumed, same tokens) and a different one (no page shared past its start);
resume points pulled back before a block a match would cut; the encoder cache; images sent
to a text-only checkpoint."""
from __future__ import annotations

import pytest
import torch

from dsv4.config import EngineConfig
from dsv4.engine.engine import LLMEngine
from dsv4.model.random_init import preset_config, random_state, save_checkpoint
from dsv4.model.vision.grid import block_length
from dsv4.model.vision.preprocess import grid_of, image_hash, open_image
from dsv4.model.vision.spans import ImageSpan, atomic_chunk, resume_limit
from dsv4.model.weights import load_model
from dsv4.sampling_params import SamplingParams

import sys
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "model"))
from vision_images import png  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")
CFG = preset_config("tiny-vision", hc_sinkhorn_iters=3)     # 3 Sinkhorn iterations: as tests/engine/conftest.py
IMAGE_TOKEN = CFG.vision.image_token_id


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("tiny-vision"))
    save_checkpoint(CFG, random_state(CFG, seed=3), path)
    return path, load_model(path, "cpu", torch.float32)


def prompt_with_images(layout: list) -> tuple[list[int], tuple[ImageSpan, ...]]:
    """layout: ints (that many text tokens) and image bytes, in order."""
    ids, spans, k = [], [], 0
    for item in layout:
        if isinstance(item, int):
            ids += [(7 * (k + i)) % 400 + 20 for i in range(item)]
            k += item
            continue
        g = grid_of(open_image(item), CFG.vision)
        n = block_length(g.n_llm_h, g.n_llm_w, len(ids))
        spans.append(ImageSpan(len(ids), n, image_hash(item), item, g.n_llm_h, g.n_llm_w))
        ids += [IMAGE_TOKEN] * n
    return ids, tuple(spans)


def run(ckpt, requests, max_tokens=6, engine=None, **config) -> dict:
    """requests: {id: (ids, spans)} added at once -> {id: (output tokens, cached tokens)}, with
    every chunk the runner computed under "chunks" ({id: [(start, n), ...]}) and the engine."""
    path, model = ckpt
    config = {"device": "cpu", "dtype": "float32", "max_num_batched_tokens": 2048, "num_pages": 12,
              "max_num_seqs": 4, "max_model_len": 1024, **config}
    eng = engine or LLMEngine(path, EngineConfig(**config), model=model)
    chunks, execute = {}, eng.runner.execute

    def recording(scheduled, *a, **kw):
        for c in scheduled:
            chunks.setdefault(c.request.request_id, []).append((c.request.num_computed, c.num_tokens))
        return execute(scheduled, *a, **kw)

    eng.runner.execute = recording
    for rid, (ids, spans) in requests.items():
        eng.add_request(rid, ids, SamplingParams(max_tokens=max_tokens, temperature=0), images=spans)
    out = {}
    for _ in range(1000):
        if not eng.has_unfinished():
            break
        for o in eng.step():
            if o.finished:
                out[o.request_id] = (list(o.token_ids), o.num_cached_tokens)
    eng.runner.execute = execute
    out["chunks"], out["engine"] = chunks, eng
    return out


def cuts_an_image(chunks, spans) -> bool:
    return any(s.start < start + n < s.end for start, n in chunks for s in spans)


A, B = png(40, 30, seed=1), png(40, 30, seed=2)     # same grid, different pixels
C = png(20, 70, seed=3)


def test_spans_rules():
    s = [ImageSpan(10, 20, "0" * 64, b"", 1, 1), ImageSpan(40, 8, "1" * 64, b"", 1, 1)]
    assert [atomic_chunk(s, 0, n) for n in (5, 10, 11, 29, 30, 31, 45)] == [5, 10, 10, 10, 30, 31, 40]
    assert atomic_chunk(s, 10, 5) == 20 and atomic_chunk(s, 30, 12) == 10 and atomic_chunk(s, 40, 3) == 8
    assert [resume_limit(s, L) for L in (0, 10, 11, 29, 30, 44, 48)] == [0, 10, 10, 10, 30, 40, 48]


@pytest.mark.parametrize("layout", [
    [5, A, 10],                 # one image early
    [3, A, 7, C, 12],           # two images of different grids
    [A, 9],                     # an image first
    [30, B, 2, A, 4],           # two images close together
])
def test_whole_vs_chunked_prefill_same_greedy_tokens(ckpt, layout):
    """Invariant 5 with images: one whole prefill and chunked prefills whose budgets put a
    boundary just before, inside and just after each image give the same greedy tokens, and no
    chunk ends inside a block (a chunk that would is pulled back or runs the block whole)."""
    ids, spans = prompt_with_images(layout)
    whole = run(ckpt, {"r": (ids, spans)})
    assert whole["chunks"]["r"][0] == (0, len(ids))
    budgets = {1, 2, 3}
    for s in spans:
        budgets |= {max(s.start, 1), s.start + 1, s.start + s.length // 2, s.end, s.end + 1}
    for budget in sorted(budgets):
        chunked = run(ckpt, {"r": (ids, spans)}, max_num_batched_tokens=budget)
        assert chunked["r"][0] == whole["r"][0], budget
        assert not cuts_an_image(chunked["chunks"]["r"], spans), (budget, chunked["chunks"]["r"])


def test_the_image_matters(ckpt):
    """Different pixels (same grid, same tokens) give different tokens; the same image twice in
    one batch gives the same, and it is encoded once."""
    (ids, sa), (_, sb) = prompt_with_images([5, A, 10]), prompt_with_images([5, B, 10])
    out = run(ckpt, {"a": (ids, sa), "b": (ids, sb), "a2": (ids, sa)}, max_tokens=8)
    assert out["a"][0] == out["a2"][0] != out["b"][0]
    assert out["engine"].runner.vision.encoded == 2


def test_a_resent_image_is_not_encoded_again(ckpt):
    ids, spans = prompt_with_images([5, A, 10])
    first = run(ckpt, {"x": (ids, spans)}, enable_prefix_caching=False)
    eng = first["engine"]
    again = run(ckpt, {"y": (ids, spans)}, engine=eng)
    assert eng.runner.vision.encoded == 1 and again["y"][0] == first["x"][0]


def long_prompt(image: bytes, at: int, total: int) -> tuple[list[int], tuple[ImageSpan, ...]]:
    ids, spans = prompt_with_images([at, image])
    return prompt_with_images([at, image, total - len(ids)])


def test_prefix_hit_with_the_same_image_and_none_with_another(ckpt):
    """Image at 20, prompt of 600: a resend resumes at 512 with the cold tokens; the same text
    with another image shares no page (page 0 holds the image, and pages are keyed by it) and
    gives the tokens of its own cold run."""
    ids, sa = long_prompt(A, 20, 600)
    _, sb = long_prompt(B, 20, 600)
    cold_a = run(ckpt, {"a": (ids, sa)}, enable_prefix_caching=False)["a"][0]
    cold_b = run(ckpt, {"b": (ids, sb)}, enable_prefix_caching=False)["b"][0]
    # (the image is outside the window of the last tokens here; test_the_image_matters shows
    # images change tokens)
    first = run(ckpt, {"a": (ids, sa)}, max_num_batched_tokens=256)
    eng = first["engine"]
    hit = run(ckpt, {"a2": (ids, sa)}, engine=eng)
    assert hit["a2"] == (cold_a, 512) and first["a"][0] == cold_a
    other = run(ckpt, {"b": (ids, sb)}, engine=eng)
    assert other["b"] == (cold_b, 0)


def test_resume_point_pulled_back_before_an_image_a_match_would_cut(ckpt):
    """An image block across the page boundary 256 (it starts at 250): the checkpoint at 256 is
    inside it, so a resend resumes from an earlier boundary (none: 0) or after it (512), never
    at 256; its tokens are the cold ones."""
    ids, spans = long_prompt(A, 250, 500)
    assert spans[0].start < 256 < spans[0].end
    cold = run(ckpt, {"c": (ids, spans)}, enable_prefix_caching=False)["c"][0]
    first = run(ckpt, {"a": (ids, spans)}, max_num_batched_tokens=256)
    eng = first["engine"]
    assert 256 in {n.end for n in eng.cache.prefix._lru if n.checkpoint is not None}
    hit = run(ckpt, {"a2": (ids, spans)}, engine=eng)
    assert hit["a2"] == (cold, 0) and hit["chunks"]["a2"][0][0] == 0


def test_bad_image_requests_fail_alone(ckpt, tmp_path):
    """A corrupt image, a block of the wrong length, blocks past the prompt and images for a
    text-only checkpoint: ValueError naming the problem; a good request beside them runs."""
    path, _ = ckpt
    eng = LLMEngine(path, EngineConfig(device="cpu", dtype="float32", num_pages=12, max_model_len=1024), model=ckpt[1])
    ids, spans = prompt_with_images([5, A, 10])
    s = spans[0]
    bad = {
        "cannot be decoded": ImageSpan(s.start, s.length, image_hash(A[:80]), A[:80], s.n_llm_h, s.n_llm_w),
        "tokens, its grid": ImageSpan(s.start, s.length - 1, s.hash, s.data, s.n_llm_h, s.n_llm_w),
        "leaves the prompt": ImageSpan(len(ids) - 3, s.length, s.hash, s.data, s.n_llm_h, s.n_llm_w),
        "hash does not match": ImageSpan(s.start, s.length, "0" * 64, s.data, s.n_llm_h, s.n_llm_w),
    }
    for words, span in bad.items():
        with pytest.raises(ValueError, match=words):
            eng.add_request(words, ids, SamplingParams(max_tokens=2), images=(span,))
    good = run(ckpt, {"ok": (ids, spans)}, engine=eng)
    assert len(good["ok"][0]) == 6
    text_cfg = preset_config("tiny")
    save_checkpoint(text_cfg, random_state(text_cfg), str(tmp_path))
    text = LLMEngine(str(tmp_path), EngineConfig(device="cpu", dtype="float32", num_pages=4, max_model_len=1024))
    with pytest.raises(ValueError, match="no vision tower"):
        text.add_request("t", [min(i, 500) for i in ids], SamplingParams(max_tokens=2), images=spans)


def test_image_rows_see_their_whole_block_in_the_window(ckpt):
    """The step's sliding-window ranges: a row of a block [s, e) at p reads [min(p - W + 1, s), e),
    every other row (p - W, p]."""
    from dsv4.cache.addressing import SeqChunk, build_step
    eng = run(ckpt, {})["engine"]
    W = CFG.sliding_window
    ids, spans = prompt_with_images([45, C, 10])
    s = spans[0]
    chunk = SeqChunk(slot=0, start=0, token_ids=ids, page_table=[0, 1, 2], swa_table=list(range(6)),
                     images=((s.start, s.end),))
    fb = build_step([chunk], eng.layout, eng.runner.storage.ring_slots)
    lo, hi = fb.swa.lo.tolist(), fb.swa.hi.tolist()
    for p in range(len(ids)):
        if s.start <= p < s.end:
            assert (lo[p], hi[p]) == (max(min(p - W + 1, s.start), 0), s.end), p
        else:
            assert (lo[p], hi[p]) == (max(p - W + 1, 0), p + 1), p
    widest = max(h - l for l, h in zip(lo, hi))
    assert widest > W and fb.swa.width == -(-widest // 64) * 64


def test_the_first_row_of_a_block_sees_the_image(ckpt):
    """The block's first row is a sentinel (the same for every image): only bidirectional
    visibility lets its output depend on the image. Prompt logprobs (row j - 1 scores token j)
    are equal before the block for two images and differ from its first row on."""
    path, model = ckpt
    eng = LLMEngine(path, EngineConfig(device="cpu", dtype="float32", num_pages=12, max_model_len=1024,
                                       enable_prefix_caching=False), model=model)
    (ids, sa), (_, sb) = prompt_with_images([9, A, 5]), prompt_with_images([9, B, 5])
    out = {}
    for rid, spans in (("a", sa), ("b", sb)):
        eng.add_request(rid, ids, SamplingParams(max_tokens=1, prompt_logprobs=1), images=spans)
    while eng.has_unfinished():
        for o in eng.step():
            if o.finished:
                out[o.request_id] = o.prompt_logprobs
    s = sa[0].start
    assert all(out["a"][j] == out["b"][j] for j in range(1, s + 1))
    assert out["a"][s + 1] != out["b"][s + 1]


def test_a_block_over_the_budget_beside_other_requests(ckpt):
    """Budget 10 tokens: a running request whose next chunk is a whole block (over the budget)
    ahead of a running text prefill, and a request starting with a block: the blocks run whole
    (the step exceeds the budget), the others wait for room, and every request gets the greedy
    tokens it gets alone."""
    img, text = prompt_with_images([A, 6]), prompt_with_images([23])
    late = prompt_with_images([2, C, 3])
    alone = {rid: run(ckpt, {rid: p})[rid][0] for rid, p in (("img", img), ("text", text), ("late", late))}
    both = run(ckpt, {"late": late, "text": text, "img": img}, max_num_batched_tokens=10)
    assert {rid: both[rid][0] for rid in alone} == alone
    assert all(n > 0 for chunks in both["chunks"].values() for _, n in chunks)
