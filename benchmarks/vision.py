"""Vision benchmark (docs/vision.md): tower + aligner throughput (images/s) at batch 1 and 32
for the released shapes with random weights, and the TTFT of a chat-sized request with one
image vs the same text alone. Checks first, on the device: the tower + aligner of the tiny
preset against the plain reference (dsv4/model/vision/reference.py), a batch of 32 released
images against each image alone, and the image request's greedy tokens whole vs chunked.

    python -m benchmarks.vision            # one H200, about 2 minutes
    python -m benchmarks.vision --smoke    # CPU, tiny sizes, seconds
"""
from __future__ import annotations

import argparse
import io
import sys
import time

import torch

from dsv4.config import EngineConfig
from dsv4.config_parse import VisionConfig
from dsv4.engine.engine import LLMEngine
from dsv4.model.random_init import preset_config, random_state
from dsv4.model.vision.grid import block_length
from dsv4.model.vision.preprocess import grid_of, image_hash, open_image, to_patches
from dsv4.model.vision.reference import reference_aligner, reference_vit
from dsv4.model.vision.spans import ImageSpan
from dsv4.model.vision.tower import Aligner, ViT, encode_images
from dsv4.sampling_params import SamplingParams

from .prefix_check import parting_margin

# DeepSeek-V4-Flash-Vision's tower (docs/vision.md) and the LLM width it feeds
RELEASED = dict(vision_n_layers=32, vision_dim=1024, vision_n_heads=16, vision_inter_dim=2816,
                vision_patch_size=14, vision_rope_theta=10000.0, vision_downsample_ratio=3,
                vision_max_n_token=384, vision_min_pixels=147456, vision_max_wh_ratio=8.0)


def png(w: int, h: int, seed: int) -> bytes:
    from PIL import Image
    g = torch.Generator().manual_seed(seed)
    img = Image.fromarray((torch.rand(h, w, 3, generator=g) * 255).to(torch.uint8).numpy())
    b = io.BytesIO()
    img.save(b, "PNG")
    return b.getvalue()


def vision_config(d: dict) -> VisionConfig:
    return VisionConfig(**{k[len("vision_"):]: v for k, v in d.items()})


def random_tower(v: VisionConfig, hidden: int, device, dtype):
    vit, aligner = ViT(v, dtype).to(device), Aligner(v, hidden, dtype).to(device)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in [*vit.named_parameters(), *aligner.named_parameters()]:
            if "norm" in name:
                p.fill_(1.0)
            else:
                p.copy_(torch.randn(p.shape, generator=gen) / p.shape[-1] ** 0.5)
    return vit, aligner


def sync(device):
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


@torch.no_grad()
def check_reference(device) -> bool:
    cfg = preset_config("tiny-vision")
    vit, aligner = random_tower(cfg.vision, cfg.hidden_size, device, torch.float32)
    patches, g = to_patches(open_image(png(40, 30, 0)), cfg.vision)
    ours = encode_images(vit, aligner, patches[None].to(device), g.n_vit_h, g.n_vit_w)[0].cpu().double()
    vit_c, al_c = vit.cpu(), aligner.cpu()
    ref = reference_aligner(al_c, reference_vit(vit_c, patches, g.n_vit_h, g.n_vit_w), g.n_vit_h, g.n_vit_w)
    err = float((ours - ref).abs().max() / ref.abs().max())
    print(f"tower + aligner vs reference (tiny, fp32 on {device}): max rel err {err:.2e}", flush=True)
    return err < 1e-4


