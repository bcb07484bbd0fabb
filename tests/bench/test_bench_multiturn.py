"""`dsv4 bench serve --dataset multiturn`: conversations whose every turn resends the whole
history, against the fake streaming server (request bodies, failures) and against dsv4's own
server on the demo checkpoint (prefix-cache hits from the second turn on)."""
import json
import sys
from pathlib import Path

import pytest

from dsv4.bench.serve import ServeBenchConfig, run_serve_benchmark

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # tests/, for serve.server_fixtures
pytest_plugins = ["serve.server_fixtures"]


def multiturn(url: str, **overrides) -> dict:
    cfg = dict(base_url=url, model="fake", input_len=6, output_len=3, num_prompts=3, num_turns=4,
               dataset="multiturn", endpoint="/v1/chat/completions", max_concurrency=2, show_progress=False)
    cfg.update(overrides)
    return run_serve_benchmark(ServeBenchConfig(**cfg))


def test_each_turn_resends_the_history_with_the_answers(fake_server):
    server = fake_server()
    result = multiturn(server.base_url, prefix_len=5)
    assert (result["completed"], result["failed"]) == (12, 0)
    assert result["num_turns"] == 4 and len(result["mean_ttft_ms_by_turn"]) == 4
    bodies = [body for _, body in server.requests]
    by_system = {}
    for body in bodies:
        by_system.setdefault(json.dumps(body["messages"][1]), []).append(body["messages"])
    assert len(by_system) == 3, "three conversations, told apart by their first user turn"
    systems = {json.dumps(b["messages"][0]) for b in bodies}
    assert len(systems) == 1 and bodies[0]["messages"][0]["role"] == "system", "one shared system prompt"
    for turns in by_system.values():
        assert [len(m) for m in turns] == [2, 4, 6, 8]
        for prev, nxt in zip(turns, turns[1:]):
            assert nxt[:len(prev)] == prev
            assert nxt[len(prev)] == {"role": "assistant", "content": "tok tok tok "}
            assert nxt[-1]["role"] == "user" and len(nxt[-1]["content"].split()) == 6


def test_completions_history_is_one_growing_text(fake_server):
    server = fake_server()
    multiturn(server.base_url, endpoint="/v1/completions", num_prompts=1, num_turns=3)
    prompts = [body["prompt"] for _, body in server.requests]
    assert len(prompts) == 3 and all(isinstance(p, str) for p in prompts)
    assert prompts[1].startswith(prompts[0] + "tok tok tok ") and prompts[2].startswith(prompts[1])


def test_a_failed_turn_ends_its_conversation(fake_server):
    server = fake_server(fail_every=2)            # the second request fails: conversation 1, turn 2
    result = multiturn(server.base_url, num_prompts=1, num_turns=4, max_concurrency=1)
    assert (result["completed"], result["failed"]) == (1, 3) and len(server.requests) == 2
    assert "earlier turn" in result["errors"][-1]


def test_multiturn_flags_belong_to_the_multiturn_dataset():
    with pytest.raises(ValueError, match="multiturn dataset"):
        ServeBenchConfig(base_url="http://x", model="m", input_len=1, output_len=1, num_prompts=1, num_turns=3)


def test_multiturn_against_the_dsv4_server_hits_from_the_second_turn(real_server, capsys):
    from serve.server_fixtures import API_KEY

    from dsv4.cli import main
    code = main(["bench", "serve", "--base-url", real_server.base_url, "--model", "dsv4-test", "--dataset",
                 "multiturn", "--endpoint", "/v1/chat/completions", "--num-prompts", "2", "--num-turns", "3",
                 "--prefix-len", "190", "--input-len", "40", "--output-len", "8", "--max-concurrency", "2",
                 "--api-key", API_KEY, "--disable-tqdm", "--json"])
    assert code == 0
    out = capsys.readouterr().out
    result = json.loads(out.strip().splitlines()[-1])
    assert (result["completed"], result["failed"]) == (6, 0), result.get("errors")
    rates = result["prefix_cache_hit_rate_by_turn"]
    assert rates[1] > 0.3 and rates[2] > 0.3, rates
    assert result["total_cached_tokens"] >= 4 * 256 and "Per turn" in out
