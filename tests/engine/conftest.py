"""Fixtures of the engine acceptance tests (docs/architecture.md, Engine).

* `tiny`: one random tiny V4 checkpoint per session (DeepSeek names, fp32), dsv4's model
  loaded once and shared by every engine, and the transformers oracle loaded once with its
  full-sequence logits cached per token sequence.

Indexer ties. CSA keeps the top `index_topk` compressed entries by the lightning indexer's
score, a sum over heads of ReLU(q.k) terms. Two entries can score (near) equal at the top-k
boundary, most often both exactly 0 (every head's dot product negative); which one is kept is
then up to torch.topk's tie-breaking, which changes with the candidate tensor's width, so even
transformers disagrees with itself there. The checkpoint has 16 indexer heads (the tiny
preset's 8 leaves exact-zero ties in about one 440-token sequence in three), and every
sequence compared with the oracle is checked to have no near-tie (gap < 1e-5) at any
position and CSA layer (`tiny.tie_free_ids`), so every remaining difference is a bug.
* `forcer`: drives an `LLMEngine` like `LLMEngine.step` does (real scheduler, cache manager
  and runner), but appends known continuation tokens instead of sampled ones, and keeps
  every logits row the runner produced (teacher forcing).
* `stepper`: runs hand-made steps (which requests, how many tokens each) through the cache
  manager and the runner, for the invariant tests that need exact control of chunks.
* `demo_engines`: get(**EngineConfig fields) -> a demo-model engine made once per module and
  config (64 pages, 2,048-token steps unless given), closed at the module's end.
* `drive` (also `h.drive`): runs `LLMEngine.step` over requests that arrive at given steps
  (optionally aborting one, checking the cache accounting after every step) until idle; every
  test that drives an engine over requests uses it.
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field

import pytest
import torch

from dsv4.config import EngineConfig
from dsv4.engine.engine import LLMEngine
from dsv4.engine.request import Request, Status
from dsv4.sampling_params import SamplingParams
from dsv4.engine.scheduler import ScheduledChunk

INDEX_HEADS = 16
TIE_GAP = 1e-5        # indexer score gap at the top-k boundary below which the selection is ambiguous
REL_TOL = 1e-4        # max|Δ| <= REL_TOL * max|ref| (per logits row)
MARGIN = 1e-3         # greedy tokens must agree where the reference's top-2 margin exceeds this
MAX_STEPS = 5000      # no test drives more steps than this: a stuck engine fails instead of hanging


def random_ids(vocab: int, length: int, seed: int) -> list[int]:
    return torch.randint(0, vocab, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def max_rel_row_error(ours: torch.Tensor, ref: torch.Tensor) -> tuple[float, int]:
    """max over rows of max|Δ| / max|ref| of that row, and the worst row."""
    err = (ours.float() - ref.float()).abs().amax(dim=-1) / ref.float().abs().amax(dim=-1)
    worst = int(err.argmax())
    return float(err[worst]), worst


def assert_rows_close(ours: torch.Tensor, ref: torch.Tensor, positions, what: str) -> float:
    """Every row: max|Δ| <= 1e-4 * max|ref row|. Returns the worst relative error."""
    assert ours.shape == ref.shape, (what, ours.shape, ref.shape)
    assert ours.shape[0] > 0, f"{what}: nothing to compare"
    rel, worst = max_rel_row_error(ours, ref)
    assert rel <= REL_TOL, (f"{what}: logits at position {list(positions)[worst]} differ by "
                            f"{rel:.3g} x max|ref| (> {REL_TOL})")
    return rel


def top2_margin(row: torch.Tensor) -> float:
    top = row.float().topk(2).values
    return float(top[0] - top[1])


def check_greedy_against_reference(tokens: list[int], ref_logits: torch.Tensor, prompt_len: int,
                                   first_tie: int | None = None) -> int:
    """`tokens` were generated greedily after a prompt of `prompt_len`; `ref_logits` are the
    reference's full-sequence logits of prompt + tokens. Reference greedy decoding from the same
    prefix picks argmax at each step: the tokens must equal it wherever the top-2 margin exceeds
    MARGIN. At a near-tie the engine may take the other token; both sequences are then valid and
    comparison ends there, as it does at `first_tie`, the first position with an indexer near-tie
    (from there on both selections are valid). Returns how many tokens were compared."""
    for i, tok in enumerate(tokens):
        if first_tie is not None and prompt_len - 1 + i >= first_tie:
            return i
        row = ref_logits[prompt_len - 1 + i]
        want = int(row.argmax())
        if tok == want:
            continue
        margin = top2_margin(row)
        assert margin <= MARGIN, (f"greedy token {i} is {tok}, the reference's argmax is {want} "
                                  f"with top-2 margin {margin:.3g} > {MARGIN}")
        assert float(row[want] - row[tok]) <= MARGIN, f"token {i}: {tok} is not within the margin of the top"
        return i
    return len(tokens)


def assert_cache_accounting(engine: LLMEngine) -> None:
    """Every page in use is held by live requests and the prefix cache, its refcount exactly the
    number of holders (no leak, no double use); SWA pages and slots by exactly one request."""
    from collections import Counter
    cache = engine.cache
    live = [cache.seq(r) for r in list(engine.scheduler.running) + list(engine.scheduler.waiting)]
    tree = cache.prefix.pages() if cache.prefix is not None else []
    holders = Counter(p for r in live for p in r.pages) + Counter(tree)
    assert all(len(set(r.pages)) == len(r.pages) for r in live), "a request holds a page twice"
    assert len(set(tree)) == len(tree), "the prefix cache holds a page twice"
    assert len(holders) == cache.pages.num_used
    assert all(cache.pages.refcount(p) == n for p, n in holders.items())
    assert cache.pages.num_reclaimable == sum(holders[p] == 1 for p in tree)
    swa = [p for r in live for p in r.swa_pages if p >= 0]
    slots = [r.slot for r in live if r.slot is not None]
    assert len(set(swa)) == len(swa) == cache.swa.num_used
    assert len(set(slots)) == len(slots) == cache.plan.max_num_seqs - len(cache.free_slots)
    for r in engine.scheduler.waiting:   # waiting (also after preemption) holds nothing
        assert cache.seq(r).holds_nothing, r.request_id


# ---- driving an engine over requests ----------------------------------------------------
@dataclass
class Req:
    rid: str
    prompt: list[int]
    params: SamplingParams
    arrival: int = 0                 # the step before which it is added
    images: tuple = ()               # the prompt's image spans (vision requests)


def drive(engine: LLMEngine, reqs: list[Req] = (), check: bool = False, abort_at: tuple[str, int] | None = None,
          on_step=None, max_steps: int = MAX_STEPS) -> dict:
    """Add each request before step `arrival`, abort request abort_at[0] before step abort_at[1],
    and step until nothing is left. `check`: assert the cache accounting after every step;
    `on_step(engine, step)` after every step. Returns request id -> final RequestOutput of every
    request that finished (aborted ones do not); fails if the engine is still busy after
    `max_steps` steps. Requests already added before the call are driven too."""
    done, last = {}, max((r.arrival for r in reqs), default=-1)
    for step in range(max_steps):
        for r in reqs:
            if r.arrival == step:
                engine.add_request(r.rid, list(r.prompt), r.params, r.images)
        if abort_at is not None and step == abort_at[1]:
            engine.abort(abort_at[0])
        if step > last and not engine.has_unfinished():
            return done
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
        if check:
            assert_cache_accounting(engine)
        if on_step is not None:
            on_step(engine, step)
    raise AssertionError(f"engine still busy after {max_steps} steps")


def drive_greedy(engine: LLMEngine, prompts: dict[str, list[int]], max_tokens: int, check: bool = False,
                 on_step=None, **params) -> dict:
    """`drive` with every prompt added at once, greedy (ignore_eos) for `max_tokens` tokens;
    `params`: further SamplingParams fields."""
    p = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **params)
    return drive(engine, [Req(rid, ids, p) for rid, ids in prompts.items()], check, on_step=on_step)


def greedy_outputs(engine: LLMEngine, prompts: list[list[int]], max_tokens: int, **params) -> list:
    """`drive_greedy` of prompts listed in order (request ids "0", "1", ...): their outputs, in order."""
    done = drive_greedy(engine, {str(i): p for i, p in enumerate(prompts)}, max_tokens, **params)
    return [done[str(i)] for i in range(len(prompts))]


def simulated_step(sched, rng, max_tokens: dict[str, int]) -> list[Request]:
    """One engine step without a model, for the accounting tests: schedule, stage each chunk's
    KV as the runner does, advance, append a random token (id in [2, 500)) to each request whose
    chunk completes its known tokens, and finish those that reach max_tokens[request id].
    Returns the requests finished."""
    finished = []
    for c in sched.schedule():
        req, completes = c.request, c.completes
        sched.cache.stage(req, req.num_computed, c.num_tokens)
        sched.advance(req, c.num_tokens)
        if completes:
            req.output_token_ids.append(rng.randrange(2, 500))
            if len(req.output_token_ids) >= max_tokens[req.request_id]:
                sched.finish(req)
                finished.append(req)
    return finished


def random_prompt(rng, bases: list[list[int]], max_extra: int) -> list[int]:
    """A random prefix of one of `bases` and up to `max_extra` random tokens after it."""
    base = rng.choice(bases)
    return base[:rng.randint(1, len(base))] + [rng.randrange(2, 500) for _ in range(rng.randint(0, max_extra))]


def token_ids(outputs: dict) -> dict[str, list[int]]:
    """request id -> token ids of `drive`'s outputs."""
    return {rid: out.token_ids for rid, out in outputs.items()}


