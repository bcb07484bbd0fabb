"""`dsv4 convert`: every output of a released-format (FP8 + MXFP4) random checkpoint passes
`dsv4 check`; the summary says what was written; bad flags get a message naming the flag.
Also the new user's case: what transformers' `save_pretrained` writes passes `dsv4 check`."""
from __future__ import annotations

import os
import re

import pytest

from dsv4.cli import main
from dsv4.model.checkpoint_reader import checkpoint_keys


@pytest.fixture(scope="module")
def released(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("convert-cli") / "fp8")
    assert main(["init-random", path, "--quant", "fp8"]) == 0
    return path


def check_passes(path: str, capsys) -> None:
    capsys.readouterr()
    assert main(["check", "--model", path, "--prompt-len", "64"]) == 0
    assert "PASS" in capsys.readouterr().out


@pytest.mark.parametrize("flags", [["--to", "bf16"], ["--fp8-scales", "fp32"],
                                   ["--to", "bf16", "--names", "transformers"], ["--drop-mtp"]])
def test_each_output_passes_check(flags, released, tmp_path, capsys):
    out = str(tmp_path / "out")
    capsys.readouterr()
    assert main(["convert", released, out, "--quiet", *flags]) == 0
    summary = capsys.readouterr().out
    written = rf"wrote {re.escape(out)}: \d+ tensors in 1 shard, [\d.]+ MiB written \([\d.]+ MiB read\)"
    assert re.search(written, summary)
    if "bf16" in flags:
        assert re.search(r", \d+ weights dequantised", summary)
    if "fp32" in flags:
        assert re.search(r", \d+ FP8 scales rewritten", summary)
    check_passes(out, capsys)


def test_extract_mtp_alone_and_with_out(released, tmp_path, capsys):
    draft, out = str(tmp_path / "draft"), str(tmp_path / "main")
    assert main(["convert", released, "--extract-mtp", draft, "--quiet"]) == 0
    assert all(k.startswith("mtp.") or k in ("embed.weight", "head.weight") for k in checkpoint_keys(draft))
    assert main(["convert", released, out, "--drop-mtp", "--extract-mtp", str(tmp_path / "draft2"), "--quiet"]) == 0
    assert set(checkpoint_keys(str(tmp_path / "draft2"))) == set(checkpoint_keys(draft))
    assert not any(k.startswith("mtp.") for k in checkpoint_keys(out))


def test_progress_bar_on_stderr(released, tmp_path, capsys):
    assert main(["convert", released, str(tmp_path / "out"), "--to", "bf16"]) == 0
    assert "100%" in capsys.readouterr().err


@pytest.mark.parametrize("argv,message", [
    ([], "give OUT, --extract-mtp DRAFT, or both"),
    (["--drop-mtp", "--extract-mtp", "D"], "--drop-mtp applies to OUT"),
    (["OUT", "--to", "bf16", "--fp8-scales", "e8m0"], "--fp8-scales: no FP8 scales remain with --to bf16"),
    (["OUT", "--names", "transformers"], "--names transformers: transformers' names have no layout for FP8/MXFP4"),
])
def test_bad_flags_are_named(argv, message, released, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit, match=re.escape(f"dsv4 convert: {message}")):
        main(["convert", released, *argv])
    assert os.listdir(tmp_path) == []


def test_bad_folders_are_named(released, tmp_path):
    with pytest.raises(SystemExit, match="SRC .* is not a folder"):
        main(["convert", str(tmp_path / "missing"), str(tmp_path / "out")])
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "file").write_text("")
    with pytest.raises(SystemExit, match="exists and is not an empty folder"):
        main(["convert", released, str(tmp_path / "busy")])
    with pytest.raises(SystemExit, match="the source is never modified"):
        main(["convert", released, released])


def test_transformers_save_pretrained_output_passes_check(released, tmp_path, capsys):
    """The issue's new user: a V4 model saved with transformers' own save_pretrained."""
    from dsv4.model.reference import load_reference

    out = str(tmp_path / "saved")
    load_reference(released).save_pretrained(out)
    assert "model.layers.0.attn.norm.weight" in checkpoint_keys(out)
    check_passes(out, capsys)
