"""`dsv4 serve` end to end on the demo checkpoint, driven by the official `openai` client:
everything that does not depend on what the (random) model writes."""
import httpx
import openai
import pytest
import torch

from dsv4.serve.chat_format.encoding import encode_messages
from dsv4.serve.chat_format.release import detect_release
from dsv4.text.tokenizer import Tokenizer

pytest_plugins = ["serve.server_fixtures"]

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is the weather in Paris?"}]
NO_EOS = {"ignore_eos": True}


@pytest.fixture(scope="module")
def client(real_server):
    from serve.server_fixtures import API_KEY
    with openai.OpenAI(base_url=real_server.base_url + "/v1", api_key=API_KEY, max_retries=0, timeout=120,
                       http_client=httpx.Client(trust_env=False)) as c:
        yield c


@pytest.fixture(scope="module")
def tok(demo_dir):
    return Tokenizer.from_dir(demo_dir)


def chat(client, **kwargs):
    return client.chat.completions.create(model="dsv4-test", messages=MESSAGES, **kwargs)


def test_models_lists_the_served_names(client):
    assert [m.id for m in client.models.list().data] == ["dsv4-test", "dsv4-alias"]


def test_chat_usage_counts_the_tokens(client, tok, demo_dir):
    r = chat(client, max_tokens=7, temperature=0, extra_body=NO_EOS)
    prompt = tok.encode(encode_messages(MESSAGES, thinking=False, release=detect_release(demo_dir)))
    assert r.id.startswith("chatcmpl-") and r.object == "chat.completion" and r.model == "dsv4-test"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (len(prompt), 7, len(prompt) + 7)
    assert r.choices[0].finish_reason == "length" and r.choices[0].message.role == "assistant"


def test_chat_stream_matches_the_whole_response(client):
    whole = chat(client, max_tokens=9, temperature=0, extra_body=NO_EOS)
    chunks = list(chat(client, max_tokens=9, temperature=0, stream=True, stream_options={"include_usage": True},
                       extra_body=NO_EOS))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["length"] and chunks[-2].choices[0].finish_reason == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 9
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens
    assert len({c.id for c in chunks}) == 1


def test_alias_and_omitted_model_name_are_accepted(real_server, http):
    for body in ({"model": "dsv4-alias"}, {}):
        r = http.post("/v1/chat/completions", json={**body, "messages": MESSAGES, "max_tokens": 2})
        assert r.status_code == 200 and r.headers["x-request-id"] == r.json()["id"]
    r = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1}, headers={"X-Request-Id": "abc"})
    assert r.json()["id"] == r.headers["x-request-id"] == "cmpl-abc"


def test_null_fields_mean_their_defaults(http):
    nulls = dict.fromkeys(("n", "stream", "logprobs", "top_logprobs", "temperature", "stop", "seed", "tools",
                           "tool_choice", "stream_options", "ignore_eos", "min_tokens"))
    r = http.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 2, **nulls})
    assert r.status_code == 200 and len(r.json()["choices"]) == 1


def test_completions_batch_of_prompts_with_n(client, tok):
    r = client.completions.create(model="dsv4-test", prompt=["one", "two words"], n=2, max_tokens=3, seed=1,
                                  extra_body=NO_EOS)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert r.usage.prompt_tokens == len(tok.encode("one")) + len(tok.encode("two words"))
    assert r.usage.completion_tokens == 12


def test_chat_logprobs_cover_every_token(client):
    r = chat(client, max_tokens=6, temperature=0, logprobs=True, top_logprobs=3, extra_body=NO_EOS)
    items = r.choices[0].logprobs.content
    assert len(items) == 6
    for item in items:   # greedy: the chosen token is the best alternative
        assert len(item.top_logprobs) == 3 and item.top_logprobs[0].logprob == pytest.approx(item.logprob)
        assert item.bytes == list(item.token.encode())


def test_completions_echo_and_logprobs(client, tok):
    prompt = "The quick brown fox"
    r = client.completions.create(model="dsv4-test", prompt=prompt, max_tokens=5, echo=True, logprobs=2,
                                  temperature=0, extra_body=NO_EOS)
    choice, n_prompt = r.choices[0], len(tok.encode(prompt))
    assert r.object == "text_completion" and r.usage.prompt_tokens == n_prompt and r.usage.completion_tokens == 5
    assert choice.text.startswith(prompt) and len(choice.text) > len(prompt)
    lp = choice.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == n_prompt + 5
    assert lp.token_logprobs[0] is None and all(v <= 0 for v in lp.token_logprobs[1:])
    assert "".join(lp.tokens) == choice.text and lp.text_offset[n_prompt] == len(prompt)