@torch.no_grad()
def throughput(v: VisionConfig, hidden: int, device, dtype, side: int, batches: list[int],
               reps: int) -> tuple[dict, bool]:
    vit, aligner = random_tower(v, hidden, device, dtype)
    images = [open_image(png(side, side, s)) for s in range(max(batches))]
    patches = [to_patches(im, v) for im in images]
    g = patches[0][1]
    batch = torch.stack([p for p, _ in patches]).to(device, dtype)
    results, ok = {}, True
    for b in batches:
        out = encode_images(vit, aligner, batch[:b], g.n_vit_h, g.n_vit_w)       # warm-up
        sync(device)
        t0 = time.perf_counter()
        for _ in range(reps):
            out = encode_images(vit, aligner, batch[:b], g.n_vit_h, g.n_vit_w)
        sync(device)
        results[b] = b * reps / (time.perf_counter() - t0)
        if b > 1:
            alone = encode_images(vit, aligner, batch[b - 1:b], g.n_vit_h, g.n_vit_w)[0]
            err = float((out[b - 1].float() - alone.float()).abs().max() / alone.float().abs().max())
            ok &= err < (2e-2 if dtype == torch.bfloat16 else 1e-4)
            print(f"batch {b} vs alone: max rel err {err:.2e}", flush=True)
    print(f"image {side}x{side}: ViT grid {g.n_vit_h}x{g.n_vit_w}, LLM grid {g.n_llm_h}x{g.n_llm_w}", flush=True)
    return results, ok


def image_prompt(text: list[int], data: bytes, v: VisionConfig, token: int) -> tuple[list[int], tuple]:
    g = grid_of(open_image(data), v)
    start = len(text) // 2
    n = block_length(g.n_llm_h, g.n_llm_w, start)
    ids = text[:start] + [token] * n + text[start:]
    return ids, (ImageSpan(start, n, image_hash(data), data, g.n_llm_h, g.n_llm_w),)


def first_token(engine: LLMEngine, rid: str, ids: list[int], images=(), max_tokens: int = 1):
    """(seconds to the first token, the finished output with top-2 logprobs per position)."""
    t0 = time.perf_counter()
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=2)
    engine.add_request(rid, ids, params, images=images)
    ttft, done = None, None
    while engine.has_unfinished():
        for out in engine.step():
            if out.token_ids and ttft is None:
                ttft = time.perf_counter() - t0
            if out.finished:
                done = out
    return ttft, done