def assert_same_outputs(a: dict, b: dict, rids=None) -> None:
    """Same tokens, finish and stop reasons, text, and logprobs and prompt logprobs (to fp32
    rounding: different batches may sum in another order)."""
    if rids is None:
        assert sorted(a) == sorted(b)
        rids = sorted(a)
    for rid in rids:
        x, y = a[rid], b[rid]
        assert x.token_ids == y.token_ids, (rid, x.token_ids, y.token_ids)
        assert (x.finish_reason, x.stop_reason, x.text) == (y.finish_reason, y.stop_reason, y.text), rid
        for lx, ly in [(x.logprobs, y.logprobs), (x.prompt_logprobs, y.prompt_logprobs)]:
            assert (lx is None) == (ly is None), rid
            for dx, dy in zip(lx or [], ly or []):
                assert (dx is None) == (dy is None) and (dx is None or dx.keys() == dy.keys()), rid
                assert dx is None or all(abs(dx[t] - dy[t]) < 1e-4 for t in dx), rid


@contextmanager
def indexer_gaps():
    """Record, for every indexer top-k call of the forwards inside, the score gap between the
    k-th and (k+1)-th candidate of each query row (inf where at most k are causal)."""
    import dsv4.ops.indexer as ix
    from dsv4.ops.kv_fp8 import is_packed, unpack_index_keys
    from dsv4.ops.paged import dense_index
    original, calls = ix._topk, []

    def spy(q, weights, keys, cand, topk, weight_scale):
        dense = dense_index(cand)
        k = min(topk, dense.shape[1])
        gathered = keys[dense.clamp(min=0)]
        gathered = unpack_index_keys(gathered) if is_packed(keys) else gathered.float()
        scores = torch.relu(torch.einsum("thd,ted->the", q.float(), gathered))
        scores = (scores * q.shape[-1] ** -0.5 * (weights.float() * weight_scale)[..., None]).sum(dim=1)
        scores = scores.masked_fill(dense < 0, float("-inf"))
        gap = torch.full((q.shape[0],), float("inf"))
        if scores.shape[1] > k:
            top = scores.topk(k + 1, dim=-1).values
            gap = torch.where(torch.isfinite(top[:, k]), top[:, k - 1] - top[:, k], gap)
        calls.append(gap)
        return original(q, weights, keys, cand, topk, weight_scale)

    ix._topk = spy
    try:
        yield calls
    finally:
        ix._topk = original


