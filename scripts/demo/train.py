"""Build the bundled demo model (docs/demo-model.md) in one command:

    python -m scripts.demo.train --out DIR

1. corpus from the CPython standard library (scripts/demo/corpus.py), 2% of files held out;
2. a byte-level BPE tokenizer with every V4 special token (`tokenizers`);
3. training of a small DeepSeek-V4 model with one MTP layer (scripts/demo/model.py) on one GPU,
   or slowly on CPU, for a fixed wall-clock budget or number of steps;
4. evaluation on the held-out files (main model and MTP head, at the shipped bf16 precision);
5. export in DeepSeek's released names, bf16, with a released-schema config.json, tokenizer
   and held-out prompts, checked against dsv4 (main and MTP logits): DIR/model is what ships
   as dsv4/assets/demo (`--ship` installs it there; scripts/demo/ship.py does it afterwards).

DIR/data caches steps 1-2 (delete it to rebuild; `--data` points elsewhere). Everything is
seeded; on GPU, kernels are not bit-deterministic, so reruns agree closely but not exactly.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shutil
import sys
import time

import numpy as np
import torch


from scripts.demo import corpus as demo_corpus
from scripts.demo import model as demo_model

VAL_KINDS = ("code", "chat")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="output folder (data/, model/, metrics.json, train.log)")
    p.add_argument("--data", help="corpus + tokenizer cache folder (default OUT/data)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--smoke", action="store_true", help="a tiny model, for a quick CPU run of every step")
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--batch", type=int, default=64, help="sequences per optimizer step")
    p.add_argument("--steps", type=int, help="optimizer steps (default: as many as fit --train-seconds)")
    p.add_argument("--train-seconds", type=float, default=330.0)
    p.add_argument("--amp", action=argparse.BooleanOptionalAction, default=None,
                   help="bf16 autocast for training (default: on for CUDA)")
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--warmup", type=int, default=40)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--mtp-weight", type=float, default=0.3)
    p.add_argument("--indexer-weight", type=float, default=1.0)
    p.add_argument("--bias-rate", type=float, default=1e-3, help="expert-balancing bias step")
    p.add_argument("--eval-windows", type=int, default=128, help="held-out windows per kind")
    p.add_argument("--log-every", type=int, default=20)
    p.add_argument("--shard-mb", type=float, default=0, help="split the checkpoint into shards (0: one file)")
    p.add_argument("--ship", action="store_true", help="then install OUT/model as dsv4/assets/demo")
    return p.parse_args(argv)


class Log:
    def __init__(self, path: str):
        self.file = open(path, "a", encoding="utf-8")

    def __call__(self, msg: str):
        line = f"[{time.strftime('%H:%M:%S')}] {msg}"
        print(line, flush=True)
        self.file.write(line + "\n")
        self.file.flush()


# ---- 1-2: corpus and tokenizer ---------------------------------------------------------------

def build_data(data_dir: str, vocab: int, seed: int, log: Log) -> dict:
    """Corpus -> tokenizer -> token streams (uint16 .npy) + held-out prompts, cached in data_dir."""
    meta_path = os.path.join(data_dir, "meta.json")
    if os.path.isfile(meta_path):
        with open(meta_path) as f:
            meta = json.load(f)
        log(f"data: reusing {data_dir} (stdlib of Python {meta['python']})")
        return meta
    from dsv4.text.tokenizer import train_test_tokenizer
    t0 = time.time()
    os.makedirs(data_dir, exist_ok=True)
    corpus = demo_corpus.build_corpus(seed=seed)
    log(f"corpus: {corpus.files[0]} train files, {corpus.files[1]} held out; "
        + ", ".join(f"{k} {len(v)} docs" for k, v in corpus.train.items()))
    tok = train_test_tokenizer([d for k in ("code", "chat") for d in corpus.train[k]], vocab, data_dir)
    log(f"tokenizer: {tok.vocab_size} ids ({time.time() - t0:.0f}s so far)")
    rng = np.random.default_rng(seed)
    train_docs = [d for k in ("code", "function", "chat") for d in corpus.train[k]]
    train_docs = [train_docs[i] for i in rng.permutation(len(train_docs))]
    streams = {"train": train_docs, **{f"val_{k}": corpus.val[k] for k in VAL_KINDS}}
    tokens = {}
    for name, docs in streams.items():
        ids = np.concatenate([np.asarray(e.ids, dtype=np.uint16)
                              for e in tok._hf.encode_batch(docs, add_special_tokens=False)])
        np.save(os.path.join(data_dir, f"{name}.npy"), ids)
        tokens[name] = int(ids.size)
    prompts = demo_corpus.heldout_prompts(corpus.heldout_functions)
    with open(os.path.join(data_dir, "heldout.json"), "w", encoding="utf-8") as f:
        json.dump({"source": "held-out CPython standard-library files (2% by path hash)",
                   "prompts": prompts}, f, indent=1, ensure_ascii=False)
    meta = {"python": platform.python_version(), "stdlib": demo_corpus.stdlib_root(),
            "files": {"train": corpus.files[0], "heldout": corpus.files[1]},
            "docs": {s: {k: len(v) for k, v in d.items()} for s, d in (("train", corpus.train), ("val", corpus.val))},
            "train_tokens_by_kind": {k: sum(len(e.ids) for e in tok._hf.encode_batch(v, add_special_tokens=False))
                                     for k, v in corpus.train.items()},
            "tokens": tokens, "vocab": tok.vocab_size, "seconds": round(time.time() - t0, 1)}
    with open(meta_path, "w") as f:
        json.dump(meta, f, indent=1)
    log(f"data: {tokens} tokens in {meta['seconds']}s")
    return meta


def load_stream(data_dir: str, name: str, device) -> torch.Tensor:
    return torch.from_numpy(np.load(os.path.join(data_dir, f"{name}.npy")).astype(np.int64)).to(device)


# ---- 3: training ---------------------------------------------------------------------------------

def lr_at(step: int, total: int, args) -> float:
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    frac = min(1.0, (step - args.warmup) / max(1, total - args.warmup))
    return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))


def make_optimizer(model: torch.nn.Module, args) -> torch.optim.Optimizer:
    decay, plain = [], []
    for name, p in model.named_parameters():
        (decay if p.ndim >= 2 and "hc" not in name.rsplit(".", 1)[-1] else plain).append(p)
    groups = [{"params": decay, "weight_decay": args.weight_decay}, {"params": plain, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.95), eps=1e-8,
                             fused=str(args.device).startswith("cuda"))


def train(model: demo_model.DemoModel, stream: torch.Tensor, args, log: Log) -> dict:
    device, L = args.device, args.seq_len
    amp = args.amp if args.amp is not None else torch.device(device).type == "cuda"
    opt = make_optimizer(model, args)
    gen = torch.Generator().manual_seed(args.seed + 1)
    span = torch.arange(L + 2, device=device)
    micro, accum = args.batch, 1
    total = args.steps or 10 ** 9
    curve, t0, step, tokens = [], time.time(), 0, 0
    model.train()
    while step < total:
        for group in opt.param_groups:
            group["lr"] = lr_at(step, total, args)
        starts = torch.randint(0, stream.numel() - L - 2, (args.batch,), generator=gen).to(device)
        batch = stream[starts[:, None] + span]
        try:
            losses = _step(model, opt, batch, micro, accum, amp, args)
        except torch.OutOfMemoryError:
            if step or micro == 1:
                raise
            opt.zero_grad(set_to_none=True)
            torch.cuda.empty_cache()
            micro, accum = micro // 2, accum * 2
            log(f"out of memory: micro-batch {micro} x {accum} accumulation steps")
            continue
        step += 1
        tokens += args.batch * L
        elapsed = time.time() - t0
        if step == 5:
            t5 = elapsed
        if args.steps is None and step == 10:   # steps 5-10 time the steady state
            per_step = (elapsed - t5) / 5
            total = max(step + 1, step + int((args.train_seconds - elapsed) / per_step))
            log(f"schedule: {total} steps fit {args.train_seconds:.0f}s ({per_step:.2f}s/step)")
        if step % args.log_every == 0 or step == total:
            row = {"step": step, "tokens": tokens, "seconds": round(elapsed, 1), "lr": lr_at(step - 1, total, args),
                   **{k: round(v, 4) for k, v in losses.items()}}
            curve.append(row)
            log(f"step {step}/{total} loss {losses['loss']:.3f} mtp {losses['mtp_loss']:.3f} "
                f"indexer {losses['indexer_kl']:.3f} lr {row['lr']:.2e} {tokens / elapsed / 1e3:.0f}k tok/s")
        if args.steps is None and elapsed > args.train_seconds * 1.15:
            log(f"stopping at step {step}: over the time budget")
            break
    return {"steps": step, "tokens": tokens, "seconds": round(time.time() - t0, 1), "batch": args.batch,
            "seq_len": L, "micro_batch": micro, "amp_bf16": amp, "curve": curve}


def _step(model, opt, batch, micro, accum, amp, args) -> dict:
    sums = {"loss": 0.0, "mtp_loss": 0.0, "indexer_kl": 0.0}
    loads = []
    for chunk in batch.split(micro):
        with torch.autocast(batch.device.type, dtype=torch.bfloat16, enabled=amp):
            logits, mtp_logits, idx = model(chunk, with_indexer_loss=args.indexer_weight > 0)
            main, mtp = demo_model.lm_losses(logits, mtp_logits, chunk)
            idx = idx if idx is not None else torch.zeros((), device=chunk.device)
            loss = (main + args.mtp_weight * mtp + args.indexer_weight * idx) / accum
        loss.backward()
        loads.extend(model.router_loads())
        sums["loss"] += main.item() / accum
        sums["mtp_loss"] += mtp.item() / accum
        sums["indexer_kl"] += idx.item() / accum
        del logits, mtp_logits, loss
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    opt.zero_grad(set_to_none=True)
    demo_model.balance_router_bias(loads, args.bias_rate)
    return sums


# ---- 4: evaluation --------------------------------------------------------------------------------

@torch.no_grad()
def evaluate(model: demo_model.DemoModel, stream: torch.Tensor, L: int, max_windows: int, batch: int) -> dict:
    """Held-out next-token (main) and next-next-token (MTP) loss, perplexity and accuracy, and
    the MTP head's top-1 agreement with the main model's own prediction of the same token."""
    model.eval()
    n = min(stream.numel() // (L + 2), max_windows)
    windows = stream[:n * (L + 2)].view(n, L + 2)
    tot = {"main_nll": 0.0, "mtp_nll": 0.0, "main_hit": 0, "mtp_hit": 0, "agree": 0}
    count = agree_count = 0
    for chunk in windows.split(batch):
        logits, mtp_logits, _ = model(chunk)
        V = logits.shape[-1]
        tot["main_nll"] += float(torch.nn.functional.cross_entropy(
            logits.float().reshape(-1, V), chunk[:, 1:-1].reshape(-1), reduction="sum"))
        tot["mtp_nll"] += float(torch.nn.functional.cross_entropy(
            mtp_logits.float().reshape(-1, V), chunk[:, 2:].reshape(-1), reduction="sum"))
        main_top, mtp_top = logits.argmax(-1), mtp_logits.argmax(-1)
        tot["main_hit"] += int((main_top == chunk[:, 1:-1]).sum())
        tot["mtp_hit"] += int((mtp_top == chunk[:, 2:]).sum())
        tot["agree"] += int((mtp_top[:, :-1] == main_top[:, 1:]).sum())   # both predict x_{t+2}
        count += chunk.shape[0] * L
        agree_count += chunk.shape[0] * (L - 1)
    model.train()
    main_loss, mtp_loss = tot["main_nll"] / count, tot["mtp_nll"] / count
    return {"windows": n, "tokens": count, "main_loss": main_loss, "main_ppl": math.exp(main_loss),
            "main_top1": tot["main_hit"] / count, "mtp_loss": mtp_loss, "mtp_ppl": math.exp(mtp_loss),
            "mtp_top1": tot["mtp_hit"] / count, "mtp_agreement": tot["agree"] / agree_count}


# ---- 5: export ------------------------------------------------------------------------------------

def export(model: demo_model.DemoModel, data_dir: str, out_dir: str, shard_mb: float) -> None:
    from dsv4.model.random_init import save_checkpoint
    state = demo_model.export_state(model)
    if os.path.isdir(out_dir):
        shutil.rmtree(out_dir)
    max_shard = int(shard_mb * 2 ** 20) if shard_mb else 1 << 40
    save_checkpoint(model.cfg, state, out_dir, names="deepseek", dtype=torch.bfloat16, max_shard_bytes=max_shard)
    for name in ("tokenizer.json", "tokenizer_config.json", "heldout.json"):
        shutil.copy(os.path.join(data_dir, name), out_dir)


def verify_export(model: demo_model.DemoModel, model_dir: str) -> dict:
    """dsv4's main and MTP logits on the exported checkpoint against the trained model's (the
    model moves to the CPU: training is over)."""
    from scripts.demo import verify as demo_verify
    return demo_verify.compare(model.cpu(), model_dir, demo_verify.heldout_ids(model_dir, 300))


def main(argv=None) -> int:
    args = parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    log = Log(os.path.join(args.out, "train.log"))
    data_dir = args.data or os.path.join(args.out, "data")
    t_start = time.time()
    meta = build_data(data_dir, args.vocab, args.seed, log)
    device = torch.device(args.device)
    cfg = demo_model.demo_config(meta["vocab"], smoke=args.smoke)
    model = demo_model.DemoModel(cfg, seed=args.seed).to(device)
    params = demo_model.count_params(model)
    log(f"model: {params} parameters on {device}"
        + (f" ({torch.cuda.get_device_name(device)})" if device.type == "cuda" else ""))
    train_stream = load_stream(data_dir, "train", device)
    run = train(model, train_stream, args, log)
    del train_stream
    demo_model.round_to_shipped_precision_(model)
    t_eval = time.time()
    evals = {}
    for kind in VAL_KINDS:
        try:
            evals[kind] = evaluate(model, load_stream(data_dir, f"val_{kind}", device), args.seq_len,
                                   args.eval_windows, max(1, run["micro_batch"] // 4))
        except Exception as e:  # keep the trained model whatever happens here
            evals[kind] = {"error": repr(e)}
    log("eval (held-out, shipped bf16 weights, fp32 compute): " + json.dumps(evals))
    model_dir = os.path.join(args.out, "model")
    export(model, data_dir, model_dir, args.shard_mb)
    try:
        verify = verify_export(model, model_dir)
    except Exception as e:
        verify = {"error": repr(e)}
    log(f"export check (dsv4 vs the trained model, fp32 CPU): {json.dumps(verify)}")
    import transformers
    metrics = {"params": params, "config": cfg.to_released_dict(), "data": meta, "train": run, "eval": evals, "export_check": verify,
               "eval_seconds": round(time.time() - t_eval, 1), "total_seconds": round(time.time() - t_start, 1),
               "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
               "torch": torch.__version__, "transformers": transformers.__version__,
               "args": {k: v for k, v in vars(args).items()}}
    with open(os.path.join(args.out, "metrics.json"), "w") as f:
        json.dump(metrics, f, indent=1)
    log(f"done in {metrics['total_seconds']:.0f}s: {model_dir}")
    if args.ship:
        import ship_demo
        ship_demo.ship(model_dir)
        log(f"installed as {ship_demo.DEMO_DIR}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