def ttft(spec: str, device, dtype: str, side: int, text_len: int, reps: int,
         cache_gb: float = 4.0, tie_margin: float = 0.1) -> tuple[dict, bool]:
    """Median TTFT of the text alone and with one image; whole = chunked prefill (greedy; in
    bf16 a parting whose top-2 margin is <= tie_margin counts as a summation-order tie)."""
    settings = dict(device=device, dtype=dtype, max_num_batched_tokens=4096, max_num_seqs=4, cache_memory_gb=cache_gb,
                    enable_prefix_caching=False, max_model_len=8192)
    eng = LLMEngine(spec, EngineConfig(**settings))
    v = eng.cfg.vision
    gen = torch.Generator().manual_seed(1)
    text = torch.randint(100, min(eng.cfg.vocab_size, 8000), (text_len,), generator=gen).tolist()
    ids, images = image_prompt(text, png(side, side, 7), v, v.image_token_id)
    first_token(eng, "warm-text", text)
    first_token(eng, "warm-image", ids, images)
    times = {"text": [], "image": []}
    for r in range(reps):
        eng.runner.vision.cache.clear()                 # every image request encodes its image
        times["text"].append(first_token(eng, f"t{r}", text)[0])
        times["image"].append(first_token(eng, f"i{r}", ids, images)[0])
    same = paths_agree(eng, spec, settings, ids, images, tie_margin)
    return {k: sorted(t)[len(t) // 2] for k, t in times.items()} | {"text_len": len(text), "image_len": len(ids)}, same


def paths_agree(eng: LLMEngine, spec: str, settings: dict, ids: list[int], images, tie_margin: float,
                reference: bool = False) -> bool:
    """The image request's greedy tokens, whole prefill (on `eng`) vs chunked in thirds, and vs
    the reference ops (`reference`: torch ops, eager). In fp32 they must be equal; in bf16 a
    parting whose top-2 margin is <= tie_margin counts as a summation-order tie."""
    whole = first_token(eng, "whole", ids, images, max_tokens=16)[1]
    others = {"chunked prefill": {"max_num_batched_tokens": len(ids) // 3}}
    if reference:
        others["reference ops"] = {"ops_backend": "reference", "enforce_eager": True}
    same = True
    for name, change in others.items():          # (the reference engine last: the backend is per process)
        other = LLMEngine(spec, EngineConfig(**{**settings, **change}), model=eng.model, tokenizer=eng.tokenizer)
        got = first_token(other, name, ids, images, max_tokens=16)[1]
        margin = parting_margin(got, whole)
        ok = margin is None or (settings["dtype"] != "float32" and margin <= tie_margin)
        same &= ok
        verdict = ("same" if margin is None else f"DIFFER, whole run's top-2 logprob margin {margin:.4f} at the "
                   f"first parting ({'a near-tie' if ok else 'NOT a tie'})")
        print(f"image request greedy tokens ({settings['dtype']}), whole vs {name}: {verdict}", flush=True)
    return same


def fp32_paths(spec: str, device, side: int, text_len: int, cache_gb: float) -> bool:
    """paths_agree in fp32 (a smaller model where the bf16 one would not fit in fp32): whole vs
    chunked prefill and fast vs reference ops must give the same greedy tokens."""
    settings = dict(device=device, dtype="float32", max_num_batched_tokens=2048, max_num_seqs=4,
                    cache_memory_gb=cache_gb, enable_prefix_caching=False, max_model_len=2048,
                    enforce_eager=True)   # prefill paths are compared; graphs would only add start-up
    eng = LLMEngine(spec, EngineConfig(**settings))
    v = eng.cfg.vision
    text = torch.randint(100, min(eng.cfg.vocab_size, 8000), (text_len,), generator=torch.Generator().manual_seed(2)).tolist()
    ids, images = image_prompt(text, png(side, side, 7), v, v.image_token_id)
    return paths_agree(eng, spec, settings, ids, images, 0.0, reference=True)


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--smoke", action="store_true", help="CPU, tiny sizes")
    p.add_argument("--fp32-paths-only", action="store_true",
                   help="only the fp32 check: whole vs chunked prefill vs reference ops (about a minute)")
    args = p.parse_args(argv)
    if args.smoke:
        device, dtype, tdtype = "cpu", torch.float32, "float32"
        v, hidden, side, batches, reps = preset_config("tiny-vision").vision, 64, 40, [1, 4], 2
        spec, text_len = "random:tiny-vision", 40
        spec32 = spec
    else:
        device, dtype, tdtype = "cuda", torch.bfloat16, "bfloat16"
        v, hidden, side, batches, reps = vision_config(RELEASED), 4096, 1024, [1, 32], 5
        overrides = ",".join(f"{k}={val}" for k, val in RELEASED.items())
        # four layers: two window-only, one C4 (CSA), one C128 (HCA), as the released model begins
        spec, text_len = f"random:flash-slice:4:{overrides},image_token_id=128000", 1024
        spec32 = f"{spec},n_routed_experts=8"
    if args.fp32_paths_only:
        ok = fp32_paths(spec32, device, side, text_len, cache_gb=0.25 if args.smoke else 4.0)
        print("checks:", "PASS" if ok else "FAIL")
        return 0 if ok else 1
    ok = check_reference(device)
    rates, ok_batch = throughput(v, hidden, device, dtype, side, batches, reps)
    times, ok_tokens = ttft(spec, device, tdtype, side, text_len, 3, cache_gb=0.25 if args.smoke else 4.0)
    ok_tokens &= fp32_paths(spec32, device, side, text_len, cache_gb=0.25 if args.smoke else 4.0)
    print()
    print("| measure | value |")
    print("|---|---|")
    for b, r in rates.items():
        print(f"| tower + aligner, batch {b} | {r:.1f} images/s ({1000 / r:.1f} ms per image) |")
    print(f"| TTFT text alone ({times['text_len']} tokens) | {times['text'] * 1000:.1f} ms |")
    print(f"| TTFT text + one {side}x{side} image ({times['image_len']} tokens) | {times['image'] * 1000:.1f} ms |")
    print(f"| ratio image / text | {times['image'] / times['text']:.2f} |")
    all_ok = ok and ok_batch and ok_tokens
    print("checks:", "PASS" if all_ok else "FAIL")
    return 0 if all_ok else 1


if __name__ == "__main__":
    sys.exit(main())
