"""DSpark speculative decoding end to end on a tiny random DSpark model (preset tiny-dspark,
fp32): greedy output identical to decoding without drafts (invariant 5) for single requests,
mixed batches with chunked prefills in the same step, stop tokens and max_tokens inside an
accepted run, prefix caching (the restored checkpoint carries the drafter's window keys), and
confidence-head truncation (fewer drafts verified, same output). Every page and slot comes back."""
from __future__ import annotations

import pytest
import torch

from dsv4.config import ConfigError, EngineConfig
from dsv4.engine.engine import LLMEngine
from dsv4.engine.speculative.dspark import DSparkProposer
from dsv4.engine.speculative.verify import sample_drafts
from dsv4.sampling_params import SamplingParams
from triples import chi_square, chi_square_bound, count_triples, exact_triples, sampling

pytestmark = pytest.mark.usefixtures("one_thread")
ENGINE = dict(max_num_batched_tokens=64, max_num_seqs=6, num_pages=16)


class Model:
    def __init__(self, path, cfg, model):
        self.path, self.cfg, self.model = path, cfg, model

    def ids(self, n, seed):
        g = torch.Generator().manual_seed(seed)
        return torch.randint(2, self.cfg.vocab_size - 1, (n,), generator=g).tolist()

    def engine(self, **config) -> LLMEngine:
        return LLMEngine(self.path, EngineConfig(**config), model=self.model)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Model:
    from dsv4.model.random_init import preset_config, random_state, save_checkpoint
    from dsv4.model.weights import load_model
    cfg = preset_config("tiny-dspark", index_n_heads=16, hc_sinkhorn_iters=3)   # 3: as tests/engine/conftest.py
    path = str(tmp_path_factory.mktemp("tiny-dspark"))
    save_checkpoint(cfg, random_state(cfg, seed=1234), path, names="deepseek")
    return Model(path, cfg, load_model(path))


def greedy(n: int, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, **kw)


def dspark(k: int, **kw) -> dict:
    return {"method": "dspark", "num_speculative_tokens": k, **kw}


def workload(tiny, sp):
    ids = tiny.ids
    return [sp.Req("a", ids(5, 1), greedy(20, logprobs=2)),
            sp.Req("b", ids(40, 2), greedy(25, repetition_penalty=1.3)),
            sp.Req("c", ids(70, 3), greedy(18), arrival=2),
            sp.Req("d", ids(130, 4), greedy(16), arrival=3),
            sp.Req("e", ids(17, 5), SamplingParams(temperature=0.9, top_k=20, seed=3, max_tokens=14), arrival=3),
            sp.Req("f", ids(66, 6), greedy(15, prompt_logprobs=1), arrival=6)]


GREEDY = ["a", "b", "c", "d", "f"]


@pytest.fixture(scope="module")
def plain(tiny, sp):
    return sp.drive(tiny.engine(**ENGINE), workload(tiny, sp))


class SteeredProposer(DSparkProposer):
    """The real DSpark drafter (window keys, block, Markov and confidence heads all run), with
    each draft's logits pushed towards the plain run's token unless `wrong(rid, position)`."""

    def __init__(self, base: DSparkProposer, truth: dict[str, list[int]], wrong):
        super().__init__(base.model, base.storage, base.h2d, base.threshold)
        self.truth, self.wrong = truth, wrong

    def _sample(self, logits, i, works, batch):
        logits = logits.clone()
        for r, w in enumerate(works):
            rid, p = w.request.request_id, w.start + w.anchor + 2 + i
            seq = self.truth[rid]
            if p < len(seq) and not self.wrong(rid, p):
                logits[r, seq[p]] += 1e6
        return sample_drafts(logits, batch)


def _mixed_steps(engine) -> list:
    mixed, execute = [], engine.runner.execute

    def spy(chunks, prev=None, *fills):
        mixed.append(any((c.num_logits or 0) > 1 for c in chunks) and any(not c.completes for c in chunks))
        return execute(chunks, prev, *fills)
    engine.runner.execute = spy
    return mixed


@pytest.mark.parametrize("k", [2, 4])
def test_dspark_greedy_equals_plain(tiny, h, sp, plain, k):
    eng = tiny.engine(speculative_config=dspark(k), **ENGINE)
    assert eng.layout.with_mtp and eng.runner.keep_taps and not eng.async_scheduling
    initial = h.free_counts(eng)
    got = sp.drive(eng, workload(tiny, sp), check=True)
    sp.assert_same_outputs(got, plain, GREEDY)
    assert got["e"].finish_reason == "length" and len(got["e"].token_ids) == 14
    stats = eng.spec.stats
    assert stats.num_drafts > 20 and stats.num_draft_tokens >= stats.num_drafts
    assert h.free_counts(eng) == initial


