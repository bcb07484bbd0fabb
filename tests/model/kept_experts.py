"""Checks shared by the kept-quantised-experts tests (test_keep_fp8.py, test_keep_mxfp4.py;
imported by file name: this folder is on sys.path while its tests run)."""
import torch

from dsv4.config import EngineConfig
from dsv4.engine.llm import LLM
from dsv4.engine.oneshot import full_logits
from dsv4.sampling_params import SamplingParams
from dsv4.model.random_init import preset_config, random_state, save_checkpoint


def assert_same_logits(plain, kept) -> None:
    """fp32 logits of 40 random tokens: the model with kept experts == the one dequantised at load."""
    ids = torch.randint(0, plain.cfg.vocab_size, (40,), generator=torch.Generator().manual_seed(0)).tolist()
    want, got = full_logits(plain, ids), full_logits(kept, ids)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())


def assert_same_greedy_tokens(checkpoint: str, flag: str, kept_dtype: torch.dtype) -> None:
    """Through the engine (EngineConfig.<flag> -> load_model), prefill and decode steps: the same
    greedy tokens with the experts kept (as kept_dtype) as dequantised at load."""
    prompts = [torch.randint(2, 512, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (5, 19)]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    outs = {}
    for keep in (False, True):
        llm = LLM(checkpoint, max_num_seqs=2, num_pages=4, **{flag: keep})
        assert llm.engine.config == EngineConfig(max_num_seqs=2, num_pages=4, **{flag: keep})
        assert (llm.engine.model.layers[1].ffn.experts.w1.dtype == kept_dtype) == keep
        outs[keep] = [o.token_ids for o in llm.generate(prompt_token_ids=prompts, sampling_params=params,
                                                        use_tqdm=False)]
    assert outs[True] == outs[False] and all(len(t) == 12 for t in outs[True])


def released_checkpoint(tmp_path_factory, moe_intermediate_size: int, expert_dtype: str) -> str:
    """A tiny 2-layer checkpoint (+ MTP) in the released format (FP8 projections), its routed
    experts FP8 or MXFP4 (expert_dtype "fp8" / "fp4"), written once per test module."""
    cfg = preset_config("tiny", 2, moe_intermediate_size=moe_intermediate_size)
    path = str(tmp_path_factory.mktemp(f"{expert_dtype}-experts"))
    save_checkpoint(cfg, random_state(cfg, seed=3), path, quant="fp8", expert_dtype=expert_dtype)
    return path
