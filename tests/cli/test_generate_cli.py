"""`dsv4 generate` on a checkpoint written by `dsv4 init-random --preset tiny`: prints the
generated token ids, and (with --show-memory) the KV cache report: pages, tokens and requests
that fit. Bad input exits with a message naming the field."""
from __future__ import annotations

import re

import pytest

from dsv4.cli import main


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("cli-tiny") / "tiny")
    assert main(["init-random", path, "--preset", "tiny"]) == 0
    return path


def generate(checkpoint, *extra):
    return main(["generate", "--model", checkpoint, "--prompt-ids", "1,2,3", "--max-tokens", "5",
                 "--temperature", "0", "--num-pages", "8", "--max-num-seqs", "4", *extra])


def token_lines(out: str) -> list[list[int]]:
    return [[int(t) for t in line.split("token ids:")[1].split()]
            for line in out.splitlines() if "token ids:" in line]


def test_generate_prints_token_ids(checkpoint, capsys):
    capsys.readouterr()
    assert main(["generate", "--model", checkpoint, "--prompt-ids", "1,2,3", "--max-tokens", "5",
                 "--temperature", "0"]) == 0
    out = capsys.readouterr().out
    [tokens] = token_lines(out)
    assert len(tokens) == 5 and all(0 <= t < 512 for t in tokens)
    assert "[length]" in out

    from dsv4.engine.llm import LLM
    from dsv4.sampling_params import SamplingParams
    [want] = LLM(checkpoint, num_pages=8, max_num_seqs=4).generate(
        prompt_token_ids=[[1, 2, 3]], sampling_params=SamplingParams(temperature=0, max_tokens=5), use_tqdm=False)
    assert tokens == want.token_ids      # the same greedy tokens as the offline API


def test_generate_reports_memory(checkpoint, capsys):
    capsys.readouterr()
    assert generate(checkpoint, "--show-memory", "--max-model-len", "1024") == 0
    out = capsys.readouterr().out
    [memory] = [line for line in out.splitlines() if "history pages x" in line]
    assert re.search(r"\b8 history pages x 256 tokens = 2048 tokens\b", memory)
    assert "weights:" in out and "fits: 2048 tokens of history" in out        # then the memory plan
    assert re.search(r"\b4 request slots\b", memory)
    assert re.search(r"\b2 request\(s\) of max_model_len 1024 fit at once", memory)
    assert len(token_lines(out)) == 1


def test_generate_two_prompts(checkpoint, capsys):
    capsys.readouterr()
    assert main(["generate", "--model", checkpoint, "--prompt-ids", "1,2,3", "--prompt-ids", "4,5",
                 "--max-tokens", "3", "--temperature", "0", "--num-pages", "8"]) == 0
    assert [len(t) for t in token_lines(capsys.readouterr().out)] == [3, 3]


@pytest.mark.parametrize("extra, field", [
    (["--prompt-ids", "1,2,999"], "prompt_token_ids"),
    (["--max-tokens", "0"], "max_tokens"),
    (["--top-p", "1.5"], "top_p"),
    (["--temperature", "-1"], "temperature"),
])
def test_generate_bad_input_names_the_field(checkpoint, capsys, extra, field):
    capsys.readouterr()
    args = ["generate", "--model", checkpoint, "--prompt-ids", "1,2,3", "--max-tokens", "5", "--num-pages", "8"]
    assert main(args + extra) == 2
    err = capsys.readouterr().err
    assert f"{field}:" in err and not token_lines(err)


def test_generate_rejects_non_integer_ids(checkpoint):
    with pytest.raises(SystemExit, match="--prompt-ids"):
        main(["generate", "--model", checkpoint, "--prompt-ids", "1,x"])
