"""`dsv4 bench serve` end to end against the fake streaming server of conftest.py."""
import argparse
import json
import random
import socket

import pytest

from dsv4.bench.serve import ServeBenchConfig, run_serve_benchmark
from dsv4.bench.random_prompts import FIRST_PLAIN_TOKEN_ID
from dsv4.bench.serve_metrics import LATENCIES, STATISTICS
from dsv4.cli import bench as bench_cli


def bench(server_url: str, **overrides) -> dict:
    cfg = dict(base_url=server_url, model="fake", input_len=16, output_len=5, num_prompts=10,
               max_concurrency=3, vocab_size=1000, show_progress=False)
    cfg.update(overrides)
    return run_serve_benchmark(ServeBenchConfig(**cfg))


def cli(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="dsv4")
    bench_cli.register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.func(args)


def test_completions_run_counts_requests_and_tokens(fake_server):
    server = fake_server()
    result = bench(server.base_url)
    assert (result["completed"], result["failed"]) == (10, 0)
    assert result["total_input_tokens"] == 10 * 16
    assert result["total_output_tokens"] == 10 * 5
    assert result["output_throughput"] == pytest.approx(50 / result["duration"])
    assert 0 < result["mean_ttft_ms"] <= result["mean_e2el_ms"]
    assert result["p99_ttft_ms"] <= result["p99_e2el_ms"]
    for metric, _, _ in LATENCIES:
        assert result[f"median_{metric}_ms"] <= result[f"p99_{metric}_ms"]
    assert result["mean_tpot_ms"] > 0 and result["mean_itl_ms"] > 0


def test_requests_ask_for_exactly_output_len_tokens_with_usage(fake_server):
    server = fake_server()
    bench(server.base_url, num_prompts=4, seed=7)
    assert len(server.requests) == 4
    for path, body in server.requests:
        assert path == "/v1/completions"
        assert body["max_tokens"] == 5 and body["ignore_eos"] is True and body["stream"] is True
        assert body["stream_options"] == {"include_usage": True} and body["model"] == "fake"
        assert len(body["prompt"]) == 16 and all(FIRST_PLAIN_TOKEN_ID <= t < 1000 for t in body["prompt"])
    assert len({tuple(body["prompt"]) for _, body in server.requests}) == 4  # no shared prefixes


def test_server_errors_are_counted_as_failures(fake_server):
    server = fake_server(fail_every=3)  # requests 3, 6, 9 of 10 fail
    result = bench(server.base_url)
    assert (result["completed"], result["failed"]) == (7, 3)
    assert result["total_output_tokens"] == 7 * 5
    assert len(result["errors"]) == 3 and all(e.startswith("HTTP 500") for e in result["errors"])


def test_error_inside_the_stream_fails_the_request(fake_server):
    result = bench(fake_server(stream_error=True).base_url, num_prompts=2)
    assert (result["completed"], result["failed"]) == (0, 2)
    assert "engine failed" in result["errors"][0]


def test_unreachable_server_fails_every_request_without_raising():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again before the run: nothing listens there
    result = bench(f"http://127.0.0.1:{port}", num_prompts=3)
    assert (result["completed"], result["failed"]) == (0, 3)
    assert result["total_output_tokens"] == 0 and result["mean_ttft_ms"] == 0.0


def test_output_tokens_prefer_usage_over_the_chunk_count(fake_server):
    server = fake_server(tokens_per_chunk=2)  # 5 tokens arrive as chunks of 2, 2, 1
    result = bench(server.base_url, num_prompts=2)
    assert result["total_output_tokens"] == 10


def test_without_usage_output_tokens_are_counted_from_chunks(fake_server):
    server = fake_server(send_usage=False, tokens_per_chunk=2)
    result = bench(server.base_url, num_prompts=2)
    assert result["completed"] == 2
    assert result["total_output_tokens"] == 2 * 3  # chunks per request
    assert result["total_input_tokens"] == 2 * 16  # the prompt as sent


