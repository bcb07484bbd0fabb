"""A seeded fuzzer of hostile request bodies against `dsv4 serve` on the demo checkpoint.

Each case takes a small valid chat or completions body and breaks it: a field (top-level or
nested: a message, a tool's schema, a response_format) set to a value of the wrong type or out
of range (NaN, 2**64, lone surrogates, null bytes, deep nesting, ...), a structured-output
constraint from a pool of odd schemas and regexes, or the serialised body itself cut, bitten or
wrapped. What must hold for every case (docs/architecture.md, "Serving"):
* the answer is never a 5xx nor a dropped connection; a 4xx carries OpenAI's error body;
* an accepted stream ends with `[DONE]` and carries no error event;
* a well-formed greedy request sent again and again meanwhile gets the tokens it gets alone;
* the server is up afterwards.
A second test gives the tools of a chat request random schema-like trees (keywords holding
values of any kind) while the scripted engine core (server_fixtures.py) writes tool calls, which
the output parser types by those schemas: no answer may be a 5xx.
Deterministic (`SEED`); valid bodies ask for 2 tokens, so the file runs in ~25 s on one core."""
import json
import random
import threading

import pytest

pytest_plugins = ["serve.server_fixtures"]

SEED, CASES = 20261207, 600
CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
VICTIM = {"prompt": "def add(a, b):", "max_tokens": 8, "temperature": 0, "ignore_eos": True}

DEEP = json.loads("[" * 70 + "]" * 70)
VALUES = [True, False, 0, -1, 1, 3, 129280, 2 ** 31, 2 ** 63, 2 ** 64, -(2 ** 63) - 1, 10 ** 30, 0.5, -0.0, 1e308,
          1e-320, float("nan"), float("inf"), float("-inf"), "", "x", "5", "\u0000", "a\x00b", "\ud800", "\udfff x",
          "\U0001f600", "a" * 3000, [], [None], [1, "a"], [-1], [10 ** 9], [[1]], [""], ["\ud800"], {}, {"a": 1},
          {"type": "function"}, {"type": "json_schema"}, DEEP]
SCHEMAS = [{"type": "string", "minLength": -5}, {"type": "string", "minLength": 5, "maxLength": 2},
           {"type": "array", "minItems": -1}, {"type": "integer", "minimum": 5, "maximum": 1},
           {"type": "string", "pattern": "(("}, {"type": "nonsense"}, {"$ref": "#"}, {"$ref": "#/nowhere"},
           {"enum": []}, {"type": ["string", 5]}, {"not": {}}, {"type": "object", "properties": [1]},
           {"type": "object", "required": 5}, {"type": "number", "minimum": float("inf")}, DEEP]
REGEXES = ["((", "a{5,2}", "(?=a)", r"(a)\1", "a{-1}", "[z-a]", "\ud800", "", "a\x00", "(a|", "*"]
GRAMMARS = ["root ::= ", "foo ::= \"a\"", "root ::= root", "root ::= \"\ud800\"", "root ::= [", "root ::= \"a\" |"]

CHAT_FIELDS = ["messages", "model", "tools", "tool_choice", "response_format", "logit_bias", "logprobs",
               "top_logprobs", "n", "stop", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k",
               "min_p", "seed", "stream", "stream_options", "stop_token_ids", "min_tokens", "prompt_logprobs",
               "presence_penalty", "repetition_penalty", "chat_template_kwargs", "thinking", "reasoning_effort",
               "continue_final_message", "add_generation_prompt", "parallel_tool_calls", "include_reasoning",
               "guided_json", "guided_regex", "guided_choice", "guided_grammar", "structured_outputs", "user"]
COMPLETION_FIELDS = ["prompt", "model", "echo", "logprobs", "best_of", "suffix", "skip_special_tokens", "n", "stop",
                     "max_tokens", "temperature", "top_p", "top_k", "seed", "stream", "logit_bias", "stop_token_ids",
                     "min_tokens", "prompt_logprobs", "guided_json", "guided_regex", "guided_choice",
                     "structured_outputs", "frequency_penalty"]
NESTED = [("messages", 0, "content"), ("messages", 0, "role"), ("messages", 1, "tool_calls", 0, "function", "arguments"),
          ("messages", 1, "tool_calls", 0, "function", "name"), ("messages", 1, "content"), ("messages", 0, "prefix"),
          ("tools", 0, "function", "parameters"), ("tools", 0, "function", "parameters", "properties", "city"),
          ("tools", 0, "function", "name"), ("tools", 0, "type"), ("tool_choice", "function", "name"),
          ("response_format", "json_schema", "schema"), ("response_format", "type"), ("stream_options", "include_usage")]


def chat_body() -> dict:
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
    call = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    return {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None, "tool_calls": [call]},
                         {"role": "tool", "tool_call_id": "c1", "content": "sunny"}],
            "tools": [tool], "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
            "response_format": {"type": "text", "json_schema": {"schema": {}}}, "stream_options": {"include_usage": True},
            "max_tokens": 2, "temperature": 0}


def completion_body() -> dict:
    return {"prompt": "def add(a, b):", "max_tokens": 2, "temperature": 0}


def _set(body: dict, path: tuple, value) -> None:
    """body[path] = value, unless an earlier mutation replaced a container on the path."""
    node = body
    try:
        for key in path[:-1]:
            node = node[key]
        if isinstance(node, (dict, list)):
            node[path[-1]] = value
    except (KeyError, IndexError, TypeError):
        pass


