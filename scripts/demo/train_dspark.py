"""DSpark heads for the demo model (docs/speculative.md "DSpark", docs/demo-model.md).

The shipped demo model stays frozen. `--stages` window-only DSpark stages (three as in the
releases; the shipped drafter has one, docs/demo-model.md; targets: main layers 3, 4, 5; block 4;
Markov rank 64) are trained on the demo corpus's training files with teacher forcing,
through dsv4's own DSpark forward (dsv4/model/dspark.py, torch ops, autograd):
* taps of each training sequence from one frozen prefill (`OneSequence`, `DeepseekV4.forward`);
* every stage's window keys of all positions, then blocks [x_{t+1}, noise x 3] at random anchors t;
* loss: the cross-entropy of row i's logits + the Markov bias of the true previous token against
  x_{t+2+i} (every row), plus the binary cross-entropy of the confidence logit against "row i's
  corrected argmax is right" (features detached).
The stages start from the demo's trained MTP layer (attention, MoE, mHC, head collapse).
OUT gets a DSpark checkpoint: the demo's main weights, the stages as `mtp.0..L-1.*`, the DSpark
config fields, the tokenizer; `--speculative-config '{"method": "dspark", ...}'` serves it, and
`python -m scripts.demo.ship_dspark OUT` installs its stages as the demo's DSpark draft folder.
The learning rate warms up over the first 2% and decays (cosine, to 10%) over the run's progress:
the larger of steps done / `--steps` and wall time / `--max-minutes`, so a run fits a time budget.

    python -m scripts.demo.train_dspark --out DIR [--stages 3] [--steps 3000] [--max-minutes M]
                                        [--device cuda] [--smoke]
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import time

import torch
import torch.nn.functional as F

from dsv4.engine.oneshot import OneSequence
from dsv4.model.dspark import attach_dspark, run_block, stages, write_window
from dsv4.model.kv import LayerKV
from dsv4.ops.backend import set_backend

TARGETS, BLOCK, RANK = (3, 4, 5), 4, 64


def log(msg: str) -> None:
    print(msg, flush=True)


def training_tokens(tokenizer, max_files: int | None) -> torch.Tensor:
    """The demo corpus's training files (held-out ones excluded), each BOS source EOS, in one stream."""
    from scripts.demo import corpus
    return torch.tensor(corpus.code_token_stream(tokenizer, held_out=False, max_files=max_files), dtype=torch.long)


def noise_token(tokenizer_dir: str, stream: torch.Tensor) -> int:
    """The first added special token that never occurs in the training stream."""
    with open(os.path.join(tokenizer_dir, "tokenizer.json"), encoding="utf-8") as f:
        special = [t["id"] for t in json.load(f)["added_tokens"] if t["id"] > 3]
    used = set(stream.unique().tolist())
    return next(i for i in special if i not in used)


def build(model, noise: int, n_stages: int) -> None:
    """Give the frozen demo model `n_stages` DSpark stages, initialised from its MTP layer."""
    mtp = model.mtp[0] if len(model.mtp) else None
    model.cfg = model.cfg.replace(num_nextn_predict_layers=n_stages, dspark_block_size=BLOCK, dspark_noise_token_id=noise,
                                  dspark_target_layer_ids=TARGETS, dspark_markov_rank=RANK)
    model.mtp = torch.nn.ModuleList()
    with torch.device(model.head.weight.device):
        attach_dspark(model)
    g = torch.Generator().manual_seed(0)
    H = model.cfg.hidden_size
    src = dict(mtp.named_parameters()) if mtp is not None else {}
    for stage in stages(model):
        stage.cfg = model.cfg
        for name, p in stage.named_parameters():
            if name in src and src[name].shape == p.shape:
                p.data.copy_(src[name])
            elif name.endswith("norm.weight"):
                p.data.fill_(1.0)
            elif name in ("markov_head.markov_w2.weight", "confidence_head.proj.weight"):
                p.data.zero_()
            else:
                p.data.copy_(torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)
            p.requires_grad_(True)
    stages(model)[0].main_proj.weight.data.mul_((H / stages(model)[0].main_proj.weight.shape[1]) ** 0.5)


