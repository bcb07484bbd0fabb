"""`dsv4 bench serve` against dsv4's own server (the demo checkpoint on CPU)."""
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # tests/, for serve.server_fixtures
pytest_plugins = ["serve.server_fixtures"]


@pytest.mark.parametrize("endpoint", ["/v1/completions", "/v1/chat/completions"])
def test_bench_serve_against_the_dsv4_server(real_server, demo_dir, endpoint, capsys):
    from serve.server_fixtures import API_KEY

    from dsv4.cli import main
    from dsv4.text.tokenizer import Tokenizer
    vocab = Tokenizer.from_dir(demo_dir).vocab_size
    code = main(["bench", "serve", "--base-url", real_server.base_url, "--model", "dsv4-test", "--endpoint", endpoint,
                 "--input-len", "16", "--output-len", "8", "--num-prompts", "6", "--max-concurrency", "3",
                 "--vocab-size", str(vocab), "--api-key", API_KEY, "--disable-tqdm", "--json"])
    assert code == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert (result["completed"], result["failed"]) == (6, 0), result.get("errors")
    assert result["total_output_tokens"] == 6 * 8
    if endpoint == "/v1/completions":
        assert result["total_input_tokens"] == 6 * 16
    assert 0 < result["mean_ttft_ms"] <= result["mean_e2el_ms"] and result["mean_tpot_ms"] > 0