def test_completions_token_ids_stream(client, tok):
    chunks = list(client.completions.create(model="dsv4-test", prompt=[100, 200, 300], max_tokens=6, stream=True,
                                            stream_options={"include_usage": True}, temperature=0, extra_body=NO_EOS))
    whole = client.completions.create(model="dsv4-test", prompt=[100, 200, 300], max_tokens=6, temperature=0,
                                      extra_body=NO_EOS)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    assert chunks[-1].usage.prompt_tokens == 3 and chunks[-1].usage.completion_tokens == 6
    echoed = client.completions.create(model="dsv4-test", prompt=[100, 200, 300], max_tokens=6, stream=True, echo=True,
                                       temperature=0, extra_body=NO_EOS)
    prompt_text = tok.decode([100, 200, 300], skip_special_tokens=True)
    assert "".join(c.choices[0].text for c in echoed) == prompt_text + whole.choices[0].text


def test_stop_strings_are_honoured_whole_and_streamed(client):
    kwargs = dict(model="dsv4-test", prompt=[7, 8, 9, 10], max_tokens=24, temperature=0, extra_body=NO_EOS)
    full = client.completions.create(**kwargs).choices[0].text
    start = next(i for i in range(1, len(full) - 2) if full.find(full[i:i + 2]) == i and "\ufffd" not in full[i:i + 2])
    stop = full[start:start + 2]
    cut = client.completions.create(stop=[stop], **kwargs).choices[0]
    assert (cut.text, cut.finish_reason, cut.stop_reason) == (full[:start], "stop", stop)
    streamed = "".join(c.choices[0].text for c in client.completions.create(stop=[stop], stream=True, **kwargs))
    assert streamed == full[:start]


def test_n_choices_and_seeds(client):
    kwargs = dict(max_tokens=6, temperature=1.0, seed=1234, extra_body=NO_EOS)
    r = chat(client, n=3, **kwargs)
    assert [c.index for c in r.choices] == [0, 1, 2] and r.usage.completion_tokens == 18
    again = chat(client, n=3, **kwargs)
    assert [c.message.content for c in again.choices] == [c.message.content for c in r.choices]
    alone = chat(client, n=1, **{**kwargs, "seed": 1235})   # choice i of a seeded request uses seed + i
    assert alone.choices[0].message.content == r.choices[1].message.content
    assert len({c.message.content for c in r.choices}) > 1


def test_streamed_n_choices_each_finish(client):
    chunks = list(chat(client, n=2, max_tokens=4, stream=True, temperature=0.8, seed=5, extra_body=NO_EOS))
    finishes = sorted(c.choices[0].index for c in chunks if c.choices and c.choices[0].finish_reason)
    assert finishes == [0, 1]
    roles = [c.choices[0].index for c in chunks if c.choices and c.choices[0].delta.role]
    assert roles == [0, 1]


def test_greedy_output_equals_llm_generate(client, demo_dir):
    from dsv4.engine.llm import LLM
    from dsv4.sampling_params import SamplingParams
    prompts = [[11, 12, 13, 14, 15], [300, 301, 302]]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        llm = LLM(demo_dir, num_pages=8, max_model_len=512)
        ref = llm.generate(prompt_token_ids=prompts, use_tqdm=False,
                           sampling_params=SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    finally:
        torch.set_num_threads(threads)
    r = client.completions.create(model="dsv4-test", prompt=prompts, max_tokens=12, temperature=0, logprobs=0,
                                  extra_body=NO_EOS)
    for choice, out in zip(r.choices, ref):
        assert choice.logprobs.tokens == [llm.tokenizer.decode([t]) for t in out.token_ids]
        assert choice.text == out.text


def test_metrics_are_exposed_and_increase(http, metric):
    before = http.get("/metrics").text
    r = http.post("/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 4, "ignore_eos": True})
    assert r.status_code == 200
    after = http.get("/metrics").text
    for name in ("dsv4:generation_tokens_total", "dsv4:time_to_first_token_seconds_count",
                 "dsv4:e2e_request_latency_seconds_count", "dsv4:time_per_output_token_seconds_count"):
        assert metric(after, name) > metric(before, name), name
    assert metric(after, "dsv4:generation_tokens_total") - metric(before, "dsv4:generation_tokens_total") == 4
    assert metric(after, "dsv4:prompt_tokens_total") - metric(before, "dsv4:prompt_tokens_total") == 3
    assert metric(after, "dsv4:request_success_total", finished_reason="length") > 0
    assert metric(after, "dsv4:cache_pages_total") == 96
    for gauge in ("dsv4:num_requests_running", "dsv4:num_requests_waiting", "dsv4:kv_cache_usage_perc"):
        assert gauge in after