def test_dspark_accepted_runs_in_mixed_batches(tiny, h, sp, plain):
    """Drafts steered to the right tokens except at scattered positions: accepted runs of every
    length, verified beside chunked prefills; the output is the plain run's."""
    reqs = workload(tiny, sp)
    truth = {r.rid: list(r.prompt) + plain[r.rid].token_ids for r in reqs if r.rid in GREEDY}
    truth["e"] = []
    eng = tiny.engine(speculative_config=dspark(4), **ENGINE)
    initial = h.free_counts(eng)
    eng.spec.proposer = SteeredProposer(eng.spec.proposer, truth, lambda rid, p: (p * 7 + len(rid)) % 5 == 0)
    mixed = _mixed_steps(eng)
    got = sp.drive(eng, reqs, check=True)
    sp.assert_same_outputs(got, plain, GREEDY)
    assert any(mixed), "no step verified drafts beside a chunked prefill"
    per_pos = eng.spec.stats.accepted_per_pos
    assert len(per_pos) == 4 and all(n > 0 for n in per_pos), per_pos
    assert h.free_counts(eng) == initial


def test_dspark_stop_and_max_tokens_inside_an_accepted_run(tiny, h, sp):
    """Every draft right (k = 4): a stop token and max_tokens end requests inside a run of
    accepted drafts; the tokens past the end are dropped, as without drafts."""
    prompt = tiny.ids(12, seed=31)
    base = sp.drive(tiny.engine(**ENGINE), [sp.Req("p", prompt, greedy(12))])["p"].token_ids
    stop = next(t for i, t in enumerate(base) if 2 <= i <= 4 and t not in base[:i])
    reqs = [sp.Req("tok", prompt, greedy(12, stop_token_ids=[stop], logprobs=1)),
            sp.Req("len", prompt, greedy(6, logprobs=0)), sp.Req("one", prompt, greedy(1))]
    want = sp.drive(tiny.engine(**ENGINE), reqs)
    eng = tiny.engine(speculative_config=dspark(4), **ENGINE)
    initial = h.free_counts(eng)
    eng.spec.proposer = SteeredProposer(eng.spec.proposer, {r.rid: prompt + base for r in reqs},
                                        lambda rid, p: False)
    got = sp.drive(eng, reqs, check=True)
    sp.assert_same_outputs(got, want)
    assert got["tok"].finish_reason == "stop" and got["tok"].stop_reason == stop
    assert got["len"].finish_reason == "length" and len(got["len"].token_ids) == 6
    # the prefill emits one token, then one verify of 4 accepted drafts + the bonus ends each
    assert eng.spec.stats.num_drafts == 2 and eng.spec.stats.num_accepted_tokens == 8
    assert h.free_counts(eng) == initial


def _record_drafts(engine) -> dict:
    """(rid, anchor position) -> the drafts the DSpark block proposed there."""
    seen, draft = {}, engine.spec.proposer._draft

    def spy(works, batch_of):
        out = draft(works, batch_of)
        for w, (d, _) in zip(works, out):
            seen[(w.request.request_id, w.start + w.anchor)] = d.tolist()
        return out
    engine.spec.proposer._draft = spy
    return seen


def test_dspark_with_prefix_caching(tiny, h, sp):
    """The same 520-token prompt twice with prefix caching: the second resumes at 512 from the
    first's checkpoint, whose SWA section holds the drafter's window keys (its first block reads
    positions 488..519), so it drafts what the first drafted and generates the plain tokens."""
    prompt = tiny.ids(520, seed=41)
    want = sp.drive(tiny.engine(**ENGINE), [sp.Req("cold", prompt, greedy(12))])["cold"]
    eng = tiny.engine(speculative_config=dspark(3), enable_prefix_caching=True, **ENGINE)
    drafts = _record_drafts(eng)
    first = sp.drive(eng, [sp.Req("a", prompt, greedy(12))], check=True)["a"]
    second = sp.drive(eng, [sp.Req("b", prompt, greedy(12))], check=True)["b"]
    assert second.num_cached_tokens == 512
    assert first.token_ids == second.token_ids == want.token_ids
    a = {p: d for (rid, p), d in drafts.items() if rid == "a"}
    b = {p: d for (rid, p), d in drafts.items() if rid == "b"}
    assert 519 in b and a == b


def test_confidence_truncation_cuts_drafts_not_output(tiny, h, sp, plain):
    """A confidence threshold verifies only the leading confident drafts: fewer draft tokens,
    the same greedy output."""
    runs = {}
    for threshold in (0.0, 0.5):
        eng = tiny.engine(speculative_config=dspark(4, confidence_threshold=threshold), **ENGINE)
        got = sp.drive(eng, workload(tiny, sp), check=True)
        sp.assert_same_outputs(got, plain, GREEDY)
        runs[threshold] = eng.spec.stats
    full, cut = runs[0.0], runs[0.5]
    assert 0 < cut.num_draft_tokens < full.num_draft_tokens