def test_chat_endpoint_sends_word_prompts(fake_server):
    server = fake_server()
    result = bench(server.base_url, endpoint="/v1/chat/completions", num_prompts=3, input_len=12)
    assert (result["completed"], result["total_output_tokens"], result["total_input_tokens"]) == (3, 15, 36)
    for path, body in server.requests:
        assert path == "/v1/chat/completions" and body["ignore_eos"] is True
        assert len(body["messages"][0]["content"].split()) == 12


def test_max_concurrency_bounds_requests_in_flight(fake_server):
    server = fake_server(chunk_delay=0.005)
    result = bench(server.base_url, num_prompts=8, output_len=3, max_concurrency=2)
    assert result["completed"] == 8 and server.max_in_flight == 2


def test_request_rate_spaces_arrivals(fake_server):
    rate, seed = 100.0, 3
    arrivals = random.Random(seed + 1)
    gaps = sum(arrivals.expovariate(rate) for _ in range(4))
    result = bench(fake_server().base_url, num_prompts=5, request_rate=rate, seed=seed)
    assert result["completed"] == 5 and result["duration"] >= gaps
    assert result["request_rate"] == rate


def test_cli_prints_table_json_last_and_saves_result(fake_server, tmp_path, capsys):
    server = fake_server(fail_every=4)
    saved = tmp_path / "result.json"
    code = cli(["bench", "serve", "--base-url", server.base_url, "--model", "fake", "--dataset", "random",
                "--input-len", "8", "--output-len", "4", "--num-prompts", "8", "--max-concurrency", "4",
                "--seed", "1", "--vocab-size", "500", "--endpoint", "/v1/completions",
                "--save-result", str(saved), "--json"])
    out = capsys.readouterr().out.strip().splitlines()
    assert code == 0
    result = json.loads(out[-1])
    assert (result["completed"], result["failed"], result["total_output_tokens"]) == (6, 2, 24)
    assert json.loads(saved.read_text()) == result
    assert any(line.startswith("Successful requests:") and line.split()[-1] == "6" for line in out)
    assert any(line.startswith("Failed requests:") and line.split()[-1] == "2" for line in out)
    keys = {"completed", "failed", "duration", "request_throughput", "output_throughput",
            "total_token_throughput", "total_input_tokens", "total_output_tokens", "errors",
            "base_url", "model", "endpoint", "input_len", "output_len", "num_prompts",
            "max_concurrency", "request_rate", "seed"}
    keys |= {f"{stat}_{metric}_ms" for metric, _, _ in LATENCIES for stat, _ in STATISTICS}
    assert keys <= set(result) and result["request_rate"] == "inf"


def test_cli_exit_code_is_1_when_every_request_fails(fake_server, capsys):
    server = fake_server(fail_every=1)
    code = cli(["bench", "serve", "--base-url", server.base_url, "--model", "m", "--input-len", "4",
                "--output-len", "2", "--num-prompts", "3", "--vocab-size", "500", "--disable-tqdm"])
    assert code == 1 and "Failed requests:" in capsys.readouterr().out


def test_cli_rejects_bad_flags_naming_them(capsys):
    with pytest.raises(SystemExit):
        cli(["bench", "serve", "--base-url", "http://x", "--model", "m", "--num-prompts", "0"])
    assert "--num-prompts" in capsys.readouterr().err
    assert cli(["bench", "serve", "--base-url", "localhost:8000", "--model", "m"]) == 2
    assert "base_url" in capsys.readouterr().err


def test_bench_modes_are_nested_subcommands():
    seen = []
    bench_cli.add_mode("probe", "a test mode", lambda p: p.add_argument("--n", type=int),
                       lambda args: seen.append(args.n) or 0)
    try:
        assert cli(["bench", "probe", "--n", "3"]) == 0 and seen == [3]
        with pytest.raises(ValueError, match="already registered"):
            bench_cli.add_mode("serve", "again", lambda p: None, lambda a: 0)
    finally:
        del bench_cli.MODES["probe"]