def tie_positions(model, ids: list[int]) -> list[int]:
    """Positions whose CSA top-k selection (any layer) has a near-tie at the boundary."""
    from dsv4.engine.oneshot import full_logits
    from dsv4.ops.indexer import QUERY_BLOCK
    assert len(ids) <= QUERY_BLOCK, "one indexer call per layer assumed"
    with indexer_gaps() as calls:
        full_logits(model, ids)
    gaps = torch.stack(calls).amin(dim=0)
    return (gaps < TIE_GAP).nonzero().flatten().tolist()


def free_counts(engine: LLMEngine) -> tuple[int, int, int]:
    """Free history pages (counting those only the prefix cache holds: it gives them back on
    demand), SWA pages and slots."""
    c = engine.cache
    return c.pages.num_free + c.pages.num_reclaimable, c.swa.num_free, len(c.free_slots)


@dataclass
class Tiny:
    path: str
    cfg: object
    model: object
    _ref_model: object = None
    _ref_cache: dict = field(default_factory=dict)

    def ids(self, length: int, seed: int) -> list[int]:
        return random_ids(self.cfg.vocab_size, length, seed)

    def tie_free_ids(self, length: int, seed: int) -> list[int]:
        """Random ids (deterministic in `seed`) with no indexer near-tie at any position."""
        for attempt in range(20):
            ids = random_ids(self.cfg.vocab_size, length, seed + 7919 * attempt)
            if not tie_positions(self.model, ids):
                return ids
        raise AssertionError(f"no tie-free sequence of {length} tokens found from seed {seed}")

    def ties(self, ids: list[int]) -> list[int]:
        return tie_positions(self.model, ids)

    def engine(self, **config) -> LLMEngine:
        return LLMEngine(self.path, EngineConfig(**config), model=self.model)

    @property
    def ref_model(self):
        if self._ref_model is None:
            from dsv4.model.reference import load_reference
            self._ref_model = load_reference(self.path)
        return self._ref_model

    def ref_logits(self, ids: list[int]) -> torch.Tensor:
        """The oracle's uncached full-sequence logits [len, vocab], computed once per sequence."""
        key = tuple(ids)
        if key not in self._ref_cache:
            with torch.no_grad():
                self._ref_cache[key] = self.ref_model(torch.tensor([ids]), use_cache=False).logits[0].float()
        return self._ref_cache[key]

    def ref_generate(self, prompt: list[int], max_new_tokens: int) -> list[int]:
        with torch.no_grad():
            out = self.ref_model.generate(torch.tensor([prompt]), max_new_tokens=max_new_tokens, do_sample=False)
        return out[0, len(prompt):].tolist()