@pytest.mark.parametrize("spec,match", [
    (dspark(5), "num_speculative_tokens"),
    (dspark(2, confidence_threshold=1.5), "confidence_threshold"),
    ({"method": "mtp", "num_speculative_tokens": 2}, "DSpark"),
    ({"method": "mtp", "num_speculative_tokens": 2, "confidence_threshold": 0.5}, "confidence_threshold")])
def test_dspark_config_errors(tiny, spec, match):
    with pytest.raises(ConfigError, match=match):
        tiny.engine(speculative_config=spec, **ENGINE)


def test_dspark_draft_folder_must_match_the_main_model(tiny, tmp_path):
    """`"model": DIR` for method dspark (dsv4/model/draft.py `load_dspark_draft`): a folder made for
    another main model is refused naming the field that differs."""
    from dsv4.model.checkpoint_reader import CheckpointError
    from dsv4.model.random_init import preset_config, random_state, save_checkpoint
    other = preset_config("tiny-dspark", index_n_heads=8)
    save_checkpoint(other, random_state(other, seed=1), str(tmp_path), names="deepseek")
    with pytest.raises(CheckpointError, match="index_n_heads"):
        tiny.engine(speculative_config=dspark(2, model=str(tmp_path)), **ENGINE)


def test_dspark_needs_a_dspark_model(sp):
    from dsv4.model.random_init import preset_config
    from dsv4.model.deepseek_v4 import DeepseekV4
    from dsv4.model.mtp import attach_mtp
    from dsv4.engine.speculative import check_speculative
    from dsv4.config import SpeculativeConfig
    with torch.device("meta"):
        model = DeepseekV4(preset_config("tiny"))
        attach_mtp(model)
    with pytest.raises(ConfigError, match="no DSpark drafter"):
        check_speculative(SpeculativeConfig(method="dspark", num_speculative_tokens=2), model)


# ---- sampling: the target distribution with DSpark drafts --------------------------------
REQUESTS = 1500


class NudgedProposer(DSparkProposer):
    """The real DSpark drafter whose Markov-corrected logits get 0.3 log p of the exact target
    added (and lose everything outside p's support): drafts are drawn from a q that overlaps p without
    equalling it, and the q handed to verification is the one they were drawn from."""

    def __init__(self, base: DSparkProposer, target):
        super().__init__(base.model, base.storage, base.h2d, base.threshold)
        self.target = target

    def _sample(self, logits, i, works, batch):
        if i == 0:
            self._prefix = [tuple(w.request.known_tokens(0, w.start + 1) + w.tokens[:w.anchor + 1]) for w in works]
        nudged = torch.stack([logits[r] + 0.3 * torch.log(self.target(p)) for r, p in enumerate(self._prefix)])
        drafts, q = sample_drafts(nudged, batch)
        self._prefix = [p + (d,) for p, d in zip(self._prefix, drafts.tolist())]
        return drafts, q


def test_dspark_sampling_keeps_the_target_distribution(tiny, sp):
    """1500 requests sample 3 tokens (temperature 1.5, top-k 3) with 2 DSpark drafts each step:
    the 27 token triples follow the exact p(x1) p(x2|x1) p(x3|x1,x2) (chi-square, p < 1e-5):
    statistic 28.3 for 26 degrees of freedom (bound 69.3), acceptance 0.83; handing verification
    p instead of the q the drafts were drawn from scores 220 and fails."""
    exact = exact_triples(tiny.model, tiny.cfg.vocab_size, tiny.ids(6, seed=77))
    eng = tiny.engine(speculative_config=dspark(2), max_num_seqs=512, max_num_batched_tokens=4096, num_pages=520,
                      seed=5)
    eng.spec.proposer = NudgedProposer(eng.spec.proposer, exact.target)
    params = sampling(max_tokens=3)
    outs = sp.drive(eng, [sp.Req(str(i), exact.prompt, params) for i in range(REQUESTS)])
    counts = count_triples(outs.values(), exact)
    stat, dof = chi_square(counts, exact.probs)
    stats = eng.spec.stats
    assert stat < chi_square_bound(dof), (stat, dof)
    assert 0.2 < stats.num_accepted_tokens / stats.num_draft_tokens < 0.95, "drafts rarely or always accepted"


def test_dspark_with_fp8_kv_equals_plain_fp8(tiny, h, sp):
    """Packed FP8 KV: the drafter writes its window keys packed and reads them with their RoPE
    channels, as the main layers do; greedy output equals a plain FP8 engine's."""
    fp8 = dict(ENGINE, kv_cache_dtype="fp8")
    want = sp.drive(tiny.engine(**fp8), workload(tiny, sp))
    eng = tiny.engine(speculative_config=dspark(3), **fp8)
    initial = h.free_counts(eng)
    got = sp.drive(eng, workload(tiny, sp), check=True)
    sp.assert_same_outputs(got, want, GREEDY)
    assert eng.spec.stats.num_drafts > 10 and eng.spec.stats.num_accepted_tokens > 0
    assert h.free_counts(eng) == initial