def sequence_loss(model, one: OneSequence, ids: torch.Tensor, anchors: int, gen: torch.Generator):
    """One training sequence -> (loss, row accuracy)."""
    cfg, P, W = model.cfg, ids.shape[0], model.cfg.sliding_window
    with torch.no_grad():
        taps = []
        model(one.batch(ids.tolist()), one.storage.layers, taps=taps)
        taps = torch.cat(taps, -1)
    dev = ids.device
    kv = [LayerKV(swa=torch.zeros(P, cfg.head_dim, device=dev)) for _ in
          range(cfg.num_hidden_layers + cfg.num_nextn_predict_layers)]
    positions = torch.arange(P, device=dev)
    write_window(model, taps, positions, positions, kv)
    t = torch.randint(0, P - BLOCK - 1, (anchors,), generator=gen).to(dev)         # the last committed position
    window = t[:, None] - W + 1 + torch.arange(W, device=dev)
    window = torch.where(window >= 0, window, -1)
    logits, x = run_block(model, ids[t + 1], t + 1, window, kv)
    last = stages(model)[-1]
    loss, hits = 0.0, 0.0
    for i in range(BLOCK):
        bias, e = last.markov_head(ids[t + 1 + i])
        row = logits[:, i] + bias
        target = ids[t + 2 + i]
        right = (row.argmax(-1) == target).float()
        conf = last.confidence_head(x[:, i].detach(), e.detach())
        loss = loss + F.cross_entropy(row, target) + 0.1 * F.binary_cross_entropy_with_logits(conf, right)
        hits += float(right.mean())
    return loss / BLOCK, hits / BLOCK


def learning_rate(peak: float, progress: float) -> float:
    """progress in [0, 1]: linear warm-up over the first 2%, then cosine decay to 10% of the peak."""
    if progress < 0.02:
        return peak * max(progress, 1e-3) / 0.02
    return peak * (0.1 + 0.45 * (1 + math.cos(math.pi * (progress - 0.02) / 0.98)))


def export(model, demo_dir: str, out: str) -> None:
    from dsv4.model.random_init import save_checkpoint
    state = {n: p.detach().cpu() for n, p in model.named_parameters()}
    state.update({n: b.cpu() for n, b in model.named_buffers() if "tid2eid" in n})
    save_checkpoint(model.cfg, state, out, names="deepseek", dtype=torch.bfloat16)
    for name in ("tokenizer.json", "tokenizer_config.json", "heldout.json"):
        shutil.copy(os.path.join(demo_dir, name), os.path.join(out, name))


def train(model, stream: torch.Tensor, args) -> tuple[list, int, int]:
    """AdamW on the stages over random windows of `stream` -> (curve [(loss, row accuracy)],
    steps, seconds). The run ends when its progress (the larger of steps / --steps and wall
    time / --max-minutes) reaches 1; the learning rate follows that progress."""
    params = [q for s in stages(model) for q in s.parameters()]
    opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0)
    one = OneSequence(model, args.seq_len)
    gen = torch.Generator().manual_seed(0)
    curve, t0, step = [], time.time(), 0
    budget = args.max_minutes * 60 if args.max_minutes else float("inf")
    while True:                                    # progress: the larger of steps and wall-time budget used
        progress = max(step / args.steps, (time.time() - t0) / budget)
        if progress >= 1:
            break
        step += 1
        start = int(torch.randint(0, stream.numel() - args.seq_len, (1,), generator=gen))
        loss, acc = sequence_loss(model, one, stream[start:start + args.seq_len], args.anchors, gen)
        for group in opt.param_groups:
            group["lr"] = learning_rate(args.lr, progress)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        curve.append((loss.item(), acc))
        if step % 25 == 0 or step == 1:
            recent = curve[-25:]
            log(f"step {step} progress {progress:.3f} lr {opt.param_groups[0]['lr']:.2e} "
                f"loss {sum(c[0] for c in recent) / len(recent):.3f} "
                f"row accuracy {sum(c[1] for c in recent) / len(recent):.3f} ({time.time() - t0:.0f}s)")
    return curve, step, round(time.time() - t0)


def main(argv=None) -> int:
    from dsv4.assets import DEMO_DIR
    from dsv4.model.weights import load_model
    from dsv4.text.tokenizer import Tokenizer
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--steps", type=int, default=3000)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--anchors", type=int, default=64, help="blocks per training sequence")
    p.add_argument("--stages", type=int, default=3, help="DSpark stages (the releases ship three)")
    p.add_argument("--max-minutes", type=float, default=None, help="stop after this much wall time")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--max-files", type=int, default=None, help="train on the first N training files only")
    p.add_argument("--smoke", action="store_true", help="a few steps on a few files, for a quick CPU run")
    args = p.parse_args(argv)
    if args.smoke:
        args.steps, args.seq_len, args.anchors, args.max_files = 12, 128, 16, 20
    set_backend("reference")                                   # autograd needs the torch ops
    tok = Tokenizer.from_dir(DEMO_DIR)
    stream = training_tokens(tok, args.max_files)
    log(f"training stream: {stream.numel()} tokens")
    model = load_model(DEMO_DIR, args.device, torch.float32)
    for q in model.parameters():
        q.requires_grad_(False)
    build(model, noise_token(DEMO_DIR, stream), args.stages)
    curve, steps, seconds = train(model, stream.to(args.device), args)
    export(model, DEMO_DIR, args.out)
    with open(os.path.join(args.out, "dspark_train.json"), "w") as f:
        json.dump({"steps": steps, "seconds": seconds, "args": vars(args), "curve": curve}, f)
    log(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
