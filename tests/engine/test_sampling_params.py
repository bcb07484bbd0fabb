import pytest

from dsv4.sampling_params import SamplingParams

VOCAB = 100


def test_defaults_match_vllm():
    p = SamplingParams()
    assert (p.n, p.temperature, p.top_p, p.top_k, p.min_p) == (1, 1.0, 1.0, 0, 0.0)
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.0, 0.0, 1.0)
    assert (p.max_tokens, p.min_tokens, p.seed) == (16, 0, None)
    assert p.stop == [] and p.stop_token_ids == []
    assert p.logprobs is None and p.prompt_logprobs is None
    assert p.skip_special_tokens and not p.ignore_eos and not p.include_stop_str_in_output
    assert not p.is_greedy and not p.has_penalties
    p.validate(VOCAB)


def test_stop_is_normalised_to_a_list():
    assert SamplingParams(stop="###").stop == ["###"]
    assert SamplingParams(stop=("a", "b")).stop == ["a", "b"]


def test_greedy_threshold():
    assert SamplingParams(temperature=0.0).is_greedy
    assert SamplingParams(temperature=5e-6).is_greedy
    assert not SamplingParams(temperature=1e-3).is_greedy


def test_finishing_token_ids_include_eos_unless_ignored():
    assert SamplingParams(stop_token_ids=[5]).finishing_token_ids(2) == [5, 2]
    assert SamplingParams(stop_token_ids=[5], ignore_eos=True).finishing_token_ids(2) == [5]
    assert SamplingParams(stop_token_ids=[2]).finishing_token_ids(2) == [2]
    assert SamplingParams().finishing_token_ids(None) == []


@pytest.mark.parametrize("field, value", [
    ("max_tokens", 0),
    ("temperature", -0.1),
    ("temperature", float("nan")),
    ("top_p", 0.0),
    ("top_p", 1.5),
    ("top_k", -2),
    ("top_k", 2.5),
    ("min_p", -0.1),
    ("min_p", 1.1),
    ("repetition_penalty", 0.0),
    ("presence_penalty", 2.5),
    ("frequency_penalty", -2.5),
    ("n", 0),
    ("logprobs", -1),
    ("logprobs", 21),
    ("prompt_logprobs", 21),
    ("min_tokens", -1),
    ("min_tokens", 17),  # more than max_tokens (16)
    ("seed", "42"),
    ("stop_token_ids", [VOCAB]),
    ("stop_token_ids", [-1]),
    ("stop", [""]),
])
def test_validate_names_the_bad_field(field, value):
    params = SamplingParams(**{field: value})
    with pytest.raises(ValueError, match=f"^{field}:"):
        params.validate(VOCAB)


def test_validate_accepts_edge_values():
    SamplingParams(temperature=0.0, top_p=1.0, top_k=-1, min_p=1.0, repetition_penalty=0.5,
                   presence_penalty=-2.0, frequency_penalty=2.0, logprobs=0,
                   prompt_logprobs=20, min_tokens=16, seed=0,
                   stop_token_ids=[0, VOCAB - 1]).validate(VOCAB)


def test_validate_checks_max_tokens_against_model_length():
    SamplingParams(max_tokens=64).validate(VOCAB, max_model_len=64)
    with pytest.raises(ValueError, match="^max_tokens:"):
        SamplingParams(max_tokens=65).validate(VOCAB, max_model_len=64)
