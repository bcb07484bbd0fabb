"""logit_bias in the sampler, and SamplingParams.validate keeping every value inside what the
engine wire (msgpack: 64-bit integers, UTF-8) and float32 sampling can carry."""
import msgspec
import pytest
import torch

from dsv4.engine.ipc import AddRequest, decode_input, encode
from dsv4.engine.sampler import Sampler, SamplingBatch, SamplingRow, make_generator
from dsv4.sampling_params import SamplingParams

VOCAB, EOS = 50, 0


def sample(logits, *params: SamplingParams):
    rows = [SamplingRow(p, [3, 4], [], make_generator(p.seed, "cpu")) for p in params]
    return Sampler()(logits, SamplingBatch.build(rows, VOCAB, "cpu", EOS))


def test_logit_bias_moves_greedy_and_sampled_choices_but_not_reported_logprobs():
    logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(0))
    plain = logits.argmax(-1)
    out = sample(logits, SamplingParams(temperature=0, logit_bias={7: 100.0}, logprobs=1),
                 SamplingParams(temperature=0.9, seed=3, logit_bias={9: 100.0}),
                 SamplingParams(temperature=0, logit_bias={int(plain[2]): -100.0}))
    assert out.token_ids[:2].tolist() == [7, 9] and out.token_ids[2] != plain[2]
    raw = torch.log_softmax(logits[0], -1)[7]
    assert out.logprobs[0] == pytest.approx(float(raw), abs=1e-5)       # raw: before the bias
    assert not logits.isinf().any()                                       # the input is never written


def test_min_tokens_ban_wins_over_a_bias():
    logits = torch.zeros(1, VOCAB)
    out = sample(logits, SamplingParams(temperature=0, min_tokens=2, logit_bias={EOS: 100.0, 5: 1.0}))
    assert out.token_ids.tolist() == [5]


@pytest.mark.parametrize("field,value", [
    ("seed", 1 << 64), ("seed", -(1 << 63) - 1), ("top_k", 1 << 63), ("top_k", 10 ** 30), ("n", 1 << 64),
    ("top_p", 1e-46), ("repetition_penalty", 1e-46), ("repetition_penalty", 0.001), ("repetition_penalty", 1e3),
    ("temperature", 1e39), ("min_p", 1e-40), ("presence_penalty", -1e-45), ("temperature", 10 ** 400),
    ("stop", ["\ud800"]), ("logit_bias", {VOCAB: 1.0}), ("logit_bias", {1: 100.5}), ("logit_bias", {"1": 1.0}),
    ("logit_bias", {i: 1.0 for i in range(1025)}),
])
def test_validate_keeps_values_on_the_wire(field, value):
    vocab = 2000 if field == "logit_bias" and len(value) > 1000 else VOCAB    # too many, not out of range
    with pytest.raises(ValueError, match=f"^{field}:"):
        SamplingParams(**{field: value}).validate(vocab)


@pytest.mark.parametrize("params", [
    SamplingParams(seed=-(1 << 63)), SamplingParams(seed=(1 << 64) - 1), SamplingParams(top_k=(1 << 63) - 1),
    SamplingParams(temperature=3e38, top_p=1.2e-38, repetition_penalty=0.01),
    SamplingParams(logit_bias={0: -100.0, VOCAB - 1: 100}, stop=["naïve", "😀"]),
], ids=["seed min", "seed max", "top_k max", "float32 edges", "bias and unicode stops"])
def test_valid_edge_values_cross_the_wire(params):
    params.validate(VOCAB)
    frame = encode(AddRequest("r", [1, 2], params))
    assert decode_input(frame).params == params
    assert isinstance(msgspec.msgpack.decode(frame), dict)