def _value(rng: random.Random, field: str):
    if field in ("guided_json", "response_format") or field.endswith("parameters") and rng.random() < 0.5:
        schema = rng.choice(SCHEMAS)
        return {"type": "json_schema", "json_schema": {"schema": schema}} if field == "response_format" else schema
    if field == "guided_regex":
        return rng.choice(REGEXES)
    if field == "guided_grammar":
        return rng.choice(GRAMMARS)
    if field == "structured_outputs":
        kind = rng.choice(["json", "regex", "grammar", "choice", "json_object"])
        pool = {"json": SCHEMAS, "regex": REGEXES, "grammar": GRAMMARS}.get(kind, VALUES)
        return {kind: rng.choice(pool)}
    return rng.choice(VALUES)


def hostile_case(rng: random.Random) -> tuple[str, bytes]:
    """(path, raw body) of one case."""
    is_chat = rng.random() < 0.6
    path, body = (CHAT, chat_body()) if is_chat else (COMPLETIONS, completion_body())
    for _ in range(rng.choice([1, 1, 1, 2, 3])):
        if is_chat and rng.random() < 0.35:
            where = rng.choice(NESTED)
            _set(body, where, _value(rng, where[-1] if isinstance(where[-1], str) else ""))
        else:
            field = rng.choice(CHAT_FIELDS if is_chat else COMPLETION_FIELDS)
            body[field] = _value(rng, field)
    if body.get("max_tokens") is None and body.get("max_completion_tokens") is None:
        body["max_tokens"] = 2                       # (a default would run to the end of the context)
    raw = json.dumps(body).encode()
    cut = rng.random()
    if cut < 0.08:
        raw = raw[:rng.randrange(len(raw))]
    elif cut < 0.14:
        at = rng.randrange(len(raw))
        raw = raw[:at] + bytes([rng.randrange(256)]) + raw[at + 1:]
    elif cut < 0.17:
        raw = b"[" + raw + b"]"
    return path, raw


def check_answer(r, raw: bytes) -> None:
    assert r.status_code < 500, (raw[:300], r.text[:500])
    if r.status_code >= 400:
        error = r.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["message"], r.text
        return
    assert r.status_code == 200, r.text
    if r.headers["content-type"].startswith("text/event-stream"):
        events = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]", (raw[:300], r.text[-500:])
        assert all("error" not in json.loads(e) for e in events[:-1]), (raw[:300], r.text[-500:])
    else:
        assert r.json()["choices"], r.text


class Victim:
    """Sends the same greedy request again and again until stopped; keeps every text."""

    def __init__(self, http):
        self.http, self.texts, self.stop = http, [], threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stop.is_set():
            r = self.http.post(COMPLETIONS, json=VICTIM)
            self.texts.append(r.json()["choices"][0]["text"] if r.status_code == 200 else r.text)

    def finish(self) -> list[str]:
        self.stop.set()
        self.thread.join(60)
        return self.texts


@pytest.fixture
def victim_http(real_server):
    import httpx

    from serve.server_fixtures import API_KEY
    with httpx.Client(base_url=real_server.base_url, headers={"Authorization": f"Bearer {API_KEY}"},
                      timeout=60, trust_env=False) as client:
        yield client


def test_hostile_bodies_get_4xx_and_touch_nobody(http, victim_http):
    alone = http.post(COMPLETIONS, json=VICTIM).json()["choices"][0]["text"]
    rng = random.Random(SEED)
    statuses: dict[int, int] = {}
    victim = Victim(victim_http)
    try:
        for _ in range(CASES):
            path, raw = hostile_case(rng)
            r = http.post(path, content=raw, headers={"Content-Type": "application/json"})
            statuses[r.status_code] = statuses.get(r.status_code, 0) + 1
            check_answer(r, raw)
    finally:
        texts = victim.finish()
    assert statuses.get(200, 0) > 10 and statuses.get(400, 0) > CASES // 2, statuses
    assert texts and all(text == alone for text in texts), (alone, [t for t in texts if t != alone][:3])
    assert http.get("/health").status_code == 200


# ---- tool schemas against the calls a model writes (the scripted engine core) ------------------
KEYWORDS = ["type", "anyOf", "oneOf", "allOf", "enum", "const", "items", "properties", "required", "$ref", "$defs",
            "minLength", "maxLength", "pattern", "default"]
TYPE_NAMES = ["string", "integer", "number", "boolean", "array", "object", "null", "int", "weird"]


def random_schema(rng: random.Random, depth: int = 0):
    """A JSON-schema-like tree whose keywords hold any kind of value."""
    if depth > 3 or rng.random() < 0.2:
        return rng.choice(VALUES + TYPE_NAMES)
    schema = {}
    for key in rng.sample(KEYWORDS, rng.randint(1, 3)):
        pick = rng.random()
        schema[key] = (rng.choice(TYPE_NAMES) if key == "type" and pick < 0.5
                       else rng.choice(VALUES) if pick < 0.65
                       else [random_schema(rng, depth + 1) for _ in range(rng.randint(0, 3))] if pick < 0.85
                       else {"city": random_schema(rng, depth + 1)})
    return schema


def test_odd_tool_schemas_never_break_the_parsing_of_a_call(fake_server):
    import httpx
    rng = random.Random(SEED)
    with httpx.Client(base_url=fake_server.base_url, trust_env=False, timeout=30) as http:
        for _ in range(100):
            props = {"city": random_schema(rng), "days": random_schema(rng)}
            tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
                "type": "object", "properties": props, "required": rng.choice([["city"], 5, "city", [None]])}}}]
            script = rng.choice(["tool", "typed_tool", "wrapped_tool", "cut_tool"])
            raw = json.dumps({"messages": [{"role": "user", "content": f"[[{script}]]"}], "tools": tools,
                              "stream": rng.random() < 0.5}).encode()
            r = http.post(CHAT, content=raw, headers={"Content-Type": "application/json"})
            check_answer(r, raw)
