"""`dsv4 init-random DIR --preset tiny|flash-slice`: write a random-weight V4 checkpoint."""
from __future__ import annotations

import torch

from ..model.random_init import PRESETS, preset_config, random_state, save_checkpoint


def register(subparsers) -> None:
    p = subparsers.add_parser("init-random", help="write a random-weight DeepSeek-V4 checkpoint")
    p.add_argument("out_dir")
    p.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    p.add_argument("--layers", type=int, default=None, help="number of main layers (default: the preset's)")
    p.add_argument("--names", choices=["deepseek", "transformers"], default="deepseek",
                   help="tensor naming scheme")
    p.add_argument("--quant", choices=["fp8"], default=None,
                   help="fp8: FP8 block-scaled weights and MXFP4 experts, as released")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=run)


def run(args) -> int:
    if args.layers is not None and args.layers < 1:
        raise SystemExit("dsv4 init-random: --layers must be at least 1")
    cfg = preset_config(args.preset, args.layers)
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[args.dtype]
    state = random_state(cfg, seed=args.seed, with_mtp=args.names == "deepseek")
    if args.quant and args.names == "transformers":
        raise SystemExit("dsv4 init-random: --quant fp8 writes DeepSeek's released format; use --names deepseek")
    save_checkpoint(cfg, state, args.out_dir, names=args.names, quant=args.quant, dtype=dtype)
    params = sum(t.numel() for t in state.values())
    print(f"wrote {args.out_dir}: preset {args.preset}, {cfg.num_hidden_layers} layers, {params / 1e6:.2f} M "
          f"parameters, {args.names} names{', fp8/mxfp4' if args.quant else ''}")
    return 0