def _make_tiny(tmp_path_factory, **overrides) -> Tiny:
    from dsv4.model.random_init import preset_config, random_state, save_checkpoint
    from dsv4.model.weights import load_model
    # 3 Sinkhorn iterations instead of the preset's 20: a runtime loop bound (the column pass and
    # two row/column rounds of dsv4/ops/mhc.py's loop still run, the oracle's too), whose 80
    # small torch ops a layer and step were a fifth of these engines' CPU time
    overrides = {"hc_sinkhorn_iters": 3, **overrides}
    cfg = preset_config("tiny", index_n_heads=INDEX_HEADS, **overrides)
    path = str(tmp_path_factory.mktemp("tiny-engine"))
    save_checkpoint(cfg, random_state(cfg, seed=1234), path, names="deepseek")
    return Tiny(path, cfg, load_model(path))


@pytest.fixture(scope="session")
def tiny(tmp_path_factory) -> Tiny:
    return _make_tiny(tmp_path_factory)


@pytest.fixture(scope="session")
def tiny_w128(tmp_path_factory) -> Tiny:
    """The same tiny model with V4's real window of 128 = one SWA page."""
    return _make_tiny(tmp_path_factory, sliding_window=128)


# ---- teacher forcing through the real scheduler ----------------------------------------
@dataclass
class Forced:
    rid: str
    prompt: list[int]
    continuation: list[int] = field(default_factory=list)
    arrival: int = 0                 # the step before which it is added
    all_logits: bool = True          # also keep the logits of every prompt position

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.continuation


@dataclass
class ForcedRun:
    logits: dict[str, dict[int, torch.Tensor]]    # rid -> position -> logits row predicting position + 1
    steps: list[list[tuple[str, int, int]]]       # per step: (rid, start, num_tokens) of each chunk

    def rows(self, rid: str) -> tuple[list[int], torch.Tensor]:
        pos = sorted(self.logits[rid])
        return pos, torch.stack([self.logits[rid][p] for p in pos])


