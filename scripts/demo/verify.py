"""Check an exported demo checkpoint against the definition it was trained with: dsv4 loads it,
and dsv4's main-model logits (one paged prefill) and MTP logits (`MTPBlock.draft` at positions
t fed x_{t+1}, then `MTPBlock.logits`) must match the training model's (transformers'
DeepseekV4ForCausalLM + the MTP head of scripts/demo/model.py) in fp32 on CPU.

    python -m scripts.demo.verify dsv4/assets/demo
"""
from __future__ import annotations

import json
import os
import sys

import torch


from scripts.demo import model as demo_model


@torch.no_grad()
def dsv4_logits(model_dir: str, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """dsv4 fp32 CPU, as the training definition sees `ids` (n tokens): main logits [n-2, V]
    from a prefill of ids[:-2], and MTP logits [n-2, V] from `MTPBlock.draft` at positions t
    fed x_{t+1} = ids[1:-1]. (The main model gets exactly the training model's input: a top-k
    over tied indexer scores may otherwise pick differently for another input length.)"""
    from dsv4.engine.oneshot import OneSequence
    from dsv4.model.weights import load_model

    model = load_model(model_dir)
    one = OneSequence(model, len(ids) - 2, with_mtp=True)
    batch, kv = one.batch, one.storage.layers

    fb = batch(ids[:-2])
    h = model(fb, kv)
    main = model.logits(h[fb.logits_rows])
    fb_mtp = batch(ids[1:-1])          # token x_{t+1} at position t
    mtp = model.mtp[0]
    draft = mtp.draft(model, h, fb_mtp, kv)
    return main, mtp.logits(model, draft[fb_mtp.logits_rows])


@torch.no_grad()
def training_logits(model: demo_model.DemoModel, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The training definition: main [n-2, V] and MTP [n-2, V] logits."""
    model.eval()
    main, mtp, _ = model(torch.tensor([ids]))
    return main[0].float(), mtp[0].float()


def compare(model: demo_model.DemoModel, model_dir: str, ids: list[int]) -> dict:
    ours_main, ours_mtp = dsv4_logits(model_dir, ids)
    ref_main, ref_mtp = training_logits(model, ids)
    out = {}
    for name, got, want in (("main", ours_main, ref_main), ("mtp", ours_mtp, ref_mtp)):
        out[name] = {"max_abs_diff": float((got - want).abs().max()), "ref_scale": float(want.abs().max()),
                     "argmax_agree": float((got.argmax(-1) == want.argmax(-1)).float().mean())}
    return out


def load_training_model(model_dir: str) -> demo_model.DemoModel:
    from dsv4.config import ModelConfig
    model = demo_model.DemoModel(ModelConfig.from_dir(model_dir))
    demo_model.load_exported(model, model_dir)
    return model


def heldout_ids(model_dir: str, length: int) -> list[int]:
    """A held-out text of `length` tokens: the held-out prompts and their bodies, concatenated."""
    from dsv4.text.tokenizer import Tokenizer
    tok = Tokenizer.from_dir(model_dir)
    with open(os.path.join(model_dir, "heldout.json"), encoding="utf-8") as f:
        prompts = json.load(f)["prompts"]
    ids = []
    for p in prompts:
        ids += tok.encode(p["prompt"] + p["reference_completion"])
        if len(ids) >= length:
            break
    return ids[:length]


def main(argv=None) -> int:
    model_dir = (argv or sys.argv[1:] or ["dsv4/assets/demo"])[0]
    result = compare(load_training_model(model_dir), model_dir, heldout_ids(model_dir, 300))
    print(json.dumps(result, indent=1))
    ok = all(r["max_abs_diff"] <= 1e-4 * r["ref_scale"] for r in result.values())
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
