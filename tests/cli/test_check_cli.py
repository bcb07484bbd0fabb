"""`dsv4 check`: passes on `dsv4 init-random` checkpoints of both naming schemes (and FP8),
fails when the logits disagree beyond the tolerance, and says how to install transformers
when it is missing (exit status 2)."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from dsv4.cli import main


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("check")
    made = {}
    for label, flags in (("deepseek", []), ("transformers", ["--names", "transformers"]),
                         ("fp8", ["--quant", "fp8"])):
        made[label] = str(root / label)
        assert main(["init-random", made[label], *flags]) == 0
    return made


def run_check(capsys, *argv):
    capsys.readouterr()
    code = main(["check", *argv])
    return code, capsys.readouterr().out


@pytest.mark.parametrize("label", ["deepseek", "transformers", "fp8"])
def test_check_passes_on_init_random_checkpoints(label, checkpoints, capsys):
    code, out = run_check(capsys, "--model", checkpoints[label], "--json")
    result = json.loads(out.strip().splitlines()[-1])
    assert code == 0 and "PASS" in out
    assert result["ok"] is True and result["tolerance"] == 1e-4 and result["positions"] == 300
    assert 0 < result["max_abs_diff"] <= 1e-4 * result["ref_scale"]
    assert result["argmax_agree"] >= 0.99


def test_check_fails_beyond_the_tolerance(checkpoints, capsys):
    code, out = run_check(capsys, "--model", checkpoints["deepseek"], "--prompt-len", "64", "--tolerance", "1e-12")
    assert code == 1 and "FAIL" in out


def test_check_refuses_empty_prompts(checkpoints):
    with pytest.raises(SystemExit, match="--prompt-len and --num-prompts must be at least 1"):
        main(["check", "--model", checkpoints["deepseek"], "--prompt-len", "0"])


def test_check_without_transformers_says_how_to_install(checkpoints):
    script = ("import sys; sys.modules['transformers'] = None\n"
              "from dsv4.cli import main\n"
              f"sys.exit(main(['check', '--model', {checkpoints['deepseek']!r}, '--prompt-len', '16']))")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert "pip install 'dsv4[check]'" in proc.stdout
    assert "Traceback" not in proc.stderr


def test_check_reports_kept_fp8_dense_agreement(checkpoints, capsys):
    """--keep-fp8-dense: W8A16 multiplies by the dequantised weight (passes the fp32 tolerance);
    W8A8 quantises the activations too, and its agreement is reported (larger differences)."""
    out = {}
    for gemm in ("w8a16", "w8a8"):
        code, text = run_check(capsys, "--model", checkpoints["fp8"], "--prompt-len", "64", "--keep-fp8-dense",
                               "--fp8-gemm", gemm, "--tolerance", "1", "--json")
        assert code == 0 and f"{gemm.upper()} GEMMs" in text
        out[gemm] = json.loads(text.strip().splitlines()[-1])
        assert out[gemm]["fp8_gemm"] == gemm
    assert out["w8a16"]["max_abs_diff"] <= 1e-4 * out["w8a16"]["ref_scale"]
    assert out["w8a8"]["max_abs_diff"] > out["w8a16"]["max_abs_diff"] and out["w8a8"]["argmax_agree"] >= 0.8
    from dsv4.ops import quant_gemm
    assert quant_gemm.FP8_DENSE_GEMM == "w8a16"                    # restored after the run
    with pytest.raises(SystemExit, match="--fp8-gemm needs --keep-fp8-dense"):
        main(["check", "--model", checkpoints["fp8"], "--fp8-gemm", "w8a8"])


def test_check_reports_the_fp8_kv_gap(checkpoints, capsys):
    """--kv-cache-dtype fp8: the oracle gap with the packed FP8 KV cache, under the FP8 tolerance
    (median position, greedy agreement), larger than the model-dtype cache's gap."""
    code, out = run_check(capsys, "--model", checkpoints["deepseek"], "--kv-cache-dtype", "fp8", "--json")
    result = json.loads(out.strip().splitlines()[-1])
    assert code == 0 and result["ok"] is True and result["kv_cache_dtype"] == "fp8"
    assert result["tolerance"] == 5e-2 and result["argmax_agree"] >= 0.85
    assert 1e-4 * result["ref_scale"] < result["max_abs_diff"]            # FP8 is not the fp32 cache
    assert result["median_abs_diff"] <= 5e-2 * result["ref_scale"]