class TeacherForcer:
    """`LLMEngine.step` with forced tokens: after a chunk that completes a request's known
    tokens, its next continuation token is appended (instead of a sampled one); after the last
    one the request finishes, as the stop checker would finish it."""

    def run(self, engine: LLMEngine, specs: list[Forced], on_step=None) -> ForcedRun:
        pending = sorted(specs, key=lambda s: s.arrival)
        by_id = {s.rid: s for s in specs}
        logits: dict[str, dict[int, torch.Tensor]] = {s.rid: {} for s in specs}
        steps: list[list[tuple[str, int, int]]] = []
        for step in range(MAX_STEPS):
            while pending and pending[0].arrival <= step:
                s = pending.pop(0)
                params = SamplingParams(temperature=0.0, max_tokens=len(s.continuation) + 1, ignore_eos=True,
                                        prompt_logprobs=0 if s.all_logits else None)
                engine.add_request(s.rid, list(s.prompt), params)
            if not pending and not engine.has_unfinished():
                return ForcedRun(logits, steps)
            chunks = engine.scheduler.schedule()
            if not chunks:
                assert pending, "engine has unfinished requests but scheduled nothing"
                steps.append([])
                continue
            out = engine.runner.execute(chunks)
            steps.append([(c.request.request_id, c.request.num_computed, c.num_tokens) for c in chunks])
            for i, c in enumerate(chunks):
                req, start, n = c.request, c.request.num_computed, c.num_tokens
                rows = out.num_rows[i]
                positions = range(start, start + n) if rows == n else range(start + n - rows, start + n)
                for k, p in enumerate(positions):
                    logits[req.request_id][p] = out.logits[out.first_row[i] + k].clone()
                completes = c.completes
                engine.scheduler.advance(req, n)
                if completes:
                    cont, k = by_id[req.request_id].continuation, len(req.output_token_ids)
                    if k < len(cont):
                        req.output_token_ids.append(cont[k])
                    else:
                        engine.scheduler.finish(req)
                        engine.requests.pop(req.request_id)
                        engine._stops.pop(req.request_id, None)
            assert_cache_accounting(engine)
            if on_step is not None:
                on_step(engine, step)
        raise AssertionError(f"not finished after {MAX_STEPS} steps")


@pytest.fixture(scope="session")
def forcer() -> TeacherForcer:
    return TeacherForcer()


# ---- hand-made steps ---------------------------------------------------------------------
class Stepper:
    """Steps whose chunks the test chooses. Requests carry all their tokens as the prompt (so
    the runner returns logits for every position); `rewind` moves `num_computed` back."""

    def __init__(self):
        self._n = 0

    def request(self, tokens: list[int]) -> Request:
        self._n += 1
        return Request(f"m{self._n}", list(tokens), SamplingParams(temperature=0.0, prompt_logprobs=0),
                       arrival=self._n)

    def step(self, engine: LLMEngine, work: list[tuple[Request, int]]) -> list[torch.Tensor]:
        """Run one step of `(request, num_tokens)` chunks; returns each chunk's logits rows."""
        chunks = []
        for req, n in work:
            assert engine.cache.reserve(req, n), f"{req.request_id}: cannot reserve {n} tokens"
            req.status = Status.RUNNING
            chunks.append(ScheduledChunk(req, n))
        out = engine.runner.execute(chunks)
        rows = []
        for i, c in enumerate(chunks):
            assert out.num_rows[i] == c.num_tokens
            rows.append(out.logits[out.first_row[i]:out.first_row[i] + c.num_tokens].clone())
            c.request.num_computed += c.num_tokens
            engine.cache.trim(c.request)
        return rows

    def run(self, engine: LLMEngine, req: Request, sizes: list[int]) -> torch.Tensor:
        """Consecutive steps of one request with the given chunk sizes -> logits rows."""
        return torch.cat([self.step(engine, [(req, n)])[0] for n in sizes])


@pytest.fixture
def stepper() -> Stepper:
    return Stepper()


@pytest.fixture(scope="session")
def h():
    """The helpers above, for the test modules (conftest is not importable by name)."""
    import types
    return types.SimpleNamespace(
        REL_TOL=REL_TOL, TIE_GAP=TIE_GAP, MARGIN=MARGIN, Forced=Forced, random_ids=random_ids,
        assert_rows_close=assert_rows_close, max_rel_row_error=max_rel_row_error, top2_margin=top2_margin,
        check_greedy_against_reference=check_greedy_against_reference,
        assert_cache_accounting=assert_cache_accounting, free_counts=free_counts,
        Req=Req, drive=drive, drive_greedy=drive_greedy, greedy_outputs=greedy_outputs, token_ids=token_ids, simulated_step=simulated_step, random_prompt=random_prompt,
        assert_same_outputs=assert_same_outputs)


@pytest.fixture
def one_thread():
    """The tiny model's ops are far too small to gain from intra-op threads; on a shared 2-core
    machine two threads spin against each other (5x slower). Restored after the test."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def demo_engines():
    from dsv4.assets import demo_model_dir
    from dsv4.config import EngineConfig
    from dsv4.engine.engine import LLMEngine
    made = {}

    def get(**kw):
        kw = {"num_pages": 64, "max_num_batched_tokens": 2048, **kw}
        key = tuple(sorted(kw.items()))
        if key not in made:
            made[key] = LLMEngine(demo_model_dir(), EngineConfig(**kw))
        return made[key]
    yield get
    for eng in made.values():
        eng.close()
