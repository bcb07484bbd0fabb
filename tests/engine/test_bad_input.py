"""Bad requests are refused at `add_request` with a ValueError that names the field, cost
nothing, and the engine keeps serving the requests it already has (docs/architecture.md, "Serving")."""
from __future__ import annotations

import math

import pytest

from dsv4.config import ConfigError, EngineConfig
from dsv4.engine.engine import LLMEngine
from dsv4.sampling_params import SamplingParams

pytestmark = pytest.mark.usefixtures("one_thread")

MAX_MODEL_LEN = 64
ENGINE = dict(max_num_batched_tokens=16, max_num_seqs=4, num_pages=4, max_model_len=MAX_MODEL_LEN)


def greedy(max_tokens=20, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kw)


@pytest.fixture(scope="module")
def good_prompt(tiny):
    return tiny.ids(20, seed=81)


@pytest.fixture(scope="module")
def undisturbed(tiny, h, good_prompt):
    eng = tiny.engine(**ENGINE)
    eng.add_request("good", good_prompt, greedy())
    return h.drive(eng)["good"].token_ids


V = 512  # the tiny preset's vocabulary (checked below)
OK = [5, 6, 7]
CASES = {
    "empty prompt": ([], greedy(), "prompt"),
    "token id = vocab size": ([1, 2, V], greedy(), "prompt_token_ids"),
    "negative token id": ([1, -1, 2], greedy(), "prompt_token_ids"),
    "float token id": ([1, 2.0], greedy(), "prompt_token_ids"),
    "bool token id": ([1, True], greedy(), "prompt_token_ids"),
    "string token id": ([1, "7"], greedy(), "prompt_token_ids"),
    "max_tokens 0": (OK, greedy(0), "max_tokens"),
    "max_tokens -3": (OK, greedy(-3), "max_tokens"),
    "max_tokens not an int": (OK, greedy(2.5), "max_tokens"),
    "temperature < 0": (OK, SamplingParams(temperature=-0.1), "temperature"),
    "temperature nan": (OK, SamplingParams(temperature=math.nan), "temperature"),
    "top_p 0": (OK, SamplingParams(top_p=0.0), "top_p"),
    "top_p > 1": (OK, SamplingParams(top_p=1.5), "top_p"),
    "top_p < 0": (OK, SamplingParams(top_p=-0.2), "top_p"),
    "prompt = max_model_len": (list(range(MAX_MODEL_LEN)), greedy(1), "prompt"),
    "prompt > max_model_len": (list(range(MAX_MODEL_LEN + 30)), greedy(1), "prompt"),
    "prompt + max_tokens > max_model_len": (list(range(MAX_MODEL_LEN - 10)), greedy(11), "max_tokens"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_bad_request_is_refused_and_engine_keeps_serving(tiny, h, good_prompt, undisturbed, case):
    assert tiny.cfg.vocab_size == V
    prompt, params, field = CASES[case]
    eng = tiny.engine(**ENGINE)
    initial = h.free_counts(eng)
    eng.add_request("good", good_prompt, greedy())
    eng.step()
    eng.step()
    before = h.free_counts(eng)
    with pytest.raises(ValueError, match=rf"^{field}: "):
        eng.add_request("bad", prompt, params)
    assert h.free_counts(eng) == before, "a refused request took cache"
    assert set(eng.requests) == {"good"}
    assert [r.request_id for r in eng.scheduler.running + list(eng.scheduler.waiting)] == ["good"]
    eng.add_request("bad", OK, greedy(3))          # the refused id left nothing behind
    done = h.token_ids(h.drive(eng))
    assert done["good"] == undisturbed and len(done["bad"]) == 3
    assert h.free_counts(eng) == initial


def test_duplicate_request_id_is_refused(tiny, good_prompt):
    eng = tiny.engine(**ENGINE)
    eng.add_request("a", good_prompt, greedy())
    with pytest.raises(ValueError, match=r"^request_id: "):
        eng.add_request("a", OK, greedy())
    assert len(eng.scheduler.waiting) == 1 and eng.scheduler.waiting[0].prompt_token_ids == good_prompt


@pytest.fixture(scope="module")
def short_model(tmp_path_factory):
    """A tiny checkpoint whose model allows only 128 positions."""
    from dsv4.model.random_init import preset_config, random_state, save_checkpoint
    cfg = preset_config("tiny", max_position_embeddings=128)
    path = str(tmp_path_factory.mktemp("short-model"))
    save_checkpoint(cfg, random_state(cfg, seed=3), path)
    return path


def test_prompt_longer_than_the_model_allows(short_model, h):
    eng = LLMEngine(short_model, EngineConfig(max_num_batched_tokens=64, max_num_seqs=2, num_pages=4))
    assert eng.max_model_len == 128      # 4 pages would hold 1024 tokens: the model is the limit
    with pytest.raises(ValueError, match=r"^prompt: 128 tokens do not fit max_model_len 128"):
        eng.add_request("long", [3] * 128, greedy(1))
    with pytest.raises(ValueError, match=r"^max_tokens: "):
        eng.add_request("long", [3] * 100, greedy(29))
    eng.add_request("ok", [3] * 100, greedy(28))
    assert len(h.drive(eng)["ok"].token_ids) == 28


def test_max_model_len_above_the_models_is_a_config_error(short_model):
    with pytest.raises(ConfigError, match="max_model_len") as e:
        LLMEngine(short_model, EngineConfig(max_num_batched_tokens=64, max_num_seqs=2, num_pages=4,
                                            max_model_len=129))
    assert isinstance(e.value, ValueError) and e.value.field == "max_model_len"


# ---- the KV cache as the limit (docs/architecture.md, "Serving": bad input) -----------------
def test_request_that_cannot_fit_the_cache_is_rejected(tiny, h):
    """On a cache of 2 history pages (512 tokens) max_model_len defaults to 512 and names the
    cache as its source; a request of exactly 512 tokens is accepted and completes; one past it
    is refused at once, costing nothing; the engine keeps serving throughout."""
    eng = tiny.engine(max_num_batched_tokens=256, max_num_seqs=2, num_pages=2)
    assert eng.max_model_len == 512 and eng.context_limit == "the KV cache (2 pages of 256 tokens)"
    initial = h.free_counts(eng)
    ids = tiny.ids(600, seed=71)
    eng.add_request("ok", ids[:400], greedy(112))          # 512 tokens: exactly fits
    with pytest.raises(ValueError, match=r"^max_tokens: .* exceeds max_model_len 512 \(set by the KV cache"):
        eng.add_request("too-long-output", ids[:100], greedy(413))
    with pytest.raises(ValueError, match=r"^prompt: 513 tokens do not fit max_model_len 512 .*the KV cache"):
        eng.add_request("too-long-prompt", ids[:513], greedy(1))
    assert set(eng.requests) == {"ok"} and len(eng.scheduler.waiting) == 1
    done = h.drive(eng)
    assert len(done["ok"].token_ids) == 112 and h.free_counts(eng) == initial


@pytest.mark.parametrize("sizing, field", [(dict(num_pages=2), "num_pages"),
                                           (dict(cache_memory_gb=0.002), "cache_memory_gb")])
def test_max_model_len_beyond_the_cache_is_a_config_error(tiny, sizing, field):
    """--max-model-len that no request could use, the cache holding fewer tokens for one
    request alone: a start-up error naming the flag that sized the cache."""
    with pytest.raises(ConfigError, match=r"holds \d+ tokens .* too few for one request of max_model_len 4096") as e:
        tiny.engine(max_num_batched_tokens=64, max_num_seqs=2, max_model_len=4096, **sizing)
    assert e.value.field == field
    fits = tiny.engine(max_num_batched_tokens=64, max_num_seqs=2, **sizing)     # the default fits the cache
    assert fits.max_model_len == fits.plan.max_tokens < 4096


def test_cache_budget_below_one_page_names_the_flag(tiny):
    with pytest.raises(ConfigError, match=r"cache memory budget of .* too small") as e:
        tiny.engine(cache_memory_gb=1e-5, max_num_seqs=4)
    assert e.value.field == "cache_memory_gb"
