"""Per-request sampling parameters, with vLLM's names, defaults and meanings.

`SamplingParams` is plain data: the serve layer fills it from an OpenAI request, the
engine calls `validate()` once on admission, and the sampler and stop checker read it.
Construction only normalises (`stop` to a list, `None` lists to empty ones); `validate`
rejects bad values with a `ValueError` that names the field.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

# Below this temperature a request samples greedily (argmax), as in vLLM.
GREEDY_TEMPERATURE_EPS = 1e-5
# Most alternatives a request may ask for per position (`logprobs`, `prompt_logprobs`).
MAX_LOGPROBS = 20
# logit_bias: at most this many tokens, each biased by a value in [-LOGIT_BIAS_MAX, LOGIT_BIAS_MAX].
MAX_LOGIT_BIAS_TOKENS = 1024
LOGIT_BIAS_MAX = 100.0
# Most stop strings a request may give: every one is searched for after every token, in the API
# process's event loop (text/stop_watch.py), so 100,000 of them stalled every other stream.
MAX_STOP_STRINGS = 64
# Most stop_token_ids: the sampler lists them for every step of a request below min_tokens
# (a million of them stalled every step of the batch by ~1 s).
MAX_STOP_TOKEN_IDS = 1024
# The sampler works in float32: a nonzero value must stay a normal float32 number.
F32_MAX, F32_TINY = 3.4028234663852886e38, 1.1754943508222875e-38
INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1
SEED_MAX = (1 << 64) - 1   # torch.Generator.manual_seed takes [INT64_MIN, 2**64 - 1]
REPETITION_PENALTY_RANGE = (0.01, 100.0)   # it divides logits: a tiny one overflows float32


@dataclass
class StructuredOutputs:
    """A constraint on a request's output, enforced by a grammar (dsv4/structured/): exactly
    one kind is set. `json` is a JSON schema as text; `json_object` any JSON object; `regex`,
    `choice` (one of the strings), `grammar` (EBNF, xgrammar's dialect). `after_think`: the
    constraint starts after the `</think>` token (thinking mode); tokens before it are free."""
    json: str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    after_think: bool = False

    def kinds(self) -> list[str]:
        return [k for k in ("json", "json_object", "regex", "choice", "grammar")
                if getattr(self, k) not in (None, False)]

    def key(self) -> tuple:
        """What the compiled grammar depends on (the cache key)."""
        return (self.json, self.json_object, self.regex, tuple(self.choice or ()), self.grammar)

    def validate(self) -> None:
        kinds = self.kinds()
        if len(kinds) != 1:
            raise ValueError(f"structured_outputs: give exactly one of json, json_object, regex, choice, "
                             f"grammar; got {kinds or 'none'}")
        for name in ("json", "regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not _is_utf8(value)):
                raise ValueError(f"structured_outputs.{name}: must be a valid string")
        if self.choice is not None and (not self.choice or not all(isinstance(c, str) and _is_utf8(c)
                                                                     for c in self.choice)):
            raise ValueError("structured_outputs.choice: must be a non-empty list of strings")


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: no top-k
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    max_tokens: int = 16
    min_tokens: int = 0
    stop: str | list[str] | None = None  # normalised to list[str]
    stop_token_ids: list[int] | None = None  # normalised to list[int]
    ignore_eos: bool = False
    logprobs: int | None = None  # alternatives per sampled token; 0: the chosen one only
    prompt_logprobs: int | None = None  # the same, per prompt position
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit before sampling
    structured: StructuredOutputs | None = None  # a grammar the output must follow

    def __post_init__(self) -> None:
        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        else:
            self.stop = list(self.stop)
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.logit_bias is not None:
            self.logit_bias = dict(self.logit_bias)

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE_EPS

    @property
    def has_penalties(self) -> bool:
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.repetition_penalty != 1.0)

    def finishing_token_ids(self, eos_token_id: int | None) -> list[int]:
        """Token ids that end this request: stop_token_ids, plus EOS unless ignore_eos.
        These are the ids masked out while fewer than min_tokens were generated."""
        ids = list(self.stop_token_ids)
        if eos_token_id is not None and not self.ignore_eos and eos_token_id not in ids:
            ids.append(eos_token_id)
        return ids

    def validate(self, vocab_size: int, max_model_len: int | None = None) -> None:
        """Raise ValueError naming the first field with a bad value. Every value that passes
        fits the engine wire (msgpack: 64-bit integers, UTF-8 strings) and float32 math."""
        _check_int(self, "n", low=1)
        _check_float(self, "temperature", low=0.0)
        _check_float(self, "top_p", low=0.0, low_inclusive=False, high=1.0)
        _check_int(self, "top_k", low=-1)
        _check_float(self, "min_p", low=0.0, high=1.0)
        if self.seed is not None:
            _check_int(self, "seed", low=INT64_MIN, high=SEED_MAX)
        for name in ("presence_penalty", "frequency_penalty"):
            _check_float(self, name, low=-2.0, high=2.0)
        _check_float(self, "repetition_penalty", *REPETITION_PENALTY_RANGE)
        _check_int(self, "max_tokens", low=1, high=max_model_len)
        _check_int(self, "min_tokens", low=0, high=self.max_tokens)
        for name in ("logprobs", "prompt_logprobs"):
            if getattr(self, name) is not None:
                _check_int(self, name, low=0, high=MAX_LOGPROBS)
        if len(self.stop) > MAX_STOP_STRINGS:
            raise ValueError(f"stop: at most {MAX_STOP_STRINGS} stop strings, got {len(self.stop)}")
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise ValueError(f"stop: every stop string must be a non-empty str, got {s!r}")
            if not _is_utf8(s):
                raise ValueError(f"stop: {_show(s)} is not valid Unicode (a lone surrogate)")
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise ValueError(f"stop_token_ids: at most {MAX_STOP_TOKEN_IDS} token ids, got {len(self.stop_token_ids)}")
        for t in self.stop_token_ids:
            if not _is_int(t) or not 0 <= t < vocab_size:
                raise ValueError(f"stop_token_ids: {_show(t)} is not a token id in [0, {vocab_size})")
        if self.logit_bias is not None:
            _check_logit_bias(self.logit_bias, vocab_size)
        if self.structured is not None:
            self.structured.validate()


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_utf8(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _check_logit_bias(bias: dict, vocab_size: int) -> None:
    if len(bias) > MAX_LOGIT_BIAS_TOKENS:
        raise ValueError(f"logit_bias: at most {MAX_LOGIT_BIAS_TOKENS} tokens, got {len(bias)}")
    for t, v in bias.items():
        if not _is_int(t) or not 0 <= t < vocab_size:
            raise ValueError(f"logit_bias: {_show(t)} is not a token id in [0, {vocab_size})")
        if not _is_number(v) or not -LOGIT_BIAS_MAX <= v <= LOGIT_BIAS_MAX:
            raise ValueError(f"logit_bias: the bias of token {t} must be a number in "
                             f"[-{LOGIT_BIAS_MAX:g}, {LOGIT_BIAS_MAX:g}], got {_show(v)}")


def _check_int(params: SamplingParams, name: str, low: int | None = None,
               high: int | None = None) -> None:
    value = getattr(params, name)
    if not _is_int(value):
        raise ValueError(f"{name}: must be an int, got {_show(value)}")
    if (low is not None and value < low) or (high is not None and value > high):
        raise ValueError(f"{name}: must be {_range_text(low, high, True)}, got {_show(value)}")
    if not INT64_MIN <= value <= max(INT64_MAX, high or 0):
        raise ValueError(f"{name}: must fit a signed 64-bit integer, got {_show(value)}")


def _check_float(params: SamplingParams, name: str, low: float | None = None,
                 high: float | None = None, low_inclusive: bool = True) -> None:
    value = getattr(params, name)
    if not _is_number(value) or not math.isfinite(value) or abs(value) > F32_MAX:
        raise ValueError(f"{name}: must be a finite number (float32), got {_show(value)}")
    if value != 0 and abs(value) < F32_TINY:
        raise ValueError(f"{name}: {value!r} underflows float32 (the sampler's precision); use 0 "
                         f"or a value of magnitude >= {F32_TINY:.3g}")
    too_low = low is not None and (value < low if low_inclusive else value <= low)
    if too_low or (high is not None and value > high):
        raise ValueError(f"{name}: must be {_range_text(low, high, low_inclusive)}, "
                         f"got {_show(value)}")


def _show(value: object, limit: int = 40) -> str:
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


def _is_number(value: object) -> bool:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    try:
        float(value)
    except OverflowError:
        return False
    return True


def _range_text(low: float | None, high: float | None, low_inclusive: bool) -> str:
    if high is None:
        return f">= {low}" if low_inclusive else f"> {low}"
    if low is None:
        return f"<= {high}"
    return f"in {'[' if low_inclusive else '('}{low}, {high}]"
