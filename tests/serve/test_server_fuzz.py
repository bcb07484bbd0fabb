"""A schema-driven fuzzer: schemathesis generates requests from the server's own
`/openapi.json` (bodies that follow the schema, and bodies that break it) and sends them to
the API process, wired to the scripted engine core so that a valid request really runs. No
response may be a 5xx, every JSON error must be in OpenAI's shape, and the server must stay
up. Bounded and deterministic: `MAX_EXAMPLES` cases over the operations that take input,
derandomized.
(Driven through hypothesis directly: schemathesis' pytest plugin does not run on pytest 9.)"""
import httpx
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode

pytest_plugins = ["serve.server_fixtures"]

MAX_EXAMPLES = 100


def test_no_request_gets_a_5xx(fake_server):
    schema = schemathesis.openapi.from_url(fake_server.base_url + "/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    takes_input = [op for op in operations if op.method.upper() == "POST" or "{" in op.path]
    operations = [op for op in takes_input if op.path != "/reset_prefix_cache"]              # it takes no input
    assert len(operations) == len(takes_input) - 1
    assert {op.path for op in operations} == {"/v1/chat/completions", "/v1/completions", "/tokenize", "/detokenize",
                                              "/v1/models/{model_id}"}
    strategies = [op.as_strategy(generation_mode=mode) for op in operations
                  for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE)]
    seen: dict[int, int] = {}

    @settings(max_examples=MAX_EXAMPLES, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    @given(st.data())
    def fuzz(data):
        case = data.draw(st.one_of(strategies))
        response = case.call(base_url=fake_server.base_url, timeout=30)
        seen[response.status_code] = seen.get(response.status_code, 0) + 1
        assert response.status_code < 500, (case.method, case.path, case.body, response.text[:500])
        if response.status_code >= 400 and response.headers.get("content-type", [""])[0].startswith("application/json"):
            error = response.json()["error"]
            assert set(error) == {"message", "type", "param", "code"}, response.text

    fuzz()
    assert any(code < 300 for code in seen) and any(code >= 400 for code in seen), seen
    with httpx.Client(base_url=fake_server.base_url, trust_env=False, timeout=30) as http:
        assert http.get("/health").status_code == 200
        r = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "[[plain]]"}]})
        assert r.json()["choices"][0]["message"]["content"] == "Hello from the fake engine."
